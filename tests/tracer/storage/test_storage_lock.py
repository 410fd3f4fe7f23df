"""One writer per rank and one run per dump: the rank lock, run ids, overwrite, and readers that
never combine files of different runs; async write errors raised at the next step boundary."""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import pytest
import torch
import torch.nn as nn

import tracer
from tests.tracer.models import MLP
from tracer.storage import _file_io
from tracer._errors import DumpWriteError, TracerError
from tracer.storage._lock import LOCK_NAME, DUMP_JSON, _release_at_exit
from tracer.storage._reader import open_dump

REPO = str(Path(__file__).resolve().parents[3])


def train(run_dir, n: int = 3, **config) -> tracer.Dumper:
    """A plain nn.Module loop of `steps` optimizer steps under a Dumper (closed). The dump's
    refusals are raised ("on_error": "raise"), as SLEUTH_STRICT=1 does; by default they only
    warn and switch the dump off (tests/tracer/capture/test_capture_hooks.py)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"path": str(run_dir), "writer": "sync", "on_error": "raise", **config}
    with tracer.Dumper(model, config) as dumper:
        for _ in range(n):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    return dumper


def run_ids(rank_dir) -> dict[str, str]:
    out = {}
    for p in sorted(rank_dir.glob("step*.h5")):
        with h5py.File(p, "r") as f:
            out[p.name] = f.attrs["run_id"]
    return out


@pytest.fixture(autouse=True)
def _own_run_ids(monkeypatch):
    # the ids come from the environment first: each test decides them itself
    for var in ("SLEUTH_RUN_ID", "TORCHELASTIC_RUN_ID", "SLEUTH_DUMP_OVERWRITE"):
        monkeypatch.delenv(var, raising=False)


def test_every_step_file_and_the_run_file_carry_one_run_id(tmp_path):
    train(tmp_path, 3)
    ids = run_ids(tmp_path / "dump" / "rank0")
    assert sorted(ids) == ["step0.h5", "step1.h5", "step2.h5"]
    assert len(set(ids.values())) == 1
    run = json.loads((tmp_path / "dump" / DUMP_JSON).read_text())
    assert run["run_id"] == ids["step0.h5"] and run["format_version"] == "1.0"
    # the lock released at close, and nothing else left beside the step files
    assert sorted(p.name for p in (tmp_path / "dump" / "rank0").iterdir()) == sorted(ids)
    assert open_dump(tmp_path).attrs(0, 2)["run_id"] == run["run_id"]


_SECOND_WRITER = textwrap.dedent("""
    import sys, torch, tracer
    from tests.tracer.models import MLP
    model = MLP()
    try:
        with tracer.Dumper(model, {"path": sys.argv[1], "writer": "sync", "on_error": "raise"}):
            model(torch.randn(4, 8))
    except tracer.TracerError as e:
        print("REFUSED", e)
        sys.exit(3)
