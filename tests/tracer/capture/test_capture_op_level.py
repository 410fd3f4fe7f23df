"""The op level through its one capture, the dispatch mode (tracer.capture._op_mode), as users meet
it: order against the module records, filters, diff and watchpoints on op records, the hard cases
of a real step, tensor subclasses and other dispatch modes; and what the module level keeps
across Dumpers and at the parameter records."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import tracer
from models import MLP, train_and_dump

REPO = Path(__file__).resolve().parents[3]


def test_mix_rows_keep_execution_order_with_module_records(tmp_path):
    """A module's input record comes before the records of the ops it runs, its output record
    after them, in one sequence."""
    d = train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path, steps=1, level="mix",
                       writer="sync").stats(0, 0)
    seq = dict(zip(d.name, d.seq))
    assert sorted(d.seq) == list(range(len(d)))
    ops = [s for n, s in seq.items() if n.startswith("fc1::") and ".forward." in n]
    assert ops
    assert seq["fc1.forward.0.input.0"] < min(ops) and max(ops) < seq["fc1.forward.0.output.0"]


def test_op_filters_and_directions(tmp_path):
    d = train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path, steps=1, level="op",
                       ops=["aten.addmm", "aten.mm"], exclude_modules=["fc2"], io="output",
                       phases="backward")
    s = d.stats(0, 0)
    s = s[s.phase != "optimizer"]
    assert len(s) and set(s.op) == {"aten.mm"}  # addmm runs in forward only
    assert set(s.direction) == {"output"} and set(s.phase) == {"backward"}
    assert not s.module.str.startswith("fc2").any()


def test_op_level_diff_names_the_first_divergence(tmp_path):
    """Two runs that differ in one weight: the diff of their op dumps points at the first op
    that reads it."""
    def run(path, bump):
        torch.manual_seed(0)
        model = MLP()
        if bump:
            with torch.no_grad():
                model.fc2.weight[0, 0] += 1.0
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        with tracer.Dumper(model, {"path": str(path), "level": "op", "mode": "tensor",
                                   "params": False}):
            model(x).pow(2).mean().backward()

    run(tmp_path / "a", False)
    run(tmp_path / "b", True)
    result = tracer.diff(tmp_path / "a", tmp_path / "b", step=0)
    assert result.status == "diverged"
    first = result.first_divergence
    assert first["module"] == "fc2" and first["phase"] == "forward", first


def test_an_op_watchpoint_raises_the_first_hit(tmp_path):
    """A NaN made by an op stops the run at that op: the hit raised is the first one, and the
    step is written with it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"path": str(tmp_path), "level": "op", "writer": "sync",
           "watch": [{"condition": "nan_inf", "on_hit": "raise"}]}
    with pytest.raises(tracer.WatchpointHit, match="aten.sqrt") as e:
        with tracer.Dumper(model, cfg):
            model(torch.randn(2, 4)).sqrt().sum().backward()  # negatives: NaN
            opt.step()
    assert e.value.hit["name"] == "<none>::aten.sqrt.forward.0.output.0"
    hits = tracer.open_dump(tmp_path).hits(0, 0)
    assert (hits.name == e.value.hit["name"]).any()


def test_op_level_hard_cases_in_one_step(tmp_path):
    """Gradient accumulation (two backward passes), bf16 autocast and a no_grad evaluation in
    one step: each forward counts as a call of its own, backward ops are scoped to modules,
    and two runs give the same records."""
    def train(path):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with tracer.Dumper(model, {"path": str(path), "level": "op", "writer": "sync"}):
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(torch.randn(2, 8)).float().pow(2).mean().backward()
            with torch.no_grad():
                model(torch.randn(2, 8))
            opt.step()
        return tracer.open_dump(path).stats(0, 0)

    a, b = train(tmp_path / "a"), train(tmp_path / "b")
    assert (b.dtype == "bfloat16").any()
    assert b.name.str.contains(r"^fc1::aten\.addmm\.forward\.2\.").any()  # the evaluation
    assert set(b[b.phase == "backward"].module) >= {"fc1", "fc2"}
    for column in ("name", "checksum", "zeros", "source", "shape"):
        assert list(a[column]) == list(b[column]), column


