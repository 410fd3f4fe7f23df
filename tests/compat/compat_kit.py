"""Runs a compatibility script with and without Sleuth and reads back what both left.

Each framework's script (tests/compat/scripts/) is run three ways: plain (no Sleuth, the
reference for the final weights), traced (`sleuth run` with every tool on: a mix-level
statistics dump, the profiler, the summary and graph export) and traced with a NaN made in
the model's own code. Runs are started once per session and shared by the checks.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import tracer

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TOOLS = ("--profile", "--summary", "--save-graphs")
DUMP = {"level": "mix", "mode": "statistics"}
NAN_STEP = 1
TIMEOUT = 300


@dataclass(frozen=True)
class Framework:
    """One way users train, as the suite runs it."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    ranks: int = 1
    """more than 1: started by torchrun (gloo)"""
    unwrapped: str | None = None
    """the framework whose run is this one without its wrapper: their record names must match"""
    dump: tuple[tuple[str, object], ...] = ()
    """dump config keys set beside DUMP's"""


@dataclass
class Run:
    """What one run left: its outputs, its run directory (None without Sleuth), its logs."""

    out: Path
    run_dir: Path | None
    log: str = field(repr=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(fw: Framework) -> list[str]:
    script = str(SCRIPTS / fw.script)
    if fw.ranks > 1:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={fw.ranks}",
                f"--master_port={_free_port()}", script, *fw.args]
    return [sys.executable, script, *fw.args]


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    """Run to the end in its own process group, so that a hang is killed with every rank."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"{' '.join(argv)} hung (killed after {TIMEOUT} s):\n{log[-3000:]}")
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{log[-4000:]}"
    return log


def run(fw: Framework, root: Path, kind: str) -> Run:
    """Run `fw` as `kind`: "plain" (no Sleuth), "traced" (every tool) or "nan" (traced, with
    the model making a NaN in step NAN_STEP)."""
    work = root / fw.name / kind
    work.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env["COMPAT_OUT"] = str(work / "out")
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores: no oversubscription
    if kind == "nan":
        env["COMPAT_NAN_STEP"] = str(NAN_STEP)
    argv = _command(fw)
    if kind == "plain":
        return Run(work / "out", None, _run(argv, env, work))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    (work / "dump.json").write_text(json.dumps({**DUMP, **dict(fw.dump)}))
    run_dir = work / "run"
    log = _run([sys.executable, "-m", "sleuth", "run", "--run-dir", str(run_dir), "--dump",
                str(work / "dump.json"), *TOOLS, "--", *argv], env, work)
    return Run(work / "out", run_dir, log)


# ---- what the runs left ---------------------------------------------------------------------
def weights(r: Run, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(r.out / f"weights{rank}.pt", weights_only=True)


def script_report(r: Run, rank: int) -> dict:
    """{"optimizer_steps": n, "leaf_modules": [...]}, as the script wrote it."""
    return json.loads((r.out / f"steps{rank}.json").read_text())


def records(r: Run, rank: int) -> dict[int, "object"]:
    """{step: statistics DataFrame} of one rank's dump."""
    dump = tracer.open_dump(r.run_dir / "dump")
    try:
        return {s: dump.stats(rank, s) for s in dump.steps(rank)}
    finally:
        dump.close()


def first_nan(r: Run) -> dict:
    """`sleuth check --first-nan --json` on the run's dump."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "sleuth", "check", "--first-nan", "--json",
                           str(r.run_dir)], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout)


def nan_line(fw: Framework) -> str:
    """`script.py:LINE` of the line marked `# compat: NaN` in the framework's script."""
    lines = (SCRIPTS / fw.script).read_text().splitlines()
    marked = [i for i, line in enumerate(lines, 1) if line.rstrip().endswith("# compat: NaN")]
    assert len(marked) == 1, f"{fw.script}: {len(marked)} lines marked '# compat: NaN'"
    return f"{fw.script}:{marked[0]}"
