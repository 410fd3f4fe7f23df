"""Inductor's generated kernels under a dump (tracer.capture._inductor_kernels): a dumped
compiled step in tensor mode records each kernel's outputs under the region's module, and
its setup says which graph nodes the kernel fused; a fault injected into one of Inductor's
lowerings is named at its kernel and the ops, modules and lines it fused, while the run
keeps the losses of the undumped compiled run. Inductor compiles are slow: all under `slow`."""
from __future__ import annotations

import contextlib
import inspect
import json
import warnings

import pytest
import torch
from torch import nn

import tracer
from tracer.analysis import diff, explain

from compiled_loop import train_steps

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")]


class Net(nn.Module):
    """Two linears around a GELU and a LayerNorm, which Inductor fuses into one C++ kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n(nn.functional.gelu(self.a(x)))  # the fused kernel's line
        return self.b(h)


@contextlib.contextmanager
def faulty_lowering(op: torch._ops.OpOverload, scale: float = 1.01):
    """Inductor lowers `op` on its input scaled by `scale`: a fault in code generation only,
    the graph unchanged. The lowering comes back on leaving."""
    from torch._inductor import lowering

    original = lowering.lowerings[op]
    mul = lowering.lowerings[torch.ops.aten.mul.Tensor]
    lowering.lowerings[op] = lambda x, *args, **kwargs: original(mul(x, scale), *args, **kwargs)
    try:
        yield
    finally:
        lowering.lowerings[op] = original


def _loop(call, model, run, *, dump=True, steps=2, selected="0", level="module",
          mode="tensor", batch=lambda: (torch.randn(4, 8),)):
    """`steps` AdamW steps of the squared mean of `call(*batch())`, step `selected` dumped;
    the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    dumper = tracer.Dumper(model, {"path": str(run), "level": level, "mode": mode,
                                   "writer": "sync", "steps": selected,
                                   "on_error": "raise"}) if dump else None

    def loss_of():
        out = call(*batch())
        return out if out.dim() == 0 else out.square().mean()

    return train_steps(loss_of, opt, steps, dumper)


def _net(run, *, compiled=True, device="cpu", **kwargs):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net().to(device)
    call = torch.compile(model) if compiled else model
    return _loop(call, model, run, batch=lambda: (torch.randn(4, 8, device=device),), **kwargs)


def _setup(run, step=0) -> dict:
    return json.loads(tracer.open_dump(run).attrs(0, step)["setup"])


def _line_of(text: str) -> int:
    lines, start = inspect.getsourcelines(inspect.getmodule(_line_of))
    return next(i for i, line in enumerate(lines, start or 1) if text in line)


def test_each_kernels_outputs_are_recorded_and_the_run_keeps_its_losses(tmp_path):
    from tracer.capture import _inductor_kernels

    plain = _net(tmp_path / "plain", dump=False, steps=3)
    assert _net(tmp_path / "run", steps=3, selected="1") == plain
    stats = tracer.open_dump(tmp_path / "run").stats(0, 1)
    kernels = stats[stats.op.str.startswith("kernel.")]
    assert set(kernels.phase) == {"forward", "backward"}, set(kernels.phase)
    assert set(kernels.module) == {"<root>"}
    assert all(n.startswith("<root>::kernel.cpp_fused_") for n in kernels.name)
    # in execution order: the forward kernels inside the region's call
    order = list(stats.name)
    first = kernels[kernels.phase == "forward"].name.iloc[0]
    assert order.index("<root>::compiled.forward.0.input.0") < order.index(first) \
        < order.index("<root>::compiled.forward.0.output.0")
    # what a kernel fused: each node's op, module and line
    fused = _setup(tmp_path / "run", 1)["compile"]["kernels"]
    forward = [v for k, v in fused.items() if k.endswith(".forward")]
    assert len(forward) == 1 and "gelu" in forward[0]["kernel"], fused
    nodes = forward[0]["nodes"]
    assert {"aten.erf", "aten.var_mean"} <= {op for op, _, _ in nodes}, nodes
    assert {m for _, m, _ in nodes} == {"<root>", "n"}, nodes
    line = _line_of("the fused kernel's line")
    assert {s for _, _, s in nodes} == {f"tests/tracer/capture/test_capture_inductor_kernels.py:"
                                        f"{line}"}, nodes
    # steps not dumped run the kernels as Inductor made them
    assert not _inductor_kernels._swapped
    for generated in _inductor_kernels._generated:
        module = generated.module()
        if module is not None:
            assert not any(isinstance(module.__dict__.get(k), _inductor_kernels._Recorded)
                           for k in generated.kernels)