@pytest.mark.slow
def test_op_level_through_the_zero_code_attach(tmp_path):
    """`SLEUTH_DUMP_CONFIG` at level op dumps a script nobody edited, each record at the
    script's line."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(2):\n"
        "    m(torch.randn(3, 4)).sum().backward()\n"
        "    opt.step()\n")
    config = tmp_path / "dump.json"
    config.write_text(json.dumps({"path": str(tmp_path / "run"), "level": "op"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env.update({"SLEUTH_DUMP_CONFIG": str(config), "PYTHONPATH": str(REPO)})
    code = ("import tracer; tracer.attach_from_env(); import runpy; "
            "runpy.run_path('train.py', run_name='__main__')")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path,
                   timeout=120)
    s = tracer.open_dump(tmp_path / "run").stats(0, 1)
    assert s.name.str.contains("::aten.addmm.forward.0.output.0").any()
    assert (s.source.str.startswith("train.py:") | (s.phase == "optimizer")).all()


class Wrapped(torch.Tensor):
    """A wrapper tensor subclass holding a plain tensor, as DTensor, float8 and quantised
    weights do: it has no memory of its own, and runs every op on what it wraps."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Wrapped(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.inner if isinstance(t, Wrapped) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


class Counting(TorchDispatchMode):
    """A user's own dispatch mode: counts the ops it sees."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("level", ["op", "mix", "module"])
@pytest.mark.parametrize("mode", ["statistics", "full"])
def test_tensor_subclass_records_its_values(tmp_path, level, mode):
    """A model run on a wrapper subclass records what it runs on a plain tensor: the same
    names, statistics and bytes (the dump reads the subclass's values, not its missing
    memory), and the run goes on."""
    def run(path, wrap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        x = torch.randn(3, 4)
        with tracer.Dumper(model, {"path": str(path), "level": level, "mode": mode,
                                   "writer": "sync", "params": False}):
            out = model(Wrapped(x) if wrap else x)
            assert isinstance(out, Wrapped) == wrap
            out.sum().backward()
        return tracer.open_dump(path)

    a, b = run(tmp_path / "plain", False), run(tmp_path / "wrapped", True)
    sa, sb = a.stats(0, 0), b.stats(0, 0)
    assert len(sa) > (20 if level != "module" else 6)
    for column in ("name", "dtype", "shape", "checksum", "norm", "source"):
        assert list(sa[column]) == list(sb[column]), column
    if mode == "full":
        for name in sa.name:
            assert torch.equal(a.tensor_torch(0, 0, name), b.tensor_torch(0, 0, name)), name


def test_ops_under_another_dispatch_mode_are_recorded(tmp_path):
    """A user's dispatch mode pushed inside the dumped step: it sees every op as before, and
    the dump records them too, as the second call of each op."""
    torch.manual_seed(0)
    model = MLP()
    with tracer.Dumper(model, {"path": str(tmp_path), "level": "op", "writer": "sync",
                               "params": False}):
        model(torch.randn(2, 8)).sum().backward()
        with Counting() as counting:
            model(torch.randn(2, 8)).sum().backward()
    s = tracer.open_dump(tmp_path).stats(0, 0)
    assert counting.ops > 10
    first = s[s.name.str.contains(r"\.(?:forward|backward)\.0\.")]
    second = set(s[s.name.str.contains(r"\.(?:forward|backward)\.1\.")].name)
    assert len(second) > 10
    assert {n.replace(".0.", ".1.", 1) for n in first.name if "aten.ones_like" not in n} \
        <= second | {n for n in first.name if "aten.ones_like" in n}


# -- module level ---------------------------------------------------------------------------------
def test_a_closed_dumpers_gradient_hooks_record_nothing(tmp_path):
    """The gradient hooks of a Dumper that is closed stay on its graph; when that graph's
    backward runs inside another Dumper's step they record nothing there."""
    def run(path, stale_loss=None):
        torch.manual_seed(1)
        model = MLP()
        with tracer.Dumper(model, {"path": str(path), "level": "module", "params": False}):
            loss = model(torch.randn(2, 8)).sum()
            if stale_loss is not None:
                stale_loss.backward()  # first: its records would take this step's names
            loss.backward()
        return tracer.open_dump(path).stats(0, 0)

    old = MLP()
    with tracer.Dumper(old, {"path": str(tmp_path / "old"), "level": "module",
                             "params": False}):
        stale = old(torch.randn(2, 8)).sum()  # hooked, backward not run while it dumps
    a, b = run(tmp_path / "a"), run(tmp_path / "b", stale)
    assert list(a.name) == list(b.name) and b.name.is_unique
    assert list(a.checksum) == list(b.checksum)
    assert old.fc1.weight.grad is not None  # its backward did run


