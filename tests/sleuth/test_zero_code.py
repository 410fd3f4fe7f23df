"""Zero-code attach: scripts nobody edited get dumped, through the installed .pth start-up hook
and through `sleuth run` around torchrun (every rank)."""
from __future__ import annotations

import json
import os
import site
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_DDP_SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(),
                                                              nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(3):
        x = torch.randn(16, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
    # torch's gloo threads abort a rank now and then as the interpreter finalizes
    # (docs/frameworks.md, "An abort at exit"): exit handlers, then no C++ teardown
    import atexit, os, sys; atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sleuth_run_dumps_every_torchrun_rank(tmp_path, sleuth_cli):
    import tracer

    (tmp_path / "ddp.py").write_text(_DDP_SCRIPT)
    (tmp_path / "dump.json").write_text(json.dumps({"steps": "all", "mode": "statistics"}))
    run = tmp_path / "run"
    proc = sleuth_cli("run", "--run-dir", str(run), "--dump", "dump.json", "--strict", "--",
                      "python", "-m", "torch.distributed.run", "--nproc_per_node=2",
                      f"--master_port={_free_port()}", "ddp.py", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dump = tracer.open_dump(run)
    assert dump.ranks == [0, 1]
    for rank in (0, 1):
        assert dump.steps(rank=rank) == [0, 1, 2]
    # DDP averages gradients: both ranks hold the same weights after step 0, not the same inputs.
    assert tracer.diff(run, run, step=1, rank=0, b_rank=1).status == "diverged"
    grads = [dump.stats(rank=r, step=0).query("direction == 'grad'")["checksum"].tolist()
             for r in (0, 1)]
    assert grads[0] == grads[1]


def _installed_pth() -> Path | None:
    for d in site.getsitepackages():
        p = Path(d) / "sleuth_autoattach.pth"
        if p.exists():
            return p
    return None


@pytest.mark.slow
@pytest.mark.skipif(_installed_pth() is None,
                    reason="sleuth is not installed (bash scripts/install.sh installs the .pth)")
def test_installed_pth_dumps_a_plain_python_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SLEUTH_DUMP_CONFIG='{"steps": "1"}', SLEUTH_RUN_DIR=str(tmp_path / "run"),
               SLEUTH_STRICT="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "dump" / "rank0").iterdir()) == ["step1.h5"]


def test_no_variable_means_nothing_is_imported(tmp_path):
    code = "import sys; print(sorted(m for m in ('sleuth', 'tracer', 'torch') if m in sys.modules))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"


# -- observing never stops the observed run -------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train.py"
DOCS_CONFIG = '{"steps": "0|5", "level": "mix", "mode": "statistics"}'  # docs/tracer.md's


def _attach_env(run_dir: Path, config: str, **extra: str) -> dict[str, str]:
    """The environment of a zero-code attach: the start-up hook (the .pth file's, or the one
    `sleuth run` puts on the path) loads from this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO / "sleuth" / "_boot"), str(REPO)]),
               SLEUTH_DUMP_CONFIG=config, SLEUTH_RUN_DIR=str(run_dir), **extra)
    return env


def _train(run_dir: Path, config: str = DOCS_CONFIG, steps: int = 8, preexec=None,
           **extra: str) -> subprocess.CompletedProcess:
    """examples/train.py, nobody's edit in it, dumped through the environment."""
    return subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(steps)],
                          env=_attach_env(run_dir, config, **extra), cwd=run_dir.parent,
                          capture_output=True, text=True, timeout=240, preexec_fn=preexec)


def _trained(proc: subprocess.CompletedProcess, steps: int = 8) -> bool:
    return proc.returncode == 0 and f"step {steps - 1} loss" in proc.stdout


