"""`sleuth run --save-graphs` around a two-rank DDP run (torchrun, gloo) changes nothing:
the same final weights, BatchNorm statistics included, as without it; graphs are exported from
the model inside the wrapper, called with keyword arguments; nothing hangs. And in one
process, a keyword-only call (a Hugging Face model's) is captured without disturbing training."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from tracer import SleuthWarning

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import atexit
    import hashlib
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.drop = nn.Dropout(0.3)
            self.head = nn.Linear(4 * 8 * 8, 3)

        def forward(self, images, scale):
            h = self.drop(torch.relu(self.bn(self.conv(images))))
            return self.head(h.flatten(1)) * scale


    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(3):
        x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
        loss = nn.functional.cross_entropy(model(images=x, scale=torch.tensor(2.0)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = model.module.state_dict()  # running statistics too
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in state.values())).hexdigest()
    print(f"rank {dist.get_rank()} weights {digest}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # torch's gloo threads abort a rank now and then while the interpreter finalizes
    # ("terminate called without an active exception"; pytorch/pytorch#190489), without Sleuth
    # too and after destroy_process_group: run the exit handlers (Sleuth's among them), then
    # leave without the C++ teardown
    atexit._run_exitfuncs()
    sys.stdout.flush()
    os._exit(0)
""")


def _start(tmp_path: Path, port: int, run: str, *flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen(
        [sys.executable, "-m", "sleuth", "run", "--run-dir", run, *flags, "--", sys.executable,
         "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
         "train.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)  # its own group: a hang is killed with every rank


def _finish(proc: subprocess.Popen) -> list[str]:
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the two-rank run hung")
    assert proc.returncode == 0, err[-3000:]
    # the two ranks write through one pipe: their lines can run together, so match, not split
    return sorted(re.findall(r"rank \d+ weights [0-9a-f]{64}", out))


@pytest.mark.slow
def test_save_graphs_under_ddp_changes_nothing_and_exports(tmp_path, free_port):
    (tmp_path / "train.py").write_text(_SCRIPT)
    plain = _start(tmp_path, free_port(), "plain")
    graphs = _start(tmp_path, free_port(), "graphs", "--save-graphs")
    weights = _finish(plain)
    assert len(weights) == 2
    assert _finish(graphs) == weights  # every rank bit-identical, buffers and dropout too
    ir = tmp_path / "graphs" / "ir"
    stages = sorted(p.name for p in ir.glob("*.ir") if not p.name.endswith(".sorted.ir"))
    assert stages == ["00_forward.ir", "01_forward_aten_decomposed.ir", "02_backward.ir",
                      "03_forward_eager.ir"]
    forward = (ir / "00_forward.ir").read_text()
    assert "# entry: Net" in forward and "capture: torch.export" in forward  # no fallback
    eager = (ir / "03_forward_eager.ir").read_text()
    assert "bn::aten.native_batch_norm.forward.0" in eager and "module." not in eager


def test_attach_captures_a_keyword_call_and_leaves_training_bit_identical(tmp_path):
    """In one process: a model called with keyword arguments only (as Hugging Face models
    are) is captured with them, and BatchNorm statistics, dropout and weights are untouched."""
    import torch
    from torch import nn

    from irdump._attach import GraphSaver

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.drop, self.fc = nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 2)

        def forward(self, input_ids, scale):
            return self.fc(self.drop(self.bn(input_ids))) * scale

    def train(saver_path=None):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        saver = GraphSaver(saver_path) if saver_path else None
        try:
            for _ in range(2):
                model(input_ids=torch.randn(4, 6), scale=torch.tensor(3.0)).sum().backward()
                opt.step()
                opt.zero_grad()
        finally:
            if saver is not None:
                saver.remove()
        return model.state_dict(), torch.rand(1)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("error", SleuthWarning)  # a failed capture only warns
        state, after = train(tmp_path / "ir")
    plain_state, plain_after = train()
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)  # running stats too
    assert torch.equal(after, plain_after)  # the RNG where the plain run left it
    forward = (tmp_path / "ir" / "00_forward.ir").read_text()
    assert "capture: torch.export" in forward and "fc::aten.linear.forward.0" in forward
    assert (tmp_path / "ir" / "02_backward.ir").exists()


def test_an_evaluation_before_the_first_step_still_gives_the_training_backward(tmp_path):
    """nanoGPT evaluates (no_grad, eval mode) before its first step: the backward graph is
    then taken from the first call with gradients, not given up, and training is untouched."""
    import torch
    from torch import nn

    from irdump._attach import GraphSaver

    def train(saver_path=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        saver = GraphSaver(saver_path) if saver_path else None
        try:
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 6))
            model.train()
            for _ in range(2):
                model(torch.randn(4, 6)).sum().backward()
                opt.step()
                opt.zero_grad()
        finally:
            if saver is not None:
                saver.remove()
        return model.state_dict(), torch.rand(1)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("error", SleuthWarning)  # "backward graph is not saved" fails
        state, after = train(tmp_path / "ir")
    plain_state, plain_after = train()
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)
    assert torch.equal(after, plain_after)
    backward = (tmp_path / "ir" / "02_backward.ir").read_text()
    assert "stage: backward" in backward
    eager = (tmp_path / "ir" / "03_forward_eager.ir").read_text()
    assert "aten.bernoulli_" in eager  # dropout: from the training call, not the evaluation



def test_several_processes_never_fall_back_to_a_forward_of_their_own(tmp_path, monkeypatch):
    """Where export fails under several processes, no traced call runs (it would run the
    model's collectives on rank 0 only): a warning, and the stages of the real call."""
    import torch
    from irdump_models import make_branchy

    from irdump._attach import GraphSaver

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    model = make_branchy()  # data-dependent control flow: torch.export refuses it
    calls = []
    model.a.register_forward_hook(lambda *_: calls.append(1))
    with pytest.warns(SleuthWarning, match="forward stages are not saved"):
        with GraphSaver(tmp_path):
            model(torch.ones(2, 8)).sum().backward()
    assert len(calls) == 1  # the real call only
    assert sorted(p.name for p in tmp_path.glob("*.ir") if ".sorted" not in p.name) == \
        ["02_backward.ir", "03_forward_eager.ir"]
