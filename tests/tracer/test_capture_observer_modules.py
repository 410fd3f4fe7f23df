"""Module records kept by the compiled observer (`"op_capture": "observer"` at level module,
and the module records of level mix) against the Python writer's: the same rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tracer
from models import MLP, observer_built, stranger_models, train_and_dump

pytestmark = pytest.mark.skipif(not observer_built(),
                                reason="tracer._observer is not built here")
MODELS = stranger_models()
_COLUMNS = ("seq", "name", "module", "op", "phase", "direction", "index", "call", "dtype",
            "shape", "numel", "min", "max", "mean", "norm", "nan", "posinf", "neginf", "zeros",
            "checksum", "source")


@pytest.mark.parametrize("writer", ["sync", "async"])
@pytest.mark.parametrize("index", range(len(MODELS)), ids=[m[0] for m in MODELS])
def test_module_records_are_the_python_writers(tmp_path, index, writer):
    """Level module, statistics, two steps with gradient accumulation: every row the same,
    column for column (the same kernel measures both), in the same order."""
    _, model_fn, batch_fn = MODELS[index]
    cfg = {"level": "module", "mode": "statistics", "writer": writer}
    da = train_and_dump(model_fn, batch_fn, tmp_path / "a", steps=2, micro=2, **cfg)
    db = train_and_dump(model_fn, batch_fn, tmp_path / "b", steps=2, micro=2,
                        op_capture="observer", **cfg)
    for step in (0, 1):
        a, b = da.stats(0, step), db.stats(0, step)
        assert len(a) > 10 and (a.phase == "backward").any()
        for column in _COLUMNS:
            assert list(a[column].astype(str)) == list(b[column].astype(str)), (step, column)


@pytest.mark.parametrize("index", [0, 1], ids=["causal_lm", "cnn"])
def test_module_tensors_are_bit_exact(tmp_path, index):
    _, model_fn, batch_fn = MODELS[index]
    cfg = {"level": "module", "mode": "full", "writer": "async"}
    da = train_and_dump(model_fn, batch_fn, tmp_path / "a", steps=1, **cfg)
    db = train_and_dump(model_fn, batch_fn, tmp_path / "b", steps=1, op_capture="observer",
                        **cfg)
    a, b = da.stats(0, 0), db.stats(0, 0)
    assert list(a.name) == list(b.name) and len(a) > 10
    for name in a.name:
        x, y = da.tensor_torch(0, 0, name), db.tensor_torch(0, 0, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("mode", ["statistics", "full"])
def test_module_records_skip_the_python_writer(tmp_path, monkeypatch, mode):
    """The module records come as rows from the observer; with statistics only, the
    parameter records too (with tensor bytes they go to the writer's `add`, which shares
    stored bytes), and only tensors the kernel does not read reach `add`."""
    from tracer import _writer

    names = []
    real = _writer.SyncWriter.add

    def add(self, meta, *args, **kwargs):
        names.append(meta.name)
        return real(self, meta, *args, **kwargs)

    monkeypatch.setattr(_writer.SyncWriter, "add", add)
    d = train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path, steps=1, level="module",
                       op_capture="observer", writer="sync", mode=mode)
    s = d.stats(0, 0)
    assert (s.phase == "forward").any() and (s.phase == "backward").any()
    optimizer = s[s.phase == "optimizer"]
    assert set(optimizer.direction) == {"param", "grad", "update"}
    assert set(optimizer.module) == {"fc1", "fc2"}
    if mode == "statistics":
        assert not names
    else:
        assert names and all(".optimizer." in n for n in names)
        assert set(names) == set(optimizer.name)


def test_float64_module_records_go_to_the_python_writer(tmp_path):
    def run(path, capture):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        with tracer.Dumper(model, {"path": str(path), "level": "module",
                                   "op_capture": capture, "params": False}):
            model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
        return tracer.open_dump(path).stats(0, 0)

    a, b = run(tmp_path / "a", "dispatch"), run(tmp_path / "b", "observer")
    assert list(a.name) == list(b.name) and (b.dtype == "float64").all() and len(b) > 6
    assert list(a.norm) == list(b.norm) and list(a.checksum) == list(b.checksum)


def test_module_filters_and_recomputation(tmp_path):
    """Filters, io and phases apply; an activation-checkpointed block records its forward once
    and its gradients once, as with the Python writer."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = MLP()

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    def run(path, capture):
        torch.manual_seed(0)
        model = Block()
        with tracer.Dumper(model, {"path": str(path), "level": "module", "op_capture": capture,
                                   "exclude_modules": ["inner.fc2"], "io": "output"}):
            model(torch.randn(2, 8, requires_grad=True)).sum().backward()
        return tracer.open_dump(path).stats(0, 0)

    a, b = run(tmp_path / "a", "dispatch"), run(tmp_path / "b", "observer")
    assert list(a.name) == list(b.name) and list(a.checksum) == list(b.checksum)
    assert not b.name.str.startswith("inner.fc2.").any()
    assert not b.name.str.contains(r"\.input\.").any()
    assert b.name.str.contains(r"\.backward\.").any()
    assert b[b.phase == "forward"].name.is_unique


