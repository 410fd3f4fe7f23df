"""`sleuth run -- CMD ...`: run an unmodified script (or torchrun) with the tools attached.

The command runs as a child process with SLEUTH_* variables set and a `sitecustomize` on its
PYTHONPATH; every Python process it starts (each torchrun worker too) attaches the requested
tools right after it imports torch. Nothing in the user's script changes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from sleuth.cli import CliError

_BOOT_DIR = Path(__file__).resolve().parent / "_boot"
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="run a script (or torchrun) with dump, profiler, summary or IR attached",
        description="Run COMMAND unmodified with Sleuth's tools attached to every Python process "
        "it starts. Example: sleuth run --dump dump.json --profile -- python train.py --lr 1e-3",
    )
    p.add_argument("--run-dir", default="sleuth_run", help="run directory (default: ./sleuth_run)")
    p.add_argument("--dump", metavar="CONFIG", help="dump config JSON (`sleuth docs dump-config`)")
    p.add_argument("--profile", nargs="?", const="1", metavar="CONFIG",
                   help="profile optimizer steps; optional collector config JSON")
    p.add_argument("--summary", action="store_true",
                   help="log parameter and gradient norms and histograms at optimizer steps")
    p.add_argument("--save-graphs", action="store_true", help="export the model's IR graphs")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the dump of another run found in the run directory (its step "
                   "files only) instead of refusing to dump")
    p.add_argument("--strict", action="store_true",
                   help="stop the run when a tool fails to attach or to write (default: the "
                   "tool goes off with one warning line and the run goes on; SLEUTH_STRICT=1)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the command to run after --, e.g. -- python train.py or -- torchrun "
                   "--nproc_per_node=2 train.py (every process it starts is covered)")
    p.set_defaults(run=_run)


def child_env(args: argparse.Namespace, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the SLEUTH_* requests plus the start-up hook on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    run_dir = Path(args.run_dir).resolve()
    env["SLEUTH_RUN_DIR"] = str(run_dir)
    if args.dump:
        cfg = Path(args.dump)
        if not cfg.is_file():
            raise CliError(f"--dump {args.dump}: no such file; write a dump config JSON first "
                           "(`sleuth docs dump-config` has an example)")
        env["SLEUTH_DUMP_CONFIG"] = str(cfg.resolve())
    if args.profile:
        env["SLEUTH_PROFILE"] = args.profile if args.profile == "1" else str(Path(args.profile).resolve())
    if args.summary:
        env["SLEUTH_SUMMARY"] = "1"
    if args.save_graphs:
        env["SLEUTH_SAVE_GRAPHS"] = "1"
        env.setdefault("SLEUTH_SAVE_GRAPHS_PATH", str(run_dir / "ir"))
    if args.strict:
        env["SLEUTH_STRICT"] = "1"
    if getattr(args, "overwrite", False):
        env["SLEUTH_DUMP_OVERWRITE"] = "1"
    # every process of the command (each torchrun worker) writes one run: one id for all; a
    # caller's own id (a run continuing) is kept
    if not env.get("SLEUTH_RUN_ID", "").strip():
        from trainer import new_run_id

        env["SLEUTH_RUN_ID"] = new_run_id()
    paths = [str(_BOOT_DIR), str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CliError("no command given; write it after `--`, e.g. "
                       "sleuth run --dump dump.json -- python train.py")
    continuing = bool(os.environ.get("SLEUTH_RUN_ID", "").strip())  # the caller's own run id
    env = child_env(args)
    _validate_configs(args)
    if not continuing:
        _refuse_another_runs_dump(env)
    run_dir = Path(env["SLEUTH_RUN_DIR"])
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_run_json(run_dir, cmd, env)
    if cmd[0] in ("python", "python3"):
        cmd[0] = sys.executable  # the interpreter sleuth runs in, which has the tools installed
    try:
        return _call(cmd, env)
    except FileNotFoundError as e:
        raise CliError(f"cannot run {cmd[0]!r}: {e.strerror}") from e


def _validate_configs(args: argparse.Namespace) -> None:
    """Load the --dump and --profile configs here, before the child starts: a bad config is one
    clear error now, not a warning buried in the child's output above a run that dumps nothing
    (or, with --strict, a traceback from inside the child)."""
    if args.dump:
        import tracer

        try:
            tracer.DumpConfig.from_json(args.dump)
        except tracer.TracerError as e:
            raise CliError(f"--dump: {e}") from e
    if args.profile and args.profile != "1":
        import profiler

        try:
            profiler.CollectorConfig.from_json(args.profile)
        except profiler.ProfilerError as e:
            raise CliError(f"--profile: {e}") from e


def _call(cmd: list[str], env: dict[str, str]) -> int:
    """Run the child to its end and return its exit status (-N when a signal ended it).

    Ctrl-C reaches the child from the terminal; sleuth waits for it instead of killing it (as
    `subprocess.call` would), so the child can write the step it was in, marked interrupted.
    A SIGTERM sent to sleuth (a job scheduler's) is passed on to the child for the same reason.
    """
    import signal
    import threading

    proc = subprocess.Popen(cmd, env=env)
    if threading.current_thread() is not threading.main_thread():
        return proc.wait()
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM,
                                              lambda signum, frame: proc.send_signal(signum)),
                signal.SIGINT: signal.signal(signal.SIGINT, lambda signum, frame: None)}
    try:
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _refuse_another_runs_dump(env: dict[str, str]) -> None:
    """CliError before the command starts when its dump would go where an earlier run's dump is:
    the dump's writers would refuse it in every process of the command (docs/dump-format.md,
    "Run id, run file and lock"), after the command had started."""
    value = env.get("SLEUTH_DUMP_CONFIG", "").strip()
    if not value or value == "0" or env.get("SLEUTH_DUMP_OVERWRITE") == "1":
        return
    config: object = {}
    if value != "1":
        try:
            config = json.loads(value if value.startswith("{") else Path(value).read_text())
        except (OSError, ValueError):
            return  # the dump's own config check reports it
    if not isinstance(config, dict) or config.get("overwrite") is True:
        return
    dump = Path(config.get("path") or env["SLEUTH_RUN_DIR"]) / "dump"
    if (dump / "dump.json").is_file() or next(dump.glob("rank*/step*.h5"), None) is not None:
        raise CliError(f"{dump} holds the dump of an earlier run, and this command starts a new "
                       f"one: pass --overwrite to replace that dump, or --run-dir NEW_DIR (to "
                       f"continue that run instead, set SLEUTH_RUN_ID to the run_id in "
                       f"{dump / 'dump.json'})")


def _write_run_json(run_dir: Path, cmd: list[str], env: dict[str, str]) -> None:
    from trainer import write_run_json

    tools = {k: env[k] for k in ("SLEUTH_DUMP_CONFIG", "SLEUTH_PROFILE", "SLEUTH_SUMMARY",
                                 "SLEUTH_SAVE_GRAPHS") if k in env}
    world = int(env.get("WORLD_SIZE", "1"))
    if cmd and Path(cmd[0]).name in ("torchrun",):
        world = next((int(a.split("=", 1)[1]) for a in cmd if a.startswith("--nproc_per_node=")
                      and a.split("=", 1)[1].isdigit()), world)
    write_run_json(run_dir, name=run_dir.name, argv=cmd, world_size=world,
                   config={"command": cmd, "tools": tools})