def test_a_fault_in_an_inductor_lowering_is_named_at_its_kernel_and_the_ops_it_fused(
        tmp_path):
    _net(tmp_path / "a")
    with faulty_lowering(torch.ops.aten.erf.default):
        _net(tmp_path / "b")
    res = diff(tmp_path / "a", tmp_path / "b")
    fd = res.first_divergence
    assert res.status == "diverged" and fd["op"].startswith("kernel.cpp_fused_"), fd
    assert fd["phase"] == "forward" and fd["module"] == "<root>"
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "bug" and e.blamed["fault"] == "kernel", e.verdict
    assert "gelu" in e.blamed["kernel"] and e.blamed["kernel"] in e.verdict
    ops = {op for op, _, _ in e.blamed["fused"]}
    assert "aten.erf" in ops, e.blamed["fused"]
    assert "aten.erf" in e.verdict and "in <root> at " in e.verdict, e.verdict
    assert e.blamed["source"].endswith(f":{_line_of('the fused kernel')}"), e.blamed


def test_compiled_against_eager_with_kernels_recorded_is_not_a_bug(tmp_path):
    # the kernels' records have no partner in the eager run: nothing to call a bug
    _net(tmp_path / "eager", compiled=False, level="mix")
    _net(tmp_path / "compiled", level="mix")
    res = diff(tmp_path / "eager", tmp_path / "compiled", step=0)
    assert res.status == "same", (res.first_divergence, res.notes)
    assert explain(tmp_path / "eager", tmp_path / "compiled", step=0).status == "same"


def _llama(run):
    """A forward of a one-layer Hugging Face Llama built from a config, its decoder layer
    compiled in place (as torchtitan compiles each block), dumped without gradients: Inductor
    compiles that layer's forward graph alone, which keeps the test quick."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager"))
    model.model.layers[0].compile()
    dumper = tracer.Dumper(model, {"path": str(run), "level": "module", "mode": "tensor",
                                   "writer": "sync", "steps": "0", "on_error": "raise"})
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings(record=True), torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids=ids)
        dumper.close()


def test_a_hugging_face_llamas_lowering_fault_is_named_at_its_kernel(tmp_path):
    # RMSNorm's rsqrt, lowered wrong: the first kernel that computes it is named, with the
    # norm's module and its line in transformers
    _llama(tmp_path / "a")
    with faulty_lowering(torch.ops.aten.rsqrt.default):
        _llama(tmp_path / "b")
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "bug" and e.blamed["fault"] == "kernel", e.verdict
    fused = e.blamed["fused"]
    rsqrt = [(m, s) for op, m, s in fused if op == "aten.rsqrt"]
    assert rsqrt and rsqrt[0][0] == "model.layers.0.input_layernorm", fused
    assert "models/llama/modeling_llama.py:" in rsqrt[0][1], fused


def test_a_torch_without_the_kernel_call_records_regions_and_says_so_once(tmp_path,
                                                                         monkeypatch):
    from tracer import SleuthWarning
    from tracer.capture import _inductor_kernels

    monkeypatch.setattr(_inductor_kernels, "_patched", False)
    monkeypatch.setattr(_inductor_kernels, "_unsupported", "no per-kernel provenance call")
    monkeypatch.setattr(_inductor_kernels, "_told", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for run in ("a", "b"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = Net()
            call = torch.compile(model, backend="aot_eager")
            dumper = tracer.Dumper(model, {"path": str(tmp_path / run), "mode": "tensor",
                                           "writer": "sync", "steps": "0",
                                           "on_error": "raise"})
            call(torch.randn(4, 8)).sum().backward()
            dumper.close()
    said = [str(w.message) for w in seen if issubclass(w.category, SleuthWarning)
            and "kernels are not recorded" in str(w.message)]
    assert len(said) == 1, said
    names = set(tracer.open_dump(tmp_path / "a").stats(0, 0).name)
    assert "<root>::compiled.forward.0.output.0" in names


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_are_recorded_and_a_lowering_fault_named_on_a_gpu(tmp_path):
    plain = _net(tmp_path / "plain", dump=False, device="cuda")
    assert _net(tmp_path / "a", device="cuda") == plain
    stats = tracer.open_dump(tmp_path / "a").stats(0, 0)
    kernels = stats[stats.op.str.startswith("kernel.triton_")]
    assert set(kernels.phase) == {"forward", "backward"}, set(stats.op)
    with faulty_lowering(torch.ops.aten.erf.default):
        _net(tmp_path / "b", device="cuda")
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "bug" and e.blamed["fault"] == "kernel", e.verdict
    assert "aten.erf" in {op for op, _, _ in e.blamed["fused"]}, e.blamed