def test_hard_cases_match_the_python_writer(tmp_path):
    """A module called twice, tied parameters, an in-place op on a module output, a custom
    autograd Function, bf16 autocast with two backward passes and a no_grad evaluation in one
    step: the same rows as the Python writer's."""
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.fc = nn.Linear(8, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight  # tied

        def forward(self, ids):
            h = self.fc(self.emb(ids))
            h = self.fc(h).relu_()  # called twice; in place on its output
            return self.head(Double.apply(h))

    def run(path, capture):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(0, 10, (2, 5))
        with tracer.Dumper(model, {"path": str(path), "level": "module", "op_capture": capture,
                                   "writer": "sync"}):
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(ids).float().pow(2).mean().backward()
            with torch.no_grad():
                model(ids)
            opt.step()
        return tracer.open_dump(path).stats(0, 0)

    a, b = run(tmp_path / "a", "dispatch"), run(tmp_path / "b", "observer")
    assert (b.dtype == "bfloat16").any() and b.name.str.contains(r"^fc\.forward\.5\.").any()
    for column in _COLUMNS:
        assert list(a[column].astype(str)) == list(b[column].astype(str)), column


def test_gradient_hooks_are_compiled(tmp_path, monkeypatch):
    """With the observer the module hooks hook gradients in C++: Python's
    `Tensor.register_hook` is never called, and every backward record is still there."""
    calls = []
    real = torch.Tensor.register_hook

    def register_hook(self, hook):
        calls.append(hook)
        return real(self, hook)

    monkeypatch.setattr(torch.Tensor, "register_hook", register_hook)
    d = train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path / "o", steps=2,
                       level="module", op_capture="observer", writer="sync")
    assert not calls
    ref = train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path / "p", steps=2,
                         level="module", op_capture="dispatch", writer="sync")
    assert calls  # the Python path's hooks
    for step in (0, 1):
        a, b = ref.stats(0, step), d.stats(0, step)
        assert (b.phase == "backward").sum() >= 4
        assert list(a.name) == list(b.name) and list(a.checksum) == list(b.checksum)


def test_a_closed_dumpers_gradient_hooks_record_nothing(tmp_path):
    """The C++ gradient hooks of a Dumper that is closed stay on its graph; when that graph's
    backward runs inside another Dumper's step they record nothing there."""
    def run(path, stale_loss=None):
        torch.manual_seed(1)
        model = MLP()
        with tracer.Dumper(model, {"path": str(path), "level": "module", "params": False,
                                   "op_capture": "observer"}):
            loss = model(torch.randn(2, 8)).sum()
            if stale_loss is not None:
                stale_loss.backward()  # first: its records would take this step's names
            loss.backward()
        return tracer.open_dump(path).stats(0, 0)

    old = MLP()
    with tracer.Dumper(old, {"path": str(tmp_path / "old"), "level": "module",
                             "params": False, "op_capture": "observer"}):
        stale = old(torch.randn(2, 8)).sum()  # hooked, backward not run while it dumps
    a, b = run(tmp_path / "a"), run(tmp_path / "b", stale)
    assert list(a.name) == list(b.name) and b.name.is_unique
    assert list(a.checksum) == list(b.checksum)
    assert old.fc1.weight.grad is not None  # its backward did run


