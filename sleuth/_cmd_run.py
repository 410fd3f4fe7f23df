"""`sleuth run -- CMD ...`: run an unmodified script (or torchrun) with the tools attached.

The command runs as a child process with SLEUTH_* variables set and a `sitecustomize` on its
PYTHONPATH; every Python process it starts (each torchrun worker too) attaches the requested
tools right after it imports torch. Nothing in the user's script changes.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from sleuth._configs import collector_config, dump_config, is_inline
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
    p.add_argument("--reference", metavar="RUN",
                   help="compare each dumped step, as it is written, with the same step and "
                   "rank of RUN (a run dumped with the same config) and say the first record "
                   "out of tolerance at once (docs/diff.md, \"Live reference\"); needs --dump")
    p.add_argument("--map", metavar="FILE",
                   help="with --reference, a module map (`sleuth map REFERENCE RUN > FILE`) "
                   "for a run whose modules are named otherwise than RUN's (a port), as "
                   "`sleuth diff --map` takes it")
    p.add_argument("--on-divergence", choices=("continue", "stop"), default="continue",
                   help="with --reference, at the first divergence: go on (default), or stop "
                   "the run with exit code 3")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the files of another run found in the run directory (only "
                   "files Sleuth writes) instead of refusing to start")
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
        # inline JSON goes through as it is: SLEUTH_DUMP_CONFIG takes it too
        env["SLEUTH_DUMP_CONFIG"] = (args.dump.strip() if is_inline(args.dump)
                                     else str(Path(args.dump).resolve()))
    if args.profile:
        env["SLEUTH_PROFILE"] = args.profile if args.profile == "1" else str(Path(args.profile).resolve())
    if getattr(args, "reference", None):
        env["SLEUTH_REFERENCE"] = str(Path(args.reference).resolve())
        env["SLEUTH_REFERENCE_ON_DIVERGENCE"] = args.on_divergence
        if getattr(args, "map", None):
            env["SLEUTH_REFERENCE_MAP"] = str(Path(args.map).resolve())
    if args.summary:
        env["SLEUTH_SUMMARY"] = "1"
    if args.save_graphs:
        env["SLEUTH_SAVE_GRAPHS"] = "1"
        env.setdefault("SLEUTH_SAVE_GRAPHS_PATH", str(run_dir / "ir"))
    if args.strict:
        from sleuth.common import STRICT_ENV

        env[STRICT_ENV] = "1"
    if getattr(args, "overwrite", False):
        env["SLEUTH_DUMP_OVERWRITE"] = "1"
    # every process of the command (each torchrun worker) writes one run: one id for all; a
    # caller's own id (a run continuing) is kept
    from sleuth.common import RUN_ID_ENV, new_run_id

    if not env.get(RUN_ID_ENV, "").strip():
        env[RUN_ID_ENV] = new_run_id()
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
    if getattr(args, "reference", None) and not args.dump:
        raise CliError("--reference compares the run's dump with RUN's: give the dump config "
                       "too, the one RUN was dumped with (--dump dump.json)")
    if getattr(args, "map", None) and not getattr(args, "reference", None):
        raise CliError("--map pairs the run's modules with a reference's: give the reference "
                       "too (--reference RUN), or use the map with `sleuth diff --map` after "
                       "the run")
    env = child_env(args)
    _validate_configs(args)
    run_dir = Path(env["SLEUTH_RUN_DIR"])
    continuing = _claim(run_dir, env, overwrite=bool(getattr(args, "overwrite", False)))
    _refuse_another_runs_dump(env)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not continuing:
        _write_run_json(run_dir, cmd, env)
    if cmd[0] in ("python", "python3"):
        cmd[0] = sys.executable  # the interpreter sleuth runs in, which has the tools installed
    try:
        code = _call(cmd, env)
    except FileNotFoundError as e:
        if not continuing:  # nothing ran: the run.json of a run that never was would block a retry
            (run_dir / "run.json").unlink(missing_ok=True)
        raise CliError(f"cannot run {cmd[0]!r}: {e.strerror}") from e
    if code == 0:
        _say_written(args, run_dir, env)
    elif getattr(args, "reference", None) and args.on_divergence == "stop":
        from tracer import ReferenceDiverged

        if code == ReferenceDiverged.EXIT_CODE:
            print(f"sleuth run: stopped at the first divergence from {args.reference} (exit "
                  f"code {code}); the dump holds the steps up to it, and live_reference.json "
                  f"beside them the record", file=sys.stderr)
    return code


def _say_written(args: argparse.Namespace, run_dir: Path, env: dict[str, str]) -> None:
    """Sleuth's one line of its own after a run that succeeded: what the tools wrote, where."""
    from sleuth._written import written_line

    dump = None
    if args.dump:
        dump = Path(dump_config(args.dump).path or run_dir) / "dump"
    graphs = env.get("SLEUTH_SAVE_GRAPHS_PATH") if args.save_graphs else None
    graphs = None if graphs == str(run_dir / "ir") else graphs
    shown = Path(args.run_dir)  # as the user wrote it
    dump = shown / "dump" if dump == run_dir / "dump" else dump
    print(written_line("run", shown, dump=dump, graphs=Path(graphs) if graphs else None),
          file=sys.stderr)


