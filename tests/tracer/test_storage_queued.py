"""Backward records whose statistics the kernel's helper thread takes (tracer.storage._queued).

Tiny test models have tiny gradients, below the size worth queueing, so these tests lower
`MIN_ELEMENTS` to queue every backward record, and compare against the hook-time path.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import tracer
import tracer.storage._queued as queued
import tracer.storage._stats as stats_module
from models import MLP, CheckpointedMLP, TinyCausalLM, TinyConfig, train_and_dump

pytestmark = pytest.mark.skipif(not stats_module.fused_available(), reason="needs the C kernel")


@pytest.fixture(autouse=True)
def a_free_core(monkeypatch):
    """Queueing needs a core torch leaves free; pretend there is one (writers re-read it)."""
    monkeypatch.setattr(stats_module, "_ENV_THREADS", 2)
    monkeypatch.setattr(stats_module, "STATS_THREADS", 2)


def dump_rows(tmp_path, model_fn, batch_fn, *, writer, micro=1, **config):
    dump = train_and_dump(model_fn, batch_fn, tmp_path, micro=micro, writer=writer,
                          **config)
    return [dump.stats(0, s).drop(columns=["source"]) for s in dump.steps(0)]


def count_submits(monkeypatch) -> list:
    tickets = []
    real = queued.submit_stats

    def spy(t):
        ticket = real(t)
        tickets.append(ticket)
        return ticket

    monkeypatch.setattr(queued, "submit_stats", spy)
    return tickets


def lm_batch():
    ids = torch.randint(0, 64, (2, 8))
    return ids, None, ids


@pytest.mark.parametrize("writer", ["sync", "async"])
@pytest.mark.parametrize("model_fn,batch_fn,micro", [
    (MLP, lambda: (torch.randn(4, 8),), 1),
    (lambda: TinyCausalLM(TinyConfig()), lm_batch, 1),
    (CheckpointedMLP, lambda: (torch.randn(4, 8),), 2),  # recomputation, two backward passes
])
def test_queued_statistics_equal_hook_time_statistics(tmp_path, monkeypatch, writer, model_fn,
                                                      batch_fn, micro):
    monkeypatch.setattr(queued, "ENABLED", False)
    expected = dump_rows(tmp_path / "hook", model_fn, batch_fn, writer=writer, micro=micro,
                         level="module")
    monkeypatch.setattr(queued, "ENABLED", True)
    monkeypatch.setattr(queued, "MIN_ELEMENTS", 1)
    tickets = count_submits(monkeypatch)
    got = dump_rows(tmp_path / "queued", model_fn, batch_fn, writer=writer, micro=micro,
                    level="module")
    assert tickets and all(t is not None for t in tickets)  # backward records were queued
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.equals(b)


def test_nothing_is_pending_when_backward_returns(tmp_path, monkeypatch):
    """The engine callback settles the queue: after backward() every backward record's row
    exists and the observers have seen it."""
    monkeypatch.setattr(queued, "MIN_ELEMENTS", 1)
    model = MLP()
    seen = []
    with tracer.Dumper(model, {"path": str(tmp_path), "writer": "sync"}) as d:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        writer = d._writer
        writer.observers.append(lambda row: seen.append(row["name"]))
        assert not writer._waiting
        model(torch.randn(4, 8)).pow(2).mean().backward()
        assert not writer._waiting
        assert any(".backward." in name for name in seen)


def test_gradient_changed_in_place_after_recording_is_warned(tmp_path, monkeypatch):
    """A user hook that writes the gradient in place after Sleuth's hook saw it breaks the
    queued statistics' assumption: the run is told, naming the record."""
    monkeypatch.setattr(queued, "MIN_ELEMENTS", 1)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            y.register_hook(lambda g: g.mul_(2))  # runs after the tracer's hook on y
            return (y * y).sum()

    model = Scaled()
    with pytest.warns(RuntimeWarning, match="fc.backward.0.output.0.*changed in place"):
        with tracer.Dumper(model, {"path": str(tmp_path), "writer": "sync"}):
            model(torch.randn(64, 8)).backward()


