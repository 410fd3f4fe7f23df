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
    p.add_argument("--nproc", type=int, metavar="N",
                   help="train data-parallel in N processes on this machine: sleuth checks the "
                   "run directory, then starts them itself (torchrun --standalone "
                   "--nproc_per_node=N), so a refusal or a failed rank is one line")
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
    if args.nproc is not None:
        return _launch(args, config)
    try:
        callbacks = build_callbacks(args, config)
        trainer.train(config, callbacks=callbacks, argv=["sleuth", *sys.argv[1:]])
    except trainer.OtherRunError as e:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank refuses alike
            trainer.report_refusal(f"sleuth train: error: {e}")
            trainer.exit_worker(2)
        raise CliError(str(e)) from e
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


def _launch(args: argparse.Namespace, config: Any) -> int:
    """`--nproc N`: check the run directory here, then run N workers under torch's elastic
    launcher in this process, so that a refusal is one line before any process starts, and a
    rank that fails later is one line too (its own error above it), not torchrun's report."""
    import logging

    import trainer

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CliError("--nproc starts the processes itself; under torchrun, leave it out")
    if args.nproc < 1:
        raise CliError(f"--nproc {args.nproc}: give 1 or more processes")
    try:
        run_id = trainer.check_run_dir(config)
    except trainer.TrainerError as e:
        raise CliError(str(e)) from e
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    launch = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={args.nproc}",
                                           "--module", "sleuth", "train", *_worker_argv(args)])
    # every worker writes the run checked here; torchrun's own thread-count banner is moot
    saved = {k: os.environ.get(k) for k in ("SLEUTH_RUN_ID", "OMP_NUM_THREADS")}
    os.environ["SLEUTH_RUN_ID"] = run_id
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    elastic.setLevel(logging.CRITICAL)  # a failed rank is reported below, in one line
    try:
        run(launch)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = f"exit code {code}" if code >= 0 else f"signal {-code}"
        print(f"sleuth train: error: rank {rank} of {args.nproc} ended with {how} (its "
              f"message is above); the other ranks were stopped", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code
    finally:
        elastic.setLevel(level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return 0


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The `sleuth train` arguments of each worker: this command's, without --nproc."""
    argv = ["--preset", args.preset]
    for flag, value in (("--config", args.config), ("--run-dir", args.run_dir),
                        ("--resume", args.resume), ("--dump", args.dump),
                        ("--profile", args.profile)):
        if value is not None:
            argv.append(f"{flag}={value}")
    for override in args.overrides:
        argv += ["--set", override]
    argv += [flag for flag, on in (("--overwrite", args.overwrite), ("--summary", args.summary),
                                   ("--save-graphs", args.save_graphs)) if on]
    return argv
