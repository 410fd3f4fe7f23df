"""`sleuth train`: train the reference GPT (also under torchrun), with the tools attached by flags.

`_run` builds the config, asks `build_callbacks` for the tools' callbacks, then trains. Tool
flags (--dump, --profile, ...) are added in `register` and turned into callbacks in
`build_callbacks`; the trainer itself knows nothing of them.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
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
    p.add_argument("--overwrite", action="store_true",
                   help="replace the files of another run found in the run directory (only "
                   "files Sleuth writes; a resumed run needs none)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    tools = p.add_argument_group("tools (write into the run directory)")
    tools.add_argument("--dump", metavar="CONFIG.json",
                       help="dump tensors with this dump config (`sleuth docs dump-config`)")
    tools.add_argument("--profile", nargs="?", const="1", metavar="CONFIG.json",
                       help="profile steps (default schedule: wait 1, warmup 1, active 3); "
                       "optional collector config")
    tools.add_argument("--summary", action="store_true",
                       help="log scalars every step and weight/gradient histograms every 10 steps")
    tools.add_argument("--save-graphs", action="store_true",
                       help="export IR graphs (text, ordered text, dot, svg) before the first step")
    p.set_defaults(run=_run)


def build_config(args: argparse.Namespace):
    """The TrainConfig the flags describe (CliError on a bad key or value)."""
    import trainer

    try:
        overwrite = ["overwrite=true"] if getattr(args, "overwrite", False) else []
        return trainer.load_config(args.config, preset=args.preset,
                                   overrides=[*args.overrides, *overwrite],
                                   run_dir=args.run_dir, resume=args.resume)
    except trainer.ConfigError as e:
        raise CliError(str(e)) from e


def build_callbacks(args: argparse.Namespace, config: Any) -> list:
    """The tools' callbacks for this run, from the tool flags."""
    import dataclasses

    from sleuth._callbacks import DumpCallback, callbacks_from_flags

    callbacks = callbacks_from_flags(dump=args.dump, profile=args.profile, summary=args.summary,
                                     save_graphs=args.save_graphs)
    if config.overwrite:  # the trainer removes the old run's files; the dump's writer agrees
        for cb in callbacks:
            if isinstance(cb, DumpCallback):
                cb.config = dataclasses.replace(cb.config, overwrite=True)
    return callbacks


def _run(args: argparse.Namespace) -> int:
    import json

    import irdump
    import profiler
    import tracer
    import trainer

    config = build_config(args)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    try:
        callbacks = build_callbacks(args, config)
        trainer.train(config, callbacks=callbacks, argv=["sleuth", *sys.argv[1:]])
    except (trainer.TrainerError, tracer.TracerError, profiler.ProfilerError,
            irdump.IrDumpError) as e:
        raise CliError(str(e)) from e
    if int(os.environ.get("RANK", "0") or 0) == 0:  # once per run, not once per rank
        from sleuth._written import written_line

        wrote = "metrics.jsonl" + (", checkpoints" if trainer.RunDir(config.run_dir)
                                   .latest_checkpoint() is not None else "")
        print(written_line("train", Path(config.run_dir), also=wrote), file=sys.stderr,
              flush=True)
    trainer.exit_worker()  # under torchrun: past gloo's teardown (trainer._distributed)
    return 0
