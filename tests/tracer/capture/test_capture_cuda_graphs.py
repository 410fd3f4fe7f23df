"""A CUDA graph captured while a step is dumped (tracer.capture._graphs): the tracer stays out of
the capture. On CPU the capture is simulated (the stream check answers True for one training
iteration); marked `cuda`, a real `torch.cuda.graph` capture under a Dumper."""
from __future__ import annotations

import warnings

import pytest
import torch

import tracer
from tests.tracer.models import MLP
from tracer import SleuthWarning
from tracer.capture import _graphs

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _iteration(model, opt, device="cpu"):
    model(torch.randn(4, 8, device=device)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("level", ["module", "op", "mix"])
def test_an_iteration_captured_into_a_graph_records_nothing_and_ends_no_step(
        tmp_path, monkeypatch, level):
    """What runs while the stream captures (forward, backward, the optimizer's step) makes no
    record, counts no call and ends no step: the eager iteration after it is step 1, named
    as step 0 is; one warning says why."""
    monkeypatch.setattr(_graphs, "_told", False)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tracer.Dumper(model, {"path": str(tmp_path), "level": level, "steps": "all"}):
        _iteration(model, opt)
        monkeypatch.setattr(_graphs, "capturing", lambda: True)
        with pytest.warns(SleuthWarning, match="CUDA graph is being captured") as told:
            _iteration(model, opt)
        monkeypatch.setattr(_graphs, "capturing", lambda: False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SleuthWarning)
            _iteration(model, opt)
    assert len(told) == 1
    dump = tracer.open_dump(tmp_path)
    assert dump.steps(0) == [0, 1]
    first, second = (list(dump.stats(0, s)["name"]) for s in (0, 1))
    assert first == second and len(first) > 10


@pytest.mark.cuda
@CUDA
def test_cuda_a_graph_captured_under_a_dumper_captures_and_replays_as_without_it(tmp_path):
    """A real capture while a step is dumped: no error (the tracer queues no copy or wait into
    it), the replay computes what eager code computes, and the eager calls are recorded."""
    torch.manual_seed(0)
    model = MLP().cuda()
    x = torch.randn(4, 8, device="cuda")
    with tracer.Dumper(model, {"path": str(tmp_path), "level": "mix", "steps": "all"}):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with pytest.warns(SleuthWarning, match="CUDA graph"):
            with torch.cuda.graph(graph):
                y = model(x)
        x.copy_(torch.randn(4, 8, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, model(x))
    assert len(tracer.open_dump(tmp_path).stats(0, 0)) > 0