def test_parameter_records_of_frozen_unstepped_and_bf16_parameters(tmp_path):
    """A float32 and a bfloat16 parameter, a frozen one (no gradient), one the optimizer does
    not step, and a step that ends without an optimizer step: an optimizer step records the
    parameters it steps (param, grad, update); a step ended without one records every
    parameter, with the gradients there are when it ends."""
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

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD([*model.fc.parameters(), *model.low.parameters()], lr=0.1,
                          momentum=0.9)
    with tracer.Dumper(model, {"path": str(tmp_path), "level": "module",
                               "writer": "sync"}) as dumper:
        for step in range(3):
            model(torch.randn(3, 6)).pow(2).mean().backward()
            if step != 1:
                opt.step()
            opt.zero_grad()
            dumper.step()
    dump = tracer.open_dump(tmp_path)
    assert dump.steps(0) == [0, 1, 2]
    for step in dump.steps(0):
        s = dump.stats(0, step)
        s = s[s.phase == "optimizer"]
        by = {d: set(s[s.direction == d].module) for d in ("param", "grad", "update")}
        if step == 1:  # no optimizer step, and zero_grad ran before the step ended
            assert by == {"param": {"fc", "low", "frozen", "<root>"}, "grad": {"<root>"},
                          "update": set()}
        else:
            assert by == {"param": {"fc", "low"}, "grad": {"fc", "low"},
                          "update": {"fc", "low"}}, step
    updates = pd.concat([dump.stats(0, s) for s in (0, 2)])
    updates = updates[updates.direction == "update"]
    assert {"bfloat16", "float32"} <= set(updates.dtype)


class _Factories(nn.Module):
    """Factory calls in forward: the tensors the model gets back must be the ones torch made."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        buf = torch.empty(2, 8)
        buf.fill_(0.5)
        return self.fc(x * torch.arange(8, dtype=x.dtype)) + buf.sum()


@pytest.mark.parametrize("level", ["op", "mix"])
def test_the_op_mode_hands_the_model_the_tensors_torch_made(tmp_path, level):
    """A dispatch mode that keeps an op's output alive past its return makes torch hand the
    caller a detached alias: an `aten.detach` the plain run never dispatches (seen by the
    profiler and by every other mode). The op mode remembers uninitialised outputs by their
    storage instead, so the run dispatches exactly the ops it does without Sleuth."""
    def detaches(dumped: bool) -> int:
        torch.manual_seed(0)
        model = _Factories()
        dumper = tracer.Dumper(model, {"path": str(tmp_path / level), "level": level,
                                       "writer": "sync", "overwrite": True}) if dumped else None
        with torch.no_grad(), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(torch.randn(2, 8))
        if dumper is not None:
            dumper.close()
        return sum(e.count for e in prof.key_averages() if e.key == "aten::detach")

    assert detaches(True) == detaches(False) == 0