def test_watchpoint_on_a_queued_record_stops_backward(tmp_path, monkeypatch):
    monkeypatch.setattr(queued, "MIN_ELEMENTS", 1)
    model = MLP()
    x = torch.randn(2, 8)
    with pytest.raises(tracer.TracerError, match="fc2.backward"):
        with tracer.Dumper(model, {"path": str(tmp_path), "writer": "sync",
                                   "phases": "backward",
                                   "watch": [{"condition": "nan_inf", "on_hit": "raise",
                                              "names": ["fc2.backward.*"]}]}):
            (model(x) * float("inf")).sum().backward()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_lost_jobs_back_as_none():
    """Jobs queued before a fork are not computed in the child: collect answers None (the
    caller measures the tensor itself) instead of waiting forever; the parent's are fine."""
    from tracer.storage import _fused

    t = torch.randn(1 << 20)
    expected = stats_module.host_stats(t)
    tickets = [stats_module.submit_stats(t) for _ in range(8)]
    assert all(ticket is not None for ticket in tickets)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            # the parent's helper may have finished some before the fork; the rest are lost
            got = [stats_module.collect_stats(ticket) for ticket in tickets]
            ok = all(g is None or g == expected for g in got)
            fresh = stats_module.submit_stats(t)  # the child's own helper works
            ok = ok and fresh is not None and stats_module.collect_stats(fresh) == expected
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    answer = os.read(r, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert all(stats_module.collect_stats(ticket) == expected for ticket in tickets)
    with pytest.raises(ValueError, match="no job"):
        _fused.collect(tickets[0][0])


def test_nothing_is_queued_without_a_free_core(tmp_path, monkeypatch):
    """With every core busy with torch's threads the helper would only compete with them."""
    monkeypatch.setattr(stats_module, "_ENV_THREADS", 1)
    monkeypatch.setattr(queued, "MIN_ELEMENTS", 1)
    tickets = count_submits(monkeypatch)
    dump_rows(tmp_path, MLP, lambda: (torch.randn(4, 8),), writer="sync", level="module")
    assert tickets == []


@pytest.fixture
def lazy_helper(monkeypatch):
    """A stand-in helper that reads a queued tensor only when its statistics are collected:
    the latest a real helper could. Anything that writes a queued tensor before the queue is
    settled then shows up as wrong statistics."""
    monkeypatch.setattr(queued, "MIN_ELEMENTS", 1)
    held = {}

    def submit(t):
        ticket = (len(held), t.numel(), 0)
        held[ticket] = t
        return ticket

    monkeypatch.setattr(queued, "submit_stats", submit)
    monkeypatch.setattr(queued, "stats_ready", lambda ticket: False)
    monkeypatch.setattr(queued, "collect_stats",
                        lambda ticket: stats_module.host_stats(held.pop(ticket)))
    return held


@pytest.mark.parametrize("writer", ["sync", "async"])
@pytest.mark.parametrize("model_fn,batch_fn,micro", [
    (MLP, lambda: (torch.randn(4, 8),), 1),
    (lambda: TinyCausalLM(TinyConfig()), lm_batch, 1),
    (CheckpointedMLP, lambda: (torch.randn(4, 8),), 3),  # gradients accumulate in place
])
def test_records_queued_until_the_last_moment_are_still_right(
        tmp_path, monkeypatch, writer, model_fn, batch_fn, micro, lazy_helper):
    """The queue is settled before anything writes a queued gradient (autograd accumulating
    the next micro-batch, the optimizer, the user's next step): even a helper that reads as
    late as possible sees the recorded values."""
    monkeypatch.setattr(queued, "ENABLED", False)
    expected = dump_rows(tmp_path / "hook", model_fn, batch_fn, writer=writer, micro=micro,
                         level="module")
    monkeypatch.setattr(queued, "ENABLED", True)
    got = dump_rows(tmp_path / "queued", model_fn, batch_fn, writer=writer, micro=micro,
                    level="module")
    assert not lazy_helper  # everything queued was collected
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.equals(b)


@pytest.mark.parametrize("level", ["op", "mix"])
def test_op_records_are_never_queued(tmp_path, monkeypatch, level):
    """Holding gradients in the queue changes which ops autograd runs (a copy instead of
    taking a gradient over), so with op records only parameter gradients, measured after
    backward, are queued: the records are the same as without the queue."""
    monkeypatch.setattr(queued, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(queued, "ENABLED", False)
    # two micro-batches: the second backward adds into p.grad in place, so a gradient is no
    # longer a recorded op's output whose statistics it could reuse (with one, p.grad is the
    # backward op's output, detach()ed: reused, nothing is queued)
    expected = dump_rows(tmp_path / "hook", MLP, lambda: (torch.randn(4, 8),), writer="sync",
                         level=level, micro=2)
    monkeypatch.setattr(queued, "ENABLED", True)
    tickets = count_submits(monkeypatch)
    got = dump_rows(tmp_path / "queued", MLP, lambda: (torch.randn(4, 8),), writer="sync",
                    level=level, micro=2)
    # at most the four parameter gradients of each of the two steps, and nothing else
    param_sizes = {p.numel() for p in MLP().parameters()}
    assert 0 < len(tickets) <= 2 * 4
    assert {ticket[1] for ticket in tickets} <= param_sizes
    for a, b in zip(got, expected):
        assert a.equals(b)


def test_helper_serves_shared_and_queued_jobs_from_several_threads_exactly():
    """Shared jobs (a large tensor split with the helper), fused copies and queued jobs from
    four threads at once, for a few seconds: every result is the single-thread one, and
    nothing hangs."""
    import threading
    import time

    from tracer.storage import _fused

    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(n, generator=g) for n in (1 << 16, 300_001, 1 << 20)]
    ref = [_fused.stats(t.data_ptr(), t.numel(), 0, 1) for t in ts]
    errors: list = []
    stop = time.monotonic() + 3

    def shared():
        i = 0
        while time.monotonic() < stop:
            k = i % len(ts)
            i += 1
            if _fused.stats(ts[k].data_ptr(), ts[k].numel(), 0, 2) != ref[k]:
                errors.append(("shared", k))

    def copies():
        out = [torch.empty_like(t) for t in ts]
        i = 0
        while time.monotonic() < stop:
            k = i % len(ts)
            i += 1
            if _fused.copy_stats(out[k].data_ptr(), ts[k].data_ptr(), ts[k].numel(), 0, 2) \
                    != ref[k]:
                errors.append(("copy", k))

    def queued_jobs():
        i = 0
        while time.monotonic() < stop:
            tickets = [(_fused.submit(ts[k].data_ptr(), ts[k].numel(), 0), k)
                       for k in (i % 3, (i + 1) % 3, (i + 2) % 3)]
            i += 1
            for ticket, k in tickets:
                if ticket >= 0 and _fused.collect(ticket) != ref[k]:
                    errors.append(("queued", k))

    threads = [threading.Thread(target=f) for f in (shared, copies, queued_jobs, queued_jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []
