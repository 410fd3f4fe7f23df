"""`sleuth demo`: the main job, end to end, on the built-in corpus.

Trains the reference GPT twice with every tool on (summary, profiler, dump, IR export): a
baseline in fp32 and a variant under bf16 autocast, the kind of change that makes two runs
disagree. Then it diffs the two dumps (what changed, the first divergent record), asks
`sleuth explain` whether that divergence is a bug or the rounding bf16 brings, ends with its
verdict, and serves the dashboard over both runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from sleuth._diff_report import explain_command, headline
from sleuth.cli import CliError

# Full tensors (and their statistics) of every module and op on the first step, so the diff can
# measure cosine similarity and errors, not only statistics, and explain can re-run the ops;
# about 45 MB per run.
# The demo owns its two runs: overwrite lets a re-run replace their dumps even if removing the
# previous runs left something behind.
_DUMP_CONFIG = {"steps": "0", "level": "mix", "mode": "full", "writer": "async",
                "overwrite": True}
_RUNS = ("baseline", "bf16")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="train two runs with every tool on, diff them, serve the dashboard",
        description="The main job: train the reference GPT (fp32 baseline, then a bf16-autocast "
        "variant) with summary, profiler, tensor dump and IR export on, diff the two dumps, give "
        "`sleuth explain`'s verdict on their divergence (a bug, or rounding), and serve the "
        "dashboard over both runs on 127.0.0.1.",
    )
    p.add_argument("--out", default="runs/demo", help="folder for the two runs (default runs/demo)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--host", default="127.0.0.1", help="dashboard address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="dashboard port (default 8050)")
    p.add_argument("--no-serve", action="store_true", help="stop after the diff; serve nothing")
    p.set_defaults(run=_run)


def _clear_previous_runs(out: Path) -> None:
    """The demo owns `OUT/baseline` and `OUT/bf16`: a re-run replaces them, so no file of an
    earlier run (a step it dumped, a profile window) sits beside the new run's and shows in the
    dashboard or the diff as if this run had made it. A folder there that is not a run is left
    alone: it may be the user's."""
    previous = [out / name for name in _RUNS if (out / name).exists()]
    for folder in previous:
        if not (folder / "run.json").is_file():
            raise CliError(f"{folder} exists and is not a run directory (no run.json); the demo "
                           "writes its runs there: move that folder or pick another --out")
    if previous:
        print(f"== removing the previous demo runs: {', '.join(map(str, previous))}", flush=True)
        for folder in previous:
            shutil.rmtree(folder)


def _train(name: str, out: Path, steps: int, dump_config: Path, overrides: list[str]) -> Path:
    """Train one run in a child process, `sleuth train` with every tool on.

    A process of its own, so that training ending means the tools ending: the tracer's flight
    recorder keeps its SIGTERM handler and excepthook for the life of the process that traced,
    and in the demo's own process a later Ctrl-C or SIGTERM to the dashboard would write a
    flight recorder file into a run that finished cleanly minutes before.
    """
    from sleuth._autoattach import _TOOLS

    run_dir = out / name
    argv = ["train", "--preset", "tiny", "--run-dir", str(run_dir), "--set", f"name={name}",
            "--set", f"steps={steps}", "--set", "eval_every=5",
            *(x for o in overrides for x in ("--set", o)),
            "--dump", str(dump_config), "--profile", "--summary", "--save-graphs"]
    print(f"== training {name} ({steps} steps): sleuth {' '.join(argv)}", flush=True)
    # the flags attach the tools; SLEUTH_* variables in this shell would attach them twice
    env = {k: v for k, v in os.environ.items() if k not in _TOOLS}
    code = subprocess.run([sys.executable, "-m", "sleuth", *argv], env=env).returncode
    if code != 0:
        raise CliError(f"training {name} failed (exit code {code}); its messages are above")
    return run_dir


def _explain(baseline: Path, variant: Path) -> None:
    """The verdict on the divergence: a bug, or the rounding bf16 brings (the demo's dumps are
    op-level tensor dumps, which `explain` re-runs ops from)."""
    from tracer import TracerError
    from tracer.analysis import explain

    command = explain_command(str(baseline), str(variant), 0)
    print("== sleuth explain baseline bf16 --step 0", flush=True)
    try:
        verdict = explain(baseline, variant, step=0).verdict
    except TracerError as e:
        print(f"explain could not give a verdict: {e}")
    else:
        print(verdict)
    print(f"   op by op: {command}", flush=True)


def _run(args: argparse.Namespace) -> int:
    import tracer

    if args.steps < 1:
        raise CliError(f"--steps must be at least 1, got {args.steps}")
    if not args.no_serve:  # now, not after minutes of training
        from sleuth._cmd_dashboard import check_port

        check_port(args.host, args.port)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _clear_previous_runs(out)
    dump_config = out / "dump.json"
    dump_config.write_text(json.dumps(_DUMP_CONFIG, indent=2) + "\n")

    baseline = _train("baseline", out, args.steps, dump_config, [])
    variant = _train("bf16", out, args.steps, dump_config, ["precision=bf16"])

    print("== sleuth diff baseline bf16 --step 0", flush=True)
    result = tracer.diff(baseline, variant, step=0)
    first = result.first_divergence
    print(f"status: {result.status}" + ("" if first else "; no record diverges"))
    for line in headline(result.changes):
        print(line)
    if first is not None:
        print(f"first divergence: {first['name']} (module {first['module']}, op "
              f"{first['op'] or '-'}, {first['phase']}, source {first['source']})")
    print(f"   full report: sleuth diff {baseline} {variant} --step 0", flush=True)
    if first is not None:
        _explain(baseline, variant)
    if args.no_serve:
        return 0
    from sleuth.cli import main

    return main(["dashboard", str(baseline), str(variant), "--host", args.host,
                 "--port", str(args.port), "--no-browser"])
