"""Crashed steps kept and marked: a step ended by an exception, Ctrl-C, SIGTERM or the process
exiting is written with its records so far, `status` "interrupted" and why; every other step
file says "complete"; files older than format 3.1 read as their `complete` attribute says."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import pytest
import torch
from models import MLP
from torch import nn

import tracer
from tracer.storage._format import FORMAT_VERSION
from tracer.storage import RecordMeta, make_writer

REPO = Path(__file__).resolve().parents[3]
GOLDEN_3_0 = Path(__file__).parents[1] / "data" / "dump_format_3_0_rank0_step5.h5"


def _loop_until_failure(run, config, fail_at, error):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with pytest.raises(type(error)):
        with tracer.Dumper(model, {"path": str(run), **config}):
            for step in range(5):
                loss = nn.functional.mse_loss(model(x), y)
                if step == fail_at:
                    raise error  # after the forward pass: the step's records so far
                opt.zero_grad()
                loss.backward()
                opt.step()
    return tracer.open_dump(run)


@pytest.mark.parametrize("config", [{"level": "module", "writer": "sync"},
                                    {"level": "op", "writer": "async"},
                                    {"level": "mix", "writer": "async", "mode": "full"},
                                    {"level": "module", "writer": "sync", "mode": "tensor"}])
def test_exception_in_with_block_marks_the_open_step(tmp_path, config):
    d = _loop_until_failure(tmp_path, config, 3, RuntimeError("loss went wrong"))
    assert d.steps(0) == [0, 1, 2, 3]
    for step in (0, 1, 2):
        assert d.status(0, step) == ("complete", "")
        assert d.attrs(0, step)["complete"] == 1
    assert d.status(0, 3) == ("interrupted", "RuntimeError: loss went wrong")
    assert d.attrs(0, 3)["complete"] == 0 and d.attrs(0, 3)["format_version"] == FORMAT_VERSION
    df = d.stats(0, 3)
    assert (df.module == "fc2").any() and "backward" not in set(df.phase)  # as far as it got
    params = df[df.phase == "optimizer"]  # the weights (and gradients) it died with
    assert set(params.direction) == {"param", "grad"} and len(params) == 8
    summary = d.summary()
    assert list(summary.status) == ["complete"] * 3 + ["interrupted"]
    assert list(summary.complete) == [True] * 3 + [False]


def test_keyboard_interrupt_marks_the_open_step(tmp_path):
    d = _loop_until_failure(tmp_path, {"level": "op"}, 1, KeyboardInterrupt())
    assert d.steps(0) == [0, 1]
    assert d.status(0, 1) == ("interrupted", "KeyboardInterrupt")
    assert len(d.stats(0, 1)) > 0


def test_interrupted_and_complete_attributes_on_every_write_path(tmp_path):
    """Statistics files and ones with tensor bytes, sync and async (the async writer's file
    process), an interrupted one among them: each says what happened to it."""
    x = torch.arange(6.0).reshape(2, 3)
    for writer_kind in ("sync", "async"):
        for mode in ("statistics", "full"):
            run = tmp_path / f"{writer_kind}-{mode}"
            w = make_writer(tracer.DumpConfig(path=str(run), writer=writer_kind, mode=mode),
                            rank=0, world_size=1)
            for step in range(6):
                w.begin_step(step)
                w.add(RecordMeta("a.forward.0.output.0", "a", "", "forward", "output", 0, 0,
                                 "t.py:1"), x + step)
                if step == 4:
                    w.end_step("SIGTERM")
                elif step < 5:
                    w.end_step()
            w.close()  # step 5 still open: interrupted, no reason given
            d = tracer.open_dump(run)
            assert [d.status(0, s)[0] for s in range(6)] == ["complete"] * 4 + ["interrupted"] * 2
            assert d.status(0, 4) == ("interrupted", "SIGTERM")
            assert "step was open" in d.status(0, 5)[1]
            assert [d.attrs(0, s)["complete"] for s in range(6)] == [1, 1, 1, 1, 0, 0]
            for s in range(6):
                assert float(d.stats(0, s)["max"].iloc[0]) == 5.0 + s


def test_dropped_step_writes_nothing_on_either_writer(tmp_path):
    x = torch.ones(3)
    for writer_kind in ("sync", "async"):
        run = tmp_path / writer_kind
        w = make_writer(tracer.DumpConfig(path=str(run), writer=writer_kind), rank=0,
                        world_size=1)
        for step in range(2):
            w.begin_step(step)
            w.add(RecordMeta("a.forward.0.output.0", "a", "", "forward", "output", 0, 0,
                             "t.py:1"), x)
            w.end_step(drop=step == 1)
        w.close()
        assert sorted(p.name for p in (run / "dump" / "rank0").iterdir()) == ["step0.h5"]


def test_files_without_status_read_as_their_complete_attribute(tmp_path):
    d = tracer.open_dump(GOLDEN_3_0)
    assert d.status(0, 5) == ("complete", "") and list(d.summary().status) == ["complete"]
    old = tmp_path / "dump" / "rank0" / "step2.h5"
    old.parent.mkdir(parents=True)
    old.write_bytes(GOLDEN_3_0.read_bytes())
    with h5py.File(old, "r+") as f:
        f.attrs["step"] = 2
        f.attrs["complete"] = 0
    dump = tracer.open_dump(tmp_path)
    status, reason = dump.status(0, 2)
    assert status == "interrupted" and "no reason recorded" in reason
    # one rule for a step's status: the scan's words are the reader's
    assert dump.state(0, 2).reason == f"interrupted: {reason}"


def test_trainer_failure_marks_the_step_it_died_in(tmp_path):
    import trainer
    from sleuth._callbacks import DumpCallback

    class Boom(trainer.Callback):
        def on_after_backward(self, state):
            if state.step == 2:
                raise RuntimeError("data loader died")

    cfg = tmp_path / "dump.json"
    cfg.write_text(json.dumps({"level": "module", "writer": "sync"}))
    config = trainer.load_config(overrides=["steps=4", "eval_every=0"],
                                 run_dir=str(tmp_path / "run"))
    with pytest.raises(RuntimeError, match="data loader died"):
        trainer.train(config, [DumpCallback(str(cfg)), Boom()])
    d = tracer.open_dump(tmp_path / "run")
    assert d.steps(0) == [0, 1, 2]
    assert [d.status(0, s)[0] for s in (0, 1)] == ["complete", "complete"]
    assert d.status(0, 2) == ("interrupted", "RuntimeError: data loader died")
    assert {"forward", "backward"} <= set(d.stats(0, 2).phase)


# A plain loop nobody wrote for Sleuth; it says where it is through files in its cwd.
_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(6):
        loss = nn.functional.mse_loss(model(x), y)
        if step == 3 and sys.argv[1] == "hang":
            Path("pid").write_text(str(os.getpid()))
            time.sleep(120)  # SIGTERM arrives here, mid-step
        if step == 3 and sys.argv[1] == "raise":
            raise ValueError("bad batch")
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(step, loss.item(), flush=True)
""")


