"""`sleuth train`: train the reference GPT (also under torchrun), with the tools attached by flags.

`_run` builds the config, asks `build_callbacks` for the tools' callbacks, then trains. Tool
flags (--dump, --profile, ...) are added in `register` and turned into callbacks in
`build_callbacks`; the trainer itself knows nothing of them.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from sleuth.cli import CliError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train", help="train the reference GPT",
        description="Train the reference GPT on json/jsonl/parquet data or the built-in demo corpus "
        "(stdlib docstrings). Config = preset, then --config FILE, then --set overrides. Under "
        "`torchrun --nproc_per_node=N -m sleuth train ...` it runs data-parallel (DDP; "
        "--set parallel=fsdp for FSDP). Progress goes to stdout and RUN/metrics.jsonl.",
    )
    p.add_argument("--config", metavar="FILE.json", help="JSON file of config keys (any subset)")
    p.add_argument("--preset", default="tiny", help="starting config: tiny (default) or small")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set optim.lr=1e-3 --set data.mode=sft (repeatable)")
    p.add_argument("--run-dir", metavar="DIR", help="run directory (default: the config's run_dir)")
    p.add_argument("--resume", metavar="CKPT", help="checkpoint or run directory to continue from, or 'latest'")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.set_defaults(run=_run)


def build_config(args: argparse.Namespace):
    """The TrainConfig the flags describe (CliError on a bad key or value)."""
    import trainer

    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    if args.resume:
        overrides.append(f"resume={args.resume}")
    try:
        return trainer.load_config(args.config, preset=args.preset, overrides=overrides)
    except trainer.ConfigError as e:
        raise CliError(str(e)) from e


def build_callbacks(args: argparse.Namespace, config: Any) -> list:
    """The tools' callbacks for this run, from the tool flags (none yet)."""
    return []


def _run(args: argparse.Namespace) -> int:
    import json

    import trainer

    config = build_config(args)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    callbacks = build_callbacks(args, config)
    try:
        trainer.train(config, callbacks=callbacks, argv=["sleuth", *sys.argv[1:]])
    except trainer.TrainerError as e:
        raise CliError(str(e)) from e
    return 0
