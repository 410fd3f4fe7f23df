"""The SLEUTH_SAVE_GRAPHS=1 trigger in real training scripts: byte-stable across processes,
and training is bit-identical with and without it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

TRAIN = """
import sys, torch, irdump
handle = irdump.attach_from_env()
print("attached" if handle is not None else "detached")
from irdump_models import make_tiny
torch.manual_seed(0)
model = make_tiny()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(4, 16)
    loss = (model(x) - 0.25).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("checksum", repr(sum(float(p.double().sum()) for p in model.parameters())))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE)])
    env.update(extra)
    return env


def _start(code: str, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.mark.slow
def test_env_trigger_is_byte_stable_and_does_not_disturb_training(tmp_path):
    """Two traced processes (one per output variable) and one plain process, side by side."""
    run, graphs = tmp_path / "run", tmp_path / "graphs"
    procs = [_start(TRAIN, SLEUTH_SAVE_GRAPHS="1", SLEUTH_RUN_DIR=str(run)),
             _start(TRAIN, SLEUTH_SAVE_GRAPHS="1", SLEUTH_SAVE_GRAPHS_PATH=str(graphs)),
             _start(TRAIN)]
    outs = [_wait(p).splitlines() for p in procs]
    assert [o[0] for o in outs] == ["attached", "attached", "detached"]
    # the same parameters, bit for bit, with and without graph saving
    assert outs[0][-1] == outs[1][-1] == outs[2][-1]
    names = sorted(p.name for p in (run / "ir").iterdir())
    assert names == sorted(f"{i:02d}_{s}{ext}" for i, s in enumerate(
        ["forward", "forward_aten_decomposed", "backward", "forward_eager"])
        for ext in (".ir", ".sorted.ir", ".dot", ".svg"))
    # two processes, two output folders, identical bytes
    assert sorted(p.name for p in graphs.iterdir()) == names
    for name in names:
        assert (run / "ir" / name).read_bytes() == (graphs / name).read_bytes(), name
    backward = (run / "ir" / "02_backward.ir").read_text()
    assert "# capture: autograd" in backward
    assert "forward=head::aten.addmm.forward.0" in backward
    assert "<none>::MeanBackward0.backward.0" in backward  # the loss runs outside the model
    assert "# capture: torch.export" in (run / "ir" / "00_forward.ir").read_text()
    eager = (run / "ir" / "03_forward_eager.ir").read_text()
    assert str(tmp_path) not in eager and str(REPO) not in eager and " at 0x" not in eager
    assert "# tests/irdump/irdump_models.py:" in eager


@pytest.mark.slow
@pytest.mark.parametrize("strict", ["0", "1"])
def test_graphs_that_cannot_be_written_turn_the_saver_off_and_training_goes_on(tmp_path, strict):
    """A folder the graphs cannot go to (a file where it should be): one `sleuth:` line, the
    saver off, training bit-identical to a run without it; SLEUTH_STRICT=1 stops the run with
    irdump's error instead (the switch the dump and the profiler read)."""
    blocked = tmp_path / "ir"
    blocked.write_text("a file where the graphs folder goes")
    traced = _start(TRAIN, SLEUTH_SAVE_GRAPHS="1", SLEUTH_SAVE_GRAPHS_PATH=str(blocked),
                    SLEUTH_STRICT=strict)
    out, err = traced.communicate(timeout=240)
    if strict == "1":
        assert traced.returncode != 0 and "IrDumpError" not in out
        assert "IR graphs: writing the forward" in err and str(blocked) in err, err[-2000:]
        return
    assert traced.returncode == 0, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("sleuth")]
    assert len(lines) == 1 and lines[0].startswith("sleuth: the IR graphs are off"), err
    assert "Traceback" not in err, err
    assert str(blocked) in lines[0] and "SLEUTH_STRICT=1" in lines[0]
    assert out.splitlines()[-1] == _wait(_start(TRAIN)).splitlines()[-1]  # same training
    assert blocked.read_text() == "a file where the graphs folder goes"


def test_a_full_disk_leaves_no_half_written_graph(tmp_path, monkeypatch):
    import errno
    import warnings

    import torch

    from irdump._attach import GraphSaver
    from irdump_models import make_tiny
    from tracer import SleuthWarning

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.delenv("SLEUTH_STRICT", raising=False)
    model = make_tiny()
    with warnings.catch_warnings(record=True) as seen, GraphSaver(tmp_path / "ir") as saver:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(4, 16)).pow(2).mean().backward()
    said = [str(w.message) for w in seen if issubclass(w.category, SleuthWarning)]
    assert len(said) == 1 and "No space left on device" in said[0], said
    assert saver.removed and saver.written == []
    assert list((tmp_path / "ir").iterdir()) == []  # no .partial left behind


@pytest.mark.slow
def test_a_compiled_model_stays_compiled_and_its_forward_stages_are_saved(tmp_path):
    # traced by dynamo, the saver's hooks (or the real call under its dispatch mode) would
    # leave the model running eagerly: another run than the one the user trains
    import warnings

    import torch
    from torch._dynamo.utils import counters

    from irdump._attach import GraphSaver
    from irdump_models import make_tiny
    from tracer import SleuthWarning

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = make_tiny()
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as seen, GraphSaver(tmp_path / "ir"):
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(torch.randn(4, 16)).pow(2).mean().backward()
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    said = [str(w.message) for w in seen if issubclass(w.category, SleuthWarning)]
    assert len(said) == 1 and "torch.compile'd" in said[0], said
    assert sorted(p.name for p in (tmp_path / "ir").glob("*.ir")) == [
        "00_forward.ir", "00_forward.sorted.ir", "01_forward_aten_decomposed.ir",
        "01_forward_aten_decomposed.sorted.ir"]