def _snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every path under `folder` with its size, modification time and bytes."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns,
                                         p.read_bytes() if p.is_file() else b"")
            for p in sorted(folder.rglob("*"))}


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.slow
def test_attach_into_another_runs_dump_warns_once_and_trains_on(tmp_path):
    """docs/tracer.md's first example run twice into one run directory: the second run trains
    to its end with one `sleuth:` line, and the first run's folder is left as it was (no
    flight recorder, no lock, no rank folder of the second run). SLEUTH_STRICT=1 raises."""
    run = tmp_path / "a"
    # step 8 is what follows the last optimizer step (`loss.item()`): dropped, with a warning
    first = _train(run, '{"steps": "0|5|8", "level": "mix"}', SLEUTH_RUN_ID="first")
    assert _trained(first), first.stderr[-3000:]
    # Sleuth's own warnings are one line each, no internal path or source line
    assert _lines(first.stderr) == [line for line in _lines(first.stderr)
                                    if line.startswith("sleuth: ")], first.stderr
    assert "made after the run's last optimizer.step()" in first.stderr
    before = _snapshot(run)

    second = _train(run, SLEUTH_RUN_ID="second", RANK="1")  # a rank the first run lacks
    assert _trained(second), second.stderr[-3000:]
    lines = _lines(second.stderr)
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith(f"sleuth: {run} holds the files of another run (run first: "
                               f"run.json, dump/)")
    assert lines[0].endswith("the tools are off for this run, which goes on (SLEUTH_STRICT=1 "
                             "stops it instead)")
    assert _snapshot(run) == before

    strict = _train(run, SLEUTH_RUN_ID="third", SLEUTH_STRICT="1")
    assert strict.returncode == 2 and "Traceback" not in strict.stderr, strict.stderr
    [line] = _lines(strict.stderr)
    assert line.startswith(f"sleuth: {run} holds the files of another run") and \
        line.endswith("(SLEUTH_STRICT=1: the run stops here)")
    assert _snapshot(run) == before


@pytest.mark.slow
def test_no_tool_writes_into_a_trainer_runs_folder(tmp_path, sleuth_cli):
    """Zero-code attach of every tool into a run directory the trainer wrote (no dump there):
    one line, the script trains on, and the trainer's run is left as it was (no dump, profile,
    summary or graphs of the script among its files)."""
    run = tmp_path / "a"
    trained = sleuth_cli("train", "--preset", "tiny", "--set", "steps=2", "--run-dir", str(run))
    assert trained.returncode == 0, trained.stderr[-2000:]
    before = _snapshot(run)
    proc = _train(run, "1", steps=4, SLEUTH_PROFILE="1", SLEUTH_SUMMARY="1",
                  SLEUTH_SAVE_GRAPHS="1")
    assert _trained(proc, 4), proc.stderr[-3000:]
    lines = _lines(proc.stderr)
    assert len(lines) == 1 and "holds the files of another run" in lines[0], proc.stderr
    assert "run.json" in lines[0] and "SLEUTH_RUN_ID=" in lines[0]
    assert _snapshot(run) == before


@pytest.mark.slow
def test_every_tool_of_one_process_writes_one_run_id(tmp_path):
    from tracer.storage import DUMP_JSON

    run = tmp_path / "new"
    proc = _train(run, "1", steps=4, SLEUTH_PROFILE="1")
    assert _trained(proc, 4), proc.stderr[-3000:]
    dump_id = json.loads((run / "dump" / DUMP_JSON).read_text())["run_id"]
    windows = sorted((run / "profile" / "rank0").glob("window*.json"))
    assert windows and {json.loads(w.read_text())["run_id"] for w in windows} == {dump_id}