def _validate_configs(args: argparse.Namespace) -> None:
    """Load the --dump and --profile configs here, before the child starts: a bad config is one
    clear error now, not a warning buried in the child's output above a run that dumps nothing
    (or, with --strict, a traceback from inside the child)."""
    if args.dump:
        dump_config(args.dump)
    if args.profile and args.profile != "1":
        collector_config(args.profile)
    if getattr(args, "map", None):
        from tracer.analysis import read_module_map

        read_module_map(args.map, "--map")


def _call(cmd: list[str], env: dict[str, str]) -> int:
    """Run the child to its end and return its exit status (128 + N when signal N ended it).

    A SIGINT or SIGTERM reaches the child once and sleuth waits for it instead of killing it
    (as `subprocess.call` would), so the child can write the step it was in, marked
    interrupted: from a terminal Ctrl-C reaches the child directly; any other signal to sleuth
    (a job scheduler's, `kill`) is passed on (sleuth._interrupt).
    """
    import signal
    import threading

    from sleuth._interrupt import exit_code, in_terminal_foreground

    if threading.current_thread() is not threading.main_thread():  # no signals to handle
        return exit_code(subprocess.Popen(cmd, env=env).wait())
    # out of a terminal, the child gets a group of its own: a signal to sleuth's group is then
    # forwarded to it once, not delivered twice (directly and by sleuth)
    direct = in_terminal_foreground()
    started: list[subprocess.Popen] = []
    pending: list[int] = []  # signals that came before the child had started

    def forward(signum: int, frame: object) -> None:
        if signum == signal.SIGTERM or not direct:
            if started:
                started[0].send_signal(signum)
            else:
                pending.append(signum)

    previous = {signum: signal.signal(signum, forward)
                for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        started.append(subprocess.Popen(cmd, env=env, process_group=None if direct else 0))
        for signum in pending:
            started[0].send_signal(signum)
        code = started[0].wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if code in (-signal.SIGINT, 128 + signal.SIGINT, 130):
        print(f"sleuth run: interrupted; {Path(cmd[0]).name} stopped on Ctrl-C (SIGINT)",
              file=sys.stderr)
    return exit_code(code)


def _claim(run_dir: Path, env: dict[str, str], *, overwrite: bool) -> bool:
    """Refuse, before the command starts, a run directory that holds another run's files, or
    the finished dump of the run whose id the caller reuses (a script dumps from step 0 again,
    over its step files); with `overwrite`, remove them. Returns True when the command
    continues the run whose run.json is there (the caller's $SLEUTH_RUN_ID names it)."""
    from trainer import OtherRunError, claim_run_dir, remove_run_files

    run_id = env["SLEUTH_RUN_ID"]
    try:
        found = claim_run_dir(run_dir, run_id, overwrite=overwrite, fixes=(
            "pass --overwrite to replace it, or another --run-dir (to continue that run "
            "instead, set SLEUTH_RUN_ID to its id)"))
    except OtherRunError as e:
        raise CliError(str(e)) from e
    replayed = found.dump_steps and not found.live_lock and not found.others(run_id)
    if replayed and not overwrite:
        raise CliError(f"{run_dir / 'dump'} holds {found.dump_steps} step file(s) of run {run_id} "
                       f"and no process of that run writes it now: this command, run again "
                       f"under SLEUTH_RUN_ID={run_id}, would dump its steps from step 0 over "
                       f"them; pass --overwrite to replace that run's files, or another "
                       f"--run-dir (or unset SLEUTH_RUN_ID to start a new run)")
    if overwrite and not found.empty:
        try:
            removed = remove_run_files(run_dir)
        except OtherRunError as e:
            raise CliError(str(e)) from e
        print(f"sleuth run: overwrite: removed {len(removed)} file(s) of the earlier run from "
              f"{run_dir}", file=sys.stderr, flush=True)
        return False
    return found.owner == run_id


def _refuse_another_runs_dump(env: dict[str, str]) -> None:
    """CliError before the command starts when its dump (a dump config's own "path", outside
    the run directory) would go where another run's dump is: the dump's writers would refuse
    it in every process of the command (docs/dump-format.md, "Run id, run file and lock"),
    after the command had started."""
    value = env.get("SLEUTH_DUMP_CONFIG", "").strip()
    if not value or value == "0" or env.get("SLEUTH_DUMP_OVERWRITE") == "1":
        return
    import tracer

    try:
        config = tracer.DumpConfig.from_env(value)
    except tracer.TracerError:
        return  # the dump's own config check reports it
    if config is None or config.overwrite:
        return
    root = Path(config.path or env["SLEUTH_RUN_DIR"]).resolve()
    if root == Path(env["SLEUTH_RUN_DIR"]).resolve():
        return  # the run directory's dump: _claim checked it
    from trainer import scan_run_dir

    dump = root / "dump"
    others = scan_run_dir(root).others(env["SLEUTH_RUN_ID"])
    if "dump/" in {n for names in others.values() for n in names}:
        raise CliError(f"{dump} holds the dump of an earlier run, and this command starts a new "
                       f"one: pass --overwrite to replace that dump, or --run-dir NEW_DIR (to "
                       f"continue that run instead, set SLEUTH_RUN_ID to the run_id in "
                       f"{dump / 'dump.json'})")


def _write_run_json(run_dir: Path, cmd: list[str], env: dict[str, str]) -> None:
    from trainer import write_run_json

    tools = {k: env[k] for k in ("SLEUTH_DUMP_CONFIG", "SLEUTH_PROFILE", "SLEUTH_SUMMARY",
                                 "SLEUTH_SAVE_GRAPHS", "SLEUTH_REFERENCE",
                                 "SLEUTH_REFERENCE_ON_DIVERGENCE") if k in env}
    world = int(env.get("WORLD_SIZE", "1"))
    if cmd and Path(cmd[0]).name in ("torchrun",):
        world = next((int(a.split("=", 1)[1]) for a in cmd if a.startswith("--nproc_per_node=")
                      and a.split("=", 1)[1].isdigit()), world)
    from trainer import OtherRunError

    try:
        write_run_json(run_dir, name=run_dir.name, argv=cmd, world_size=world,
                       config={"command": cmd, "tools": tools}, run_id=env["SLEUTH_RUN_ID"],
                       exclusive=True)
    except OtherRunError as e:
        raise CliError(str(e)) from e