def _sleuth_run(tmp_path, how, **extra_env):
    (tmp_path / "train.py").write_text(_SCRIPT)
    (tmp_path / "dump.json").write_text('{"level": "op"}')
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra_env}
    return subprocess.Popen([sys.executable, "-m", "sleuth", "run", "--run-dir", "run",
                             "--dump", "dump.json", "--", "python", "train.py", how],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _statuses(run):
    d = tracer.open_dump(run)
    return {s: d.status(0, s) for s in d.steps(0)}, d


@pytest.mark.slow
@pytest.mark.parametrize("target,reason", [("script", "SIGTERM"), ("sleuth", "SIGTERM"),
                                           ("ctrl-c", "KeyboardInterrupt"),
                                           ("script-no-flight", "SIGTERM")])
def test_sigterm_under_sleuth_run_writes_the_open_step(tmp_path, target, reason):
    """SIGTERM to the script's process, or to `sleuth run` (a scheduler's), which passes it on;
    Ctrl-C: SIGINT to the whole process group, as a terminal sends it; with the flight recorder
    off, the crash hooks still write the open step (and no flight recorder file)."""
    no_flight = target == "script-no-flight"
    proc = _sleuth_run(tmp_path, "hang", **({"SLEUTH_FLIGHT_STEPS": "0"} if no_flight else {}))
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "pid").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(0.3)
        if target == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(int((tmp_path / "pid").read_text()) if target.startswith("script")
                    else proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, err  # the script still dies by the signal
    statuses, d = _statuses(tmp_path / "run")
    assert statuses == {0: ("complete", ""), 1: ("complete", ""), 2: ("complete", ""),
                        3: ("interrupted", reason)}, err
    assert (d.stats(0, 3).phase == "forward").any()
    flight = tmp_path / "run" / "dump" / "rank0" / "flight_recorder.h5"
    assert flight.exists() != no_flight


@pytest.mark.slow
def test_uncaught_exception_and_clean_exit_under_sleuth_run(tmp_path):
    out, err = _sleuth_run(tmp_path, "raise").communicate(timeout=240)
    assert "ValueError: bad batch" in err
    statuses, _ = _statuses(tmp_path / "run")
    assert statuses[3] == ("interrupted", "ValueError: bad batch") and len(statuses) == 4
    clean = tmp_path / "clean"
    clean.mkdir()
    proc = _sleuth_run(clean, "clean")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    statuses, _ = _statuses(clean / "run")
    assert statuses == {s: ("complete", "") for s in range(6)}
    note = json.loads((clean / "run" / "dump" / "rank0" / "notes.jsonl").read_text())
    assert note["step"] == 6 and note["dropped_records"] > 0  # the last loss.item()


# SIGTERM at a chosen point of step 3, from inside the tracer's own work: Python runs a signal
# handler between any two bytecodes, and at op level most of them are the tracer's.
_SIGTERM_INSIDE = textwrap.dedent("""
    import os, signal, sys
    import torch
    from torch import nn
    import tracer
    from tracer.capture import OpMode
    from tracer.storage._writer import SyncWriter

    where = sys.argv[1]
    owner, name = (OpMode, "_after") if where == "op handler" else (SyncWriter, "add")
    original = getattr(owner, name)
    state = {"step": 0, "calls": 0}

    def patched(*args, **kwargs):
        if state["step"] == 3:
            state["calls"] += 1
            if state["calls"] == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: in here
        return original(*args, **kwargs)

    setattr(owner, name, patched)
    dumper = tracer.attach_from_env()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(6):
        state["step"] = step
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("not killed")
""")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["op handler", "writer"])
def test_sigterm_inside_the_tracer_exits_clean(tmp_path, where):
    """A SIGTERM that lands while the op mode's handler runs (torch has the mode off its stack
    then) or while the dump measures a tensor (the mode suspended): the open step is written
    marked interrupted, and nothing of torch's dispatch stack ("trying to pop from empty mode
    stack") or any traceback reaches stderr; the process still dies by the signal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env.update(PYTHONPATH=str(REPO), SLEUTH_DUMP_CONFIG='{"level": "op", "writer": "sync"}',
               SLEUTH_RUN_DIR=str(tmp_path / "run"))
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_INSIDE, where], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "not killed" not in proc.stdout
    assert "mode stack" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    statuses, d = _statuses(tmp_path / "run")
    assert statuses == {0: ("complete", ""), 1: ("complete", ""), 2: ("complete", ""),
                        3: ("interrupted", "SIGTERM")}, proc.stderr
    assert len(d.stats(0, 3))
    assert [line for line in proc.stderr.splitlines() if line] == [
        f"sleuth: flight recorder written to {tmp_path / 'run' / 'dump' / 'rank0'}"
        f"/flight_recorder.h5"]


_SIGTERM_AT_STEP_3 = textwrap.dedent("""
    import os, signal, sys
    import torch, tracer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": sys.argv[1], "writer": "sync"}):
        for step in range(5):
            loss = model(torch.randn(3, 4)).sum()
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # after the forward pass
            loss.backward()
            opt.step()
            opt.zero_grad()
""")


@pytest.mark.slow
@pytest.mark.parametrize("steps", ["three", "0"])
def test_sigterm_writes_the_open_step_whatever_the_flight_recorder(tmp_path, steps):
    """The crash hooks that write the open step do not depend on the flight recorder: a bad
    $SLEUTH_FLIGHT_STEPS (the recorder off, with a warning) or 0 (off) still leaves step 3
    written and marked interrupted, and the process still dies by the signal."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLEUTH_FLIGHT_STEPS": steps}
    res = subprocess.run([sys.executable, "-c", _SIGTERM_AT_STEP_3, str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=180)
    assert res.returncode == -signal.SIGTERM, res.stderr
    statuses, d = _statuses(tmp_path)
    assert statuses == {0: ("complete", ""), 1: ("complete", ""), 2: ("complete", ""),
                        3: ("interrupted", "SIGTERM")}, res.stderr
    assert (d.stats(0, 3).phase == "forward").any()
    assert not (tmp_path / "dump" / "rank0" / "flight_recorder.h5").exists()
    if steps == "three":
        assert "SLEUTH_FLIGHT_STEPS" in res.stderr and "Traceback" not in res.stderr