@pytest.mark.slow
def test_a_config_typo_is_one_line_and_the_run_goes_on(tmp_path):
    proc = _train(tmp_path / "run", '{"levle": "op"}', steps=2)
    assert _trained(proc, 2), proc.stderr[-3000:]
    assert _lines(proc.stderr) == [
        "sleuth: the tensor dump is off for this run, and the run goes on without it: "
        "SLEUTH_DUMP_CONFIG (inline JSON): unknown key 'levle'; did you mean "
        "'level'? (valid keys: path, steps, ranks, level, mode, modules, exclude_modules, ops, "
        "exclude_ops, io, phases, params, sketch, writer, async_max_queued_mb, file_process, "
        "on_error, watch, nan_allow, compiled, overwrite) (SLEUTH_STRICT=1 stops the run instead)"]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_rank_another_live_writer_holds_is_left_alone(tmp_path):
    """A writer of this host that is alive (here: the test's own process) holds rank 0."""
    from sleuth.common import process_start_time
    from tracer.storage._lock import LOCK_NAME

    rank_dir = tmp_path / "run" / "dump" / "rank0"
    rank_dir.mkdir(parents=True)
    (rank_dir / LOCK_NAME).write_text(json.dumps({
        "pid": os.getpid(), "host": socket.gethostname(), "started": process_start_time(os.getpid()),
        "run_id": "the-other", "since": "2026-01-01T00:00:00+00:00"}))
    before = _snapshot(tmp_path / "run")
    proc = _train(tmp_path / "run", steps=3)
    assert _trained(proc, 3), proc.stderr[-3000:]
    lines = _lines(proc.stderr)
    assert len(lines) == 1 and "is being written by another process" in lines[0], lines
    assert f"pid {os.getpid()}" in lines[0]
    assert _snapshot(tmp_path / "run") == before


def _file_size_limit(limit: int):
    """A child whose files cannot grow past `limit` bytes: its writes fail as on a full disk
    (EFBIG; Python ignores SIGXFSZ)."""
    import resource

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["sync", "async"])
def test_a_disk_that_fails_turns_the_dump_off_under_sleuth_run(tmp_path, sleuth_cli, writer):
    """`sleuth run` with a dump config that says nothing of on_error: the first step file
    cannot be written, the dump goes off with one line, the script trains to its end, and no
    partial file is left. (HDF5 used to crash the process with SIGSEGV here.)"""
    (tmp_path / "dump.json").write_text(json.dumps({"level": "op", "writer": writer}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "sleuth", "run", "--run-dir", "run",
                           "--dump", "dump.json", "--", "python", str(EXAMPLE), "--steps", "4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
                          preexec_fn=_file_size_limit(30_000))
    assert _trained(proc, 4), proc.stderr[-3000:]
    ours = [line for line in _lines(proc.stderr) if line.startswith("sleuth: ")]
    assert len(ours) == 1 and "File too large" in ours[0], proc.stderr
    assert "is off for the rest of the run, and the run goes on" in ours[0]
    assert "Traceback" not in proc.stderr
    assert not [p.name for p in (tmp_path / "run" / "dump" / "rank0").iterdir()]


def test_two_scripts_attached_into_one_new_folder_at_once_second_is_refused(tmp_path,
                                                                           monkeypatch):
    """Two scripts attached through the environment alone into one new folder: each found it
    empty before the other wrote a file, and both wrote there (one's summary/rank0.h5, the
    other's rank0.seg1.h5). The first attach links run.json into place, so the second,
    however close behind, is refused; a second rank of the first run (the same id) is not."""
    from sleuth import _autoattach

    run = tmp_path / "new"
    monkeypatch.setenv("SLEUTH_RUN_DIR", str(run))
    monkeypatch.delenv("SLEUTH_DUMP_OVERWRITE", raising=False)
    monkeypatch.setenv("SLEUTH_RUN_ID", "first")
    assert _autoattach._another_runs_folder() is None
    assert json.loads((run / "run.json").read_text())["run_id"] == "first"
    monkeypatch.setenv("RANK", "1")
    assert _autoattach._another_runs_folder() is None  # the same run's other rank
    monkeypatch.setenv("SLEUTH_RUN_ID", "second")
    refusal = _autoattach._another_runs_folder()
    assert refusal and "run first" in refusal and "run.json" in refusal, refusal
    # the race itself: the check passed for both, the first linked run.json before the second
    from trainer import OtherRunError

    with pytest.raises(OtherRunError, match="run first: run.json"):
        _autoattach._claim_with_run_json(run, "third", "fixes")
    assert json.loads((run / "run.json").read_text())["run_id"] == "first"
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]