def test_parameter_records_match_the_python_writer(tmp_path):
    """Parameter records kept in compiled code: a float32 and a bfloat16 parameter (its update
    computed by torch), a frozen one (no gradient), a parameter the optimizer does not step,
    and a step that ends without an optimizer step: the rows of the Python path."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)
            self.low = nn.Linear(6, 6).to(torch.bfloat16)
            self.frozen = nn.Linear(6, 6)
            self.frozen.requires_grad_(False)
            self.unstepped = nn.Parameter(torch.randn(6))

        def forward(self, x):
            h = self.frozen(self.fc(x)) + self.unstepped
            return self.low(h.to(torch.bfloat16)).float()

    def run(path, capture):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD([*model.fc.parameters(), *model.low.parameters()], lr=0.1,
                              momentum=0.9)
        with tracer.Dumper(model, {"path": str(path), "level": "module", "op_capture": capture,
                                   "writer": "sync"}) as dumper:
            for step in range(3):
                model(torch.randn(3, 6)).pow(2).mean().backward()
                if step != 1:
                    opt.step()
                opt.zero_grad()
                dumper.step()
        dump = tracer.open_dump(path)
        return [dump.stats(0, s) for s in dump.steps(0)]

    a, b = run(tmp_path / "a", "dispatch"), run(tmp_path / "b", "observer")
    assert len(a) == len(b) >= 3
    for x, y in zip(a, b):
        for column in _COLUMNS:
            assert list(x[column].astype(str)) == list(y[column].astype(str)), column
    import pandas as pd

    opt = pd.concat(b)
    opt = opt[opt.phase == "optimizer"]
    assert set(opt.direction) == {"param", "grad", "update"}
    assert {"bfloat16", "float32"} <= set(opt[opt.direction == "update"].dtype)
    assert (opt[opt.direction == "param"].module == "frozen").any()
    assert not (opt[opt.direction == "grad"].module == "frozen").any()


def test_float64_parameter_records_go_to_the_python_writer(tmp_path):
    """Parameters of a dtype the kernel does not read: their pre-step copies are made by
    Python, and their records (the update computed by torch) are measured by the Python writer
    at the drain: the rows of the Python path."""
    def run(path, capture):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        with tracer.Dumper(model, {"path": str(path), "level": "module",
                                   "op_capture": capture}):
            model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
            opt.step()
        return tracer.open_dump(path).stats(0, 0)

    a, b = run(tmp_path / "a", "dispatch"), run(tmp_path / "b", "observer")
    opt = b[b.phase == "optimizer"]
    assert set(opt.direction) == {"param", "grad", "update"} and (opt.dtype == "float64").all()
    for column in _COLUMNS:
        assert list(a[column].astype(str)) == list(b[column].astype(str)), column


def test_the_observer_measures_with_the_threads_of_this_process(tmp_path, monkeypatch):
    """The observer is configured with the statistics threads read when it starts, not with
    whatever an earlier writer left (the first Dumper of a process used one thread)."""
    from tracer import _observer, _stats

    seen = []
    real = _observer.configure

    def configure(*args):
        seen.append(args[-2])
        return real(*args)

    monkeypatch.setattr(_observer, "configure", configure)
    monkeypatch.setattr(_stats, "_ENV_THREADS", 2)  # SLEUTH_STATS_THREADS=2
    monkeypatch.setattr(_stats, "STATS_THREADS", 1)
    try:
        d = train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path, steps=1,
                           level="module", op_capture="observer")
    finally:
        monkeypatch.undo()
        _stats.refresh_stats_threads()
    assert seen == [2] and len(d.stats(0, 0)) > 10
