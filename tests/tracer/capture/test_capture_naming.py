"""Record names, call counters and user source lines (pure helpers of the capture side)."""
from __future__ import annotations

import torch
import torch.nn as nn

from tracer.capture._naming import CallCounter, module_names, op_name, op_scope, record_name
from tracer.capture._source import user_source


def test_record_name_format():
    assert record_name("layers.0.attn", "forward", 0, "output", 0) == \
        "layers.0.attn.forward.0.output.0"
    assert record_name(op_scope("layers.0.attn", "aten.mm"), "forward", 2, "input", 1) == \
        "layers.0.attn::aten.mm.forward.2.input.1"
    assert record_name("layers.0.attn.qkv.weight", "optimizer", 0, "grad", 0) == \
        "layers.0.attn.qkv.weight.optimizer.0.grad.0"


def test_op_name_is_the_overload_packet():
    assert op_name(torch.ops.aten.mm.default) == "aten.mm"
    assert op_name(torch.ops.aten.add.Tensor) == "aten.add"
    assert op_name(torch.ops.aten.add_.Tensor) == "aten.add_"


def test_module_names_root_and_shared_modules():
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    names = module_names(model)
    assert names[model] == "<root>" and names[shared] == "0" and len(names) == 3
    assert module_names(model, "<root1>")[shared] == "<root1>.0"


def test_call_counter_counts_per_scope_and_phase():
    c = CallCounter()
    assert [c.next("fc", "forward"), c.next("fc", "forward"), c.next("fc", "backward")] == [0, 1, 0]
    assert c.peek("fc", "forward") == 2
    c.reset()
    assert c.next("fc", "forward") == 0


def helper_inside_user_code():
    return user_source(1)


def test_user_source_points_at_this_file_relative_to_cwd(monkeypatch, tmp_path):
    src = helper_inside_user_code()
    path, line = src.rsplit(":", 1)
    assert path.endswith("test_capture_naming.py") and int(line) > 0
    # frames inside torch are skipped: a module's forward called through nn.Module.__call__
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(user_source(1))
            return x

    Probe()(torch.zeros(1))  # PROBE LINE
    with open(__file__) as f:
        lines = f.read().splitlines()
    assert "seen.append" in lines[int(seen[0].rsplit(":", 1)[1]) - 1]


# -- names from the call: a module object called from several places ----------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """A function that a hub-kernel wrapper turns into a module object (transformers does this to
    `apply_rotary_pos_emb` with the `kernels` package installed)."""
    return x * 2.0 + 1.0


def _func_module(fn):
    class Func(nn.Module):  # made inside a function, as kernels' `_create_func_module` does
        def forward(self, *args):
            return fn(*args)

    return Func()


ROTATE = _func_module(rotate_half)  # one object that every layer calls


class Rope(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin()


class Layer(nn.Module):
    def __init__(self, rope: Rope, norm: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = norm  # one object registered in every layer (a shared submodule)
        object.__setattr__(self, "rope", rope)  # held, not registered: called across the tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(ROTATE(self.rope(self.fc(x))))


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rope = Rope()
        norm = nn.LayerNorm(4)
        self.layers = nn.ModuleList(Layer(self.rope, norm) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _op_scopes(path) -> set[str]:
    import tracer

    names = tracer.open_dump(path).stats()["name"].tolist()
    return {n.split("::")[0] for n in names if "::" in n}


def test_a_module_called_from_several_places_is_named_under_each_caller(tmp_path):
    import tracer

    torch.manual_seed(0)
    model = Shared()
    for given in (model, None):  # with the model named up front, and attached to what runs
        path = tmp_path / ("given" if given is not None else "found")
        with tracer.Dumper(given, {"path": str(path), "level": "mix", "mode": "statistics"}):
            model(torch.randn(2, 4)).sum().backward()
        scopes = _op_scopes(path)
        for i in (0, 1):
            # the wrapper every layer calls, named after the function it runs, under each layer
            assert f"layers.{i}.<rotate_half>" in scopes
            # a module of the tree called by a module that does not own it
            assert f"layers.{i}.<rope>" in scopes
            # one object registered in both layers: each layer's own path
            assert f"layers.{i}.norm" in scopes
        assert not any("Func" in s for s in scopes) and "rope" not in scopes


def test_call_names_rule():
    from tracer.capture._naming import CallNames, scope_label

    model = Shared()
    names = CallNames()
    names.add_root(model)
    layer1 = model.layers[1]
    assert names.name(model, None) == "<root>"
    assert names.name(layer1, (model, "<root>")) == "layers.1"
    assert names.name(model.rope, (model, "<root>")) == "rope"
    assert names.name(model.rope, (layer1, "layers.1")) == "layers.1.<rope>"
    assert names.name(layer1.norm, (layer1, "layers.1")) == "layers.1.norm"
    assert names.name(ROTATE, (layer1, "layers.1")) == "layers.1.<rotate_half>"
    # the wrapper's per-model copy, called from the wrapper: no scope of its own
    assert names.name(_func_module(rotate_half), (ROTATE, "layers.1.<rotate_half>")) is None
    assert names.name(nn.ReLU(), None) is None  # of no tree, called from no module
    assert scope_label(nn.ReLU()) == "ReLU"


def test_the_profiler_and_the_ir_name_a_call_as_the_dump_does(tmp_path):
    import tracer
    from irdump._capture_dispatch import capture_dispatch
    from profiler._modules import ModuleRanges

    torch.manual_seed(0)
    model = Shared()
    x = torch.randn(2, 4)
    with tracer.Dumper(model, {"path": str(tmp_path / "d"), "level": "op", "phases": "forward",
                               "mode": "statistics"}):
        model(x)
    dumped = _op_scopes(tmp_path / "d")
    capture, _ = capture_dispatch(model, (x,), {})
    assert {n.module for n in capture.graph.nodes if "::" in n.name} == dumped
    ranges = ModuleRanges()
    ranges.install()
    try:
        model(x)
    finally:
        ranges.remove()
    assert {"layers.0.<rotate_half>", "layers.1.<rotate_half>", "layers.1.<rope>",
            "layers.1.norm"} <= set(ranges.types)
    assert dumped <= set(ranges.types)


def test_a_stock_llama_names_every_layers_ops_under_that_layer(tmp_path):
    """transformers wraps `apply_rotary_pos_emb` in one module object that every decoder layer
    calls (with the `kernels` package); each layer's rotary ops are that layer's."""
    import logging

    import pytest

    transformers = pytest.importorskip("transformers")
    import tracer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with tracer.Dumper(None, {"path": str(tmp_path), "level": "op", "mode": "statistics"}):
        model(input_ids=ids, labels=ids).loss.backward()
    scopes = _op_scopes(tmp_path)
    assert not any("<Func>" in s or "<locals>" in s for s in scopes)
    for i in (0, 1):
        # the rotary multiply of each layer, under that layer whatever wraps it
        rotary = {s for s in scopes if s.startswith(f"model.layers.{i}.self_attn")
                  and "proj" not in s}
        assert rotary, scopes
    assert not any(s.startswith("model.layers.0") and "layers.1" in s for s in scopes)
