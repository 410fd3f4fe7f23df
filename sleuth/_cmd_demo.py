"""`sleuth demo`: the main job, end to end, on the built-in corpus.

Trains the reference GPT twice with every tool on (summary, profiler, dump, IR export): a
baseline in fp32 and a variant under bf16 autocast, the kind of change that makes two runs
disagree. Then it diffs the two dumps, names the first divergent record, and serves the
dashboard over both runs.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from sleuth.cli import CliError

# Full tensors (and their statistics) of every module and op on the first step, so the diff can
# measure cosine similarity and errors, not only statistics; about 45 MB per run.
# The demo owns its two runs: running it again replaces their dumps.
_DUMP_CONFIG = {"steps": "0", "level": "mix", "mode": "full", "writer": "async",
                "overwrite": True}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="train two runs with every tool on, diff them, serve the dashboard",
        description="The main job: train the reference GPT (fp32 baseline, then a bf16-autocast "
        "variant) with summary, profiler, tensor dump and IR export on, diff the two dumps, and "
        "serve the dashboard over both runs on 127.0.0.1.",
    )
    p.add_argument("--out", default="runs/demo", help="folder for the two runs (default runs/demo)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--host", default="127.0.0.1", help="dashboard address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="dashboard port (default 8050)")
    p.add_argument("--no-serve", action="store_true", help="stop after the diff; serve nothing")
    p.set_defaults(run=_run)


def _train(name: str, out: Path, steps: int, dump_config: Path, overrides: list[str]) -> Path:
    import trainer

    from sleuth._tools import callbacks_from_flags

    run_dir = out / name
    config = trainer.load_config(None, preset="tiny", overrides=[
        f"name={name}", f"run_dir={run_dir}", f"steps={steps}", "eval_every=5", *overrides])
    callbacks = callbacks_from_flags(dump=str(dump_config), profile="1", summary=True,
                                     save_graphs=True)
    print(f"== training {name} ({steps} steps) -> {run_dir}", flush=True)
    trainer.train(config, callbacks=callbacks, argv=["sleuth", "demo"])
    return run_dir


def _run(args: argparse.Namespace) -> int:
    import tracer

    if args.steps < 1:
        raise CliError(f"--steps must be at least 1, got {args.steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dump_config = out / "dump.json"
    dump_config.write_text(json.dumps(_DUMP_CONFIG, indent=2) + "\n")

    baseline = _train("baseline", out, args.steps, dump_config, [])
    variant = _train("bf16", out, args.steps, dump_config, ["precision=bf16"])

    print("== sleuth diff baseline bf16 --step 0", flush=True)
    result = tracer.diff(baseline, variant, step=0)
    first = result.first_divergence
    if first is None:
        print(f"status: {result.status}; no record diverges")
    else:
        print(f"status: {result.status}; first divergence: {first['name']} "
              f"(module {first['module']}, op {first['op'] or '-'}, {first['phase']}, "
              f"source {first['source']})")
    print(f"   full report: sleuth diff {baseline} {variant} --step 0", flush=True)
    if args.no_serve:
        return 0
    from sleuth.cli import main

    return main(["dashboard", str(baseline), str(variant), "--host", args.host,
                 "--port", str(args.port), "--no-browser"])