""")


@pytest.mark.slow
def test_a_second_process_on_the_same_rank_is_refused_and_the_first_keeps_its_files(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": str(tmp_path), "writer": "sync"}) as dumper:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()  # step 0 written, the lock held
        lock = json.loads((tmp_path / "dump" / "rank0" / LOCK_NAME).read_text())
        assert lock["pid"] == os.getpid() and lock["host"] == socket.gethostname()
        second = subprocess.run([sys.executable, "-c", _SECOND_WRITER, str(tmp_path)],
                                capture_output=True, text=True, cwd=REPO, timeout=120,
                                env={**os.environ, "PYTHONPATH": REPO})
        assert second.returncode == 3, second.stderr
        assert "REFUSED" in second.stdout and f"pid {os.getpid()}" in second.stdout
        assert "being written by another process" in second.stdout
        # and a second Dumper of this process too
        other = MLP()
        with pytest.raises(TracerError, match="being written by another process"):
            with tracer.Dumper(other, {"path": str(tmp_path), "writer": "sync",
                                       "on_error": "raise"}):
                other(torch.randn(4, 8))
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    assert dumper.current_step == 3
    d = open_dump(tmp_path)
    assert d.steps(0) == [0, 1, 2] and not d.skipped
    assert all(d.attrs(0, s)["complete"] == 1 and len(d.stats(0, s)) for s in range(3))
    assert len(set(run_ids(tmp_path / "dump" / "rank0").values())) == 1


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path):
    rank_dir = tmp_path / "dump" / "rank0"
    rank_dir.mkdir(parents=True)
    stale = {"pid": _dead_pid(), "host": socket.gethostname(), "started": "1",
             "run_id": "crashed", "since": "2026-01-01T00:00:00+00:00"}
    (rank_dir / LOCK_NAME).write_text(json.dumps(stale))
    with pytest.warns(RuntimeWarning, match="took over the stale lock"):
        train(tmp_path, 2, overwrite=True)
    assert open_dump(tmp_path).steps(0) == [0, 1]
    assert not (rank_dir / LOCK_NAME).exists()


def test_a_lock_of_another_host_is_never_taken(tmp_path):
    rank_dir = tmp_path / "dump" / "rank0"
    rank_dir.mkdir(parents=True)
    lock = {"pid": 1, "host": "another-host.example", "started": None, "run_id": "x",
            "since": "2026-01-01T00:00:00+00:00"}
    (rank_dir / LOCK_NAME).write_text(json.dumps(lock))
    with pytest.raises(TracerError, match=r"another-host\.example.*cannot tell.*delete"):
        train(tmp_path, 1)
    assert json.loads((rank_dir / LOCK_NAME).read_text()) == lock
    assert not list(rank_dir.glob("step*"))


def test_a_forked_child_leaves_the_lock_to_its_parent(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": str(tmp_path), "writer": "sync"}):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()  # step 0 written: the lock is taken
        lock_path = tmp_path / "dump" / "rank0" / LOCK_NAME
        before = lock_path.read_text()
        pid = os.fork()
        if pid == 0:  # the child runs the interpreter's exit handlers, as a normal exit would
            try:
                _release_at_exit()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert lock_path.read_text() == before
    assert not lock_path.exists()


def test_a_rerun_is_refused_then_replaces_the_old_dump_with_overwrite(tmp_path):
    train(tmp_path, 3)
    rank_dir = tmp_path / "dump" / "rank0"
    old_id = json.loads((tmp_path / "dump" / DUMP_JSON).read_text())["run_id"]
    (rank_dir / "notes.txt").write_text("mine")  # not a dump file: never removed
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(TracerError, match=r"holds the dump of another run.*\"overwrite\": true"):
        train(tmp_path, 2)
    assert sorted(run_ids(rank_dir)) == ["step0.h5", "step1.h5", "step2.h5"]  # untouched
    assert set(run_ids(rank_dir).values()) == {old_id}

    with pytest.warns(RuntimeWarning, match="removed 3 step file"):
        train(tmp_path, 2, overwrite=True)
    ids = run_ids(rank_dir)
    new_id = json.loads((tmp_path / "dump" / DUMP_JSON).read_text())["run_id"]
    assert sorted(ids) == ["step0.h5", "step1.h5"] and set(ids.values()) == {new_id} != {old_id}
    assert (rank_dir / "notes.txt").read_text() == "mine"
    assert (tmp_path / "metrics.jsonl").exists()
    d = open_dump(tmp_path)
    assert d.steps(0) == [0, 1] and not d.skipped


def test_the_same_run_continues_without_overwrite(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEUTH_RUN_ID", "resumed-run")  # as the trainer sets it on --resume
    train(tmp_path, 2)
    train(tmp_path, 3, steps="2")  # the continuation's new step
    ids = run_ids(tmp_path / "dump" / "rank0")
    assert sorted(ids) == ["step0.h5", "step1.h5", "step2.h5"]
    assert set(ids.values()) == {"resumed-run"}


def test_open_dump_never_combines_files_of_different_runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(a, 2)
    train(b, 3)
    shutil.copy(b / "dump" / "rank0" / "step2.h5", a / "dump" / "rank0" / "step2.h5")
    with pytest.warns(RuntimeWarning, match="skipped 1"):
        d = open_dump(a)
    assert d.steps(0) == [0, 1]  # the run dump.json names
    assert len(d.skipped) == 1 and d.skipped[0][0].endswith("step2.h5")
    assert "written by another run" in d.skipped[0][1]
    # without the run file: the run of the newest file, the others named as skipped
    (a / "dump" / DUMP_JSON).unlink()
    with pytest.warns(RuntimeWarning, match="skipped 2"):
        d = open_dump(a / "dump" / "rank0")
    assert d.steps(0) == [2] and len(d.skipped) == 2


def test_the_run_id_comes_from_the_environment_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    train(tmp_path, 1)
    assert set(run_ids(tmp_path / "dump" / "rank0").values()) == {"torchelastic-abc123"}
    monkeypatch.setenv("SLEUTH_RUN_ID", "given")  # sleuth run's (or the trainer's) wins
    with pytest.raises(TracerError, match="another run"):
        train(tmp_path, 1)


def _disk_full_at(monkeypatch, step_file: str) -> None:
    """Make the fsync-and-rename of `step_file` fail as a full disk does."""
    commit = _file_io.PendingFile.commit

    def full_disk(self):
        if self.path.name == step_file:
            self.abort()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return commit(self)

    monkeypatch.setattr(_file_io.PendingFile, "commit", full_disk)


def _train_until_error(dumper: tracer.Dumper, model: nn.Module, steps: int):
    """Train until the Dumper raises; returns (the step whose boundary raised, the error)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DumpWriteError) as caught:
        for step in range(steps):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()  # ends the step: its boundary
    return step, caught.value


@pytest.mark.parametrize("filer", [False, True])
def test_an_async_write_error_surfaces_at_the_next_step_boundary(tmp_path, monkeypatch, filer):
    """Disk full while step 3's file is written: raised at step 3's or step 4's boundary,
    naming the step and the cause; close() says again that the dump is incomplete."""
    _disk_full_at(monkeypatch, "step3.h5")
    model = MLP()
    dumper = tracer.Dumper(model, {"path": str(tmp_path), "writer": "async", "mode": "tensor",
                                   "file_process": filer, "on_error": "raise"})
    raised_at, error = _train_until_error(dumper, model, 12)
    assert raised_at in (3, 4)
    assert "step 3" in str(error) and "No space left on device" in str(error)
    with pytest.raises(DumpWriteError, match="incomplete: writing step 3"):
        dumper.close()
    steps = open_dump(tmp_path).steps(0)
    assert steps[:3] == [0, 1, 2] and 3 not in steps
    assert not (tmp_path / "dump" / "rank0" / LOCK_NAME).exists()


def test_an_async_write_error_before_undumped_steps_surfaces_at_the_next_boundary(
        tmp_path, monkeypatch):
    _disk_full_at(monkeypatch, "step1.h5")
    model = MLP()
    dumper = tracer.Dumper(model, {"path": str(tmp_path), "writer": "async", "steps": "0-1",
                                   "file_process": False, "on_error": "raise"})
    raised_at, error = _train_until_error(dumper, model, 8)
    assert raised_at == 2 and "step 1" in str(error)  # step 2 is not dumped; its end is a boundary
    with pytest.raises(DumpWriteError):
        dumper.close()
