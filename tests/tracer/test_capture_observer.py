"""The op level through torch's C++ op callbacks (`"op_capture": "observer"`) against the
Python dispatch mode, on the models we did not write, and its own rules."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import tracer
from models import MLP, observer_built, stranger_models, train_and_dump
from tracer._errors import ConfigError

pytestmark = pytest.mark.skipif(not observer_built(),
                                reason="tracer._observer is not built here")
MODELS = stranger_models()
# records whose names may differ between the captures (see _known_differences): the backward
# of an in-place ReLU, and a reshape in backward (`view` under a dispatch mode)
_ALLOWED = ("::aten.threshold_backward.", "::aten._reshape_alias.", "::aten.view.backward.")


def _known_differences(df):
    """The records in which the two captures differ by design (docs/tracer.md, "op_capture"),
    taken out or spelled the same.

    - `aten.detach`: autograd detaches a gradient (AccumulateGrad) or a saved output when
      something else holds a reference to it, and the dispatch mode holds references: the
      two captures see different detach calls.
    - `aten.add_` for `aten.add`: a gradient summed in place (autograd's input buffer) or a
      bias added in place (`linear` on 3-d inputs) when nothing else refers to the tensor,
      which under a dispatch mode torch does out of place.
    - `aten._reshape_alias` for `aten.view`: `reshape` of a tensor it can view, which under a
      dispatch mode torch spells as `view` (a different op, so its calls count apart).
    - the backward of an in-place op is scoped to the module that ran it by the observer (the
      module whose forward made its autograd node); the dispatch mode's graph walk stops at
      the module's own input, which the in-place op turned into its output, and gives it to
      the caller.
    The last two change names; the test allows those (`_ALLOWED`)."""
    df = df[~df.name.str.contains("::aten.detach.")]
    df = df.assign(name=df.name.str.replace("::aten.add_.", "::aten.add.", regex=False),
                   op=df.op.replace("aten.add_", "aten.add"))
    return df


@pytest.mark.parametrize("index", range(len(MODELS)), ids=[m[0] for m in MODELS])
def test_observer_writes_the_records_the_dispatch_mode_writes(tmp_path, index):
    """Mix level, statistics, two steps: the same record names in the same order, and the same
    statistics, dtype, shape and source line for each, apart from the known differences."""
    _, model_fn, batch_fn = MODELS[index]
    cfg = {"level": "mix", "mode": "statistics", "writer": "sync"}
    a = train_and_dump(model_fn, batch_fn, tmp_path / "a", steps=2, **cfg).stats(0, 1)
    b = train_and_dump(model_fn, batch_fn, tmp_path / "b", steps=2, op_capture="observer",
                       **cfg).stats(0, 1)
    a, b = _known_differences(a), _known_differences(b)
    only = set(a.name) ^ set(b.name)
    assert all(any(k in n for k in _ALLOWED) for n in only), sorted(only)[:6]
    common = [n for n in a.name if n in set(b.name)]
    assert len(common) > 0.9 * len(a)
    assert [n for n in b.name if n in set(common)] == common  # the same order
    a, b = a.set_index("name").loc[common], b.set_index("name").loc[common]
    for column in ("module", "op", "phase", "direction", "index", "call", "dtype", "shape",
                   "numel", "nan", "posinf", "neginf", "zeros", "checksum", "source"):
        assert list(a[column]) == list(b[column]), column
    for column in ("min", "max", "mean", "norm"):
        np.testing.assert_allclose(a[column], b[column], rtol=1e-6, atol=1e-9, err_msg=column)


@pytest.mark.parametrize("writer", ["sync", "async"])
@pytest.mark.parametrize("index", [0, 1, 3], ids=["causal_lm", "cnn", "lstm"])
def test_observer_tensors_are_bit_exact(tmp_path, writer, index):
    """Mode tensor: every tensor both captures stored reads back with the same bits, views and
    slices included (the observer stores them as the span of bytes they read, or inside the
    bytes of the tensor they view)."""
    _, model_fn, batch_fn = MODELS[index]
    cfg = {"level": "op", "mode": "tensor", "writer": writer}
    da = train_and_dump(model_fn, batch_fn, tmp_path / "a", steps=2, **cfg)
    db = train_and_dump(model_fn, batch_fn, tmp_path / "b", steps=2, op_capture="observer",
                        **cfg)
    a, b = da.stats(0, 1), db.stats(0, 1)
    common = sorted((set(a.name) & set(b.name)) - {n for n in a.name if "aten.detach" in n})
    assert len(common) > 50
    for name in common:
        x, y = da.tensor_torch(0, 1, name), db.tensor_torch(0, 1, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name
    # views point into the bytes of what they view rather than copying them
    assert _tensor_bytes(db.path(0, 1)) <= 1.25 * _tensor_bytes(da.path(0, 1))


def _tensor_bytes(path) -> int:
    import h5py

    with h5py.File(path, "r") as f:
        return int(f["tensors"].shape[0]) if "tensors" in f else 0


def test_observer_rows_keep_execution_order_with_module_records(tmp_path):
    """Mix level: a module's output record comes after the records of the ops it ran, and its
    input record before them (rows of both captures numbered in one sequence)."""
    d = train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path, steps=1, level="mix",
                       op_capture="observer", writer="sync").stats(0, 0)
    seq = dict(zip(d.name, d.seq))
    assert sorted(d.seq) == list(range(len(d)))
    ops = [s for n, s in seq.items() if n.startswith("fc1::") and ".forward." in n]
    assert ops
    assert seq["fc1.forward.0.input.0"] < min(ops) and max(ops) < seq["fc1.forward.0.output.0"]


def test_observer_applies_filters_and_directions(tmp_path):
    d = train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path, steps=1, level="op",
                       op_capture="observer", ops=["aten.addmm", "aten.mm"],
                       exclude_modules=["fc2"], io="output", phases="backward")
    s = d.stats(0, 0)
    s = s[s.phase != "optimizer"]
    assert len(s) and set(s.op) == {"aten.mm"}  # addmm runs in forward only
    assert set(s.direction) == {"output"} and set(s.phase) == {"backward"}
    assert not s.module.str.startswith("fc2").any()


def test_observer_diff_names_the_first_divergence(tmp_path):
    """Two runs that differ in one weight: the diff of their observer dumps points at the first
    op that reads it."""
    def run(path, bump):
        torch.manual_seed(0)
        model = MLP()
        if bump:
            with torch.no_grad():
                model.fc2.weight[0, 0] += 1.0
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        with tracer.Dumper(model, {"path": str(path), "level": "op", "mode": "tensor",
                                   "op_capture": "observer", "params": False}):
            model(x).pow(2).mean().backward()

    run(tmp_path / "a", False)
    run(tmp_path / "b", True)
    result = tracer.diff(tmp_path / "a", tmp_path / "b", step=0)
    assert result.status == "diverged"
    first = result.first_divergence
    assert first["module"] == "fc2" and first["phase"] == "forward", first


def test_observer_reports_watchpoint_hits(tmp_path):
    """A NaN in an op's output: the watchpoint sees the observer's row and stops the run."""
    model = MLP()
    x = torch.randn(2, 8)
    x[0, 0] = float("nan")
    with pytest.raises(tracer.TracerError, match="fc1"):
        with tracer.Dumper(model, {"path": str(tmp_path), "writer": "sync", "level": "op",
                                   "op_capture": "observer",
                                   "watch": [{"condition": "nan_inf", "on_hit": "raise",
                                              "names": ["fc1::*"]}]}):
            model(x)


def test_observer_leaves_float64_to_the_python_writer(tmp_path):
    """Tensors the statistics kernel does not read (float64 here) are copied when the op runs
    and measured by the writer: their statistics match the dispatch capture's."""
    def run(path, capture):
        torch.manual_seed(0)
        model = nn.Linear(3, 2).double()
        with tracer.Dumper(model, {"path": str(path), "level": "op", "op_capture": capture,
                                   "params": False}):
            y = model(torch.randn(4, 3, dtype=torch.float64))
            y.mul_(2).sum().backward()
        return tracer.open_dump(path).stats(0, 0)

    a, b = run(tmp_path / "a", "dispatch"), run(tmp_path / "b", "observer")
    a, b = _known_differences(a), _known_differences(b)
    assert list(a.name) == list(b.name) and (b.dtype == "float64").any()
    np.testing.assert_allclose(a["norm"], b["norm"], rtol=1e-12)


def test_one_observer_at_a_time(tmp_path):
    model = MLP()
    cfg = {"level": "op", "op_capture": "observer"}
    with tracer.Dumper(model, {**cfg, "path": str(tmp_path / "a")}):
        model(torch.randn(2, 8))
        with pytest.raises(ConfigError, match="one Dumper at a time"):
            tracer.Dumper(model, {**cfg, "path": str(tmp_path / "b")})
    with tracer.Dumper(model, {**cfg, "path": str(tmp_path / "c")}):  # the first one closed
        model(torch.randn(2, 8))
    assert tracer.open_dump(tmp_path / "c").stats(0, 0).op.str.startswith("aten.").any()


def test_missing_observer_names_the_fix(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_observer(name, *args, **kwargs):
        if name == "tracer" and args[2] and "_observer" in args[2]:
            raise ImportError("not built")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_observer)
    with pytest.raises(ConfigError, match="build_ext --inplace.*op_capture"):
        tracer.Dumper(MLP(), {"level": "op", "op_capture": "observer"})


def _both(tmp_path, train, **cfg):
    """Stats of step 0 of `train(dumper_config)` with each capture, known differences out."""
    out = []
    for capture in ("dispatch", "observer"):
        path = tmp_path / capture
        train({"path": str(path), "writer": "sync", "level": "op", "op_capture": capture,
               **cfg})
        out.append(_known_differences(tracer.open_dump(path).stats(0, 0)))
    return out


def test_observer_hard_cases_match_the_dispatch_mode(tmp_path):
    """Gradient accumulation (two backward passes), bf16 autocast and a no_grad evaluation in
    one step: the same records and statistics as the dispatch mode."""
    def train(config):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with tracer.Dumper(model, config):
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(torch.randn(2, 8)).float().pow(2).mean().backward()
            with torch.no_grad():
                model(torch.randn(2, 8))
            opt.step()

    a, b = _both(tmp_path, train)
    assert list(a.name) == list(b.name) and (b.dtype == "bfloat16").any()
    assert (b.phase == "backward").any() and b.name.str.contains(r"\.forward\.2\.").any()
    for column in ("checksum", "zeros", "source", "shape"):
        assert list(a[column]) == list(b[column]), column


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")
def test_observer_under_torch_compile_records_the_eager_names(tmp_path):
    """A model compiled with the eager backend (dynamo traces it with fake tensors, which are
    no records) runs its ops through the dispatcher: the records are the plain model's."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(2, 8)
    names = []
    for i, run in enumerate((model, torch.compile(model, backend="eager"))):
        path = tmp_path / str(i)
        with tracer.Dumper(model, {"path": str(path), "level": "op", "op_capture": "observer",
                                   "params": False}):
            run(x).sum().backward()
        model.zero_grad(set_to_none=True)
        names.append(list(tracer.open_dump(path).stats(0, 0).name))
    assert names[0] == names[1] and len(names[0]) > 20


def test_observer_through_the_zero_code_attach(tmp_path):
    """`SLEUTH_DUMP_CONFIG` with "op_capture": "observer" dumps a script nobody edited."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(2):\n"
        "    m(torch.randn(3, 4)).sum().backward()\n"
        "    opt.step()\n")
    config = tmp_path / "dump.json"
    config.write_text(json.dumps({"path": str(tmp_path / "run"), "level": "op",
                                  "op_capture": "observer"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env.update({"SLEUTH_DUMP_CONFIG": str(config),
                "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    code = ("import tracer; tracer.attach_from_env(); import runpy; "
            "runpy.run_path('train.py', run_name='__main__')")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path,
                   timeout=120)
    s = tracer.open_dump(tmp_path / "run").stats(0, 1)
    assert s.name.str.contains("::aten.addmm.forward.0.output.0").any()
    assert (s.source.str.startswith("train.py:") | (s.phase == "optimizer")).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["full", "statistics"])
@pytest.mark.parametrize("level", ["op", "module"])
@pytest.mark.parametrize("writer", ["sync", "async"])
def test_observer_on_cuda_matches_the_dispatch_mode(tmp_path, writer, level, mode):
    """CUDA tensors take the observer's copy path (copied when the op runs, measured and stored
    by the writer's device path at the next drain): the same records, statistics and bytes as
    the dispatch mode's. With statistics only, the gradients come from the C++ gradient hooks
    and the parameter records from the compiled parameter path, whose CUDA tensors take the
    same copy path (the pre-step copies made by Python)."""
    def train(config):
        torch.manual_seed(0)
        model = MLP().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with tracer.Dumper(model, config):
            model(torch.randn(4, 8, device="cuda")).pow(2).mean().backward()
            opt.step()

    a, b = _both(tmp_path, train, mode=mode, writer=writer, level=level)
    assert list(a.name) == list(b.name) and len(a) > (20 if level == "op" else 10)
    assert list(a.checksum) == list(b.checksum) and list(a.norm) == list(b.norm)
    assert {"param", "grad", "update"} <= set(b.direction)
    if mode == "statistics":
        return
    da, db = tracer.open_dump(tmp_path / "dispatch"), tracer.open_dump(tmp_path / "observer")
    for name in a.name:
        assert torch.equal(da.tensor_torch(0, 0, name), db.tensor_torch(0, 0, name)), name


def test_the_first_watchpoint_hit_is_the_one_raised(tmp_path):
    """The observer's rows are watched when they are drained (here at the optimizer step),
    after backward made gradients that hit too; closing the Dumper while the first hit
    propagates writes the step but must not replace that hit with a later one."""
    from tracer._errors import WatchpointHit

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"path": str(tmp_path), "level": "op", "op_capture": "observer", "writer": "sync",
           "watch": [{"condition": "nan_inf", "on_hit": "raise"}]}
    with pytest.raises(WatchpointHit, match="aten.sqrt") as e:
        with tracer.Dumper(model, cfg):
            model(torch.randn(2, 4)).sqrt().sum().backward()  # negatives: NaN, then NaN grads
            opt.step()
    assert e.value.hit["name"] == "<none>::aten.sqrt.forward.0.output.0"
    hits = tracer.open_dump(tmp_path).hits(0, 0)
    assert (hits.name == e.value.hit["name"]).any() and len(hits) > 1
