"""torch.compile under a dump, compiled: a dumped step runs the code an undumped step runs, and
records each compiled region's inputs, outputs and gradients under the module whose forward it
compiles, so a fault only the compiled code has is seen, where running the step eagerly says
"same". The quick lane uses the aot_eager backend (AOTAutograd's graphs run by torch's own
kernels); Inductor runs under `slow`."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tracer
from tracer.analysis import diff, explain

from compiled_loop import train_steps

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")


class Net(nn.Module):
    """LayerNorm between two linears; `fault` scales the normalised activations only where the
    code runs compiled (a branch on torch.compiler.is_compiling(): a compile-only bug), and
    `break_graph` breaks the graph between the two halves."""

    def __init__(self, fault: bool = False, break_graph: bool = False) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1)
        self.fault, self.break_graph = fault, break_graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n(nn.functional.gelu(self.a(x)))
        if self.fault and torch.compiler.is_compiling():
            h = h * 1.1
        if self.break_graph:
            torch._dynamo.graph_break()
        return self.b(h)


def _train(run, *, dump=True, backend="aot_eager", how="module", steps=3, level="module",
           selected="0|2", compiled="compiled", mode="statistics", **net):
    """A plain loop over a compiled Net (`how`: torch.compile(model), model.compile(), or a
    compiled training function); returns (losses, counters of graphs and breaks, weights)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net(**net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if how == "module":
        call = torch.compile(model, backend=backend)
    elif how == "method":
        model.compile(backend=backend)
        call = model
    else:
        call = model
    loss_of = torch.compile(lambda x: call(x).square().mean(), backend=backend) \
        if how == "function" else (lambda x: call(x).square().mean())
    dumper = tracer.Dumper(model, {"path": str(run), "level": level, "writer": "sync",
                                   "steps": selected, "on_error": "raise",
                                   "compiled": compiled, "mode": mode}) if dump else None
    losses = train_steps(lambda: loss_of(torch.randn(4, 8)), opt, steps, dumper)
    seen = {"graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values())}
    return losses, seen, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_a_dumped_step_runs_compiled_and_records_the_region(tmp_path):
    plain, seen_plain, w_plain = _train(tmp_path / "plain", dump=False)
    losses, seen, weights = _train(tmp_path / "run")
    # the dump changed nothing of the run: same graphs, no break of its own, same numbers
    assert losses == plain and seen == seen_plain and seen["breaks"] == 0
    assert all(torch.equal(weights[k], w_plain[k]) for k in w_plain)
    stats = tracer.open_dump(tmp_path / "run").stats(0, 2)
    names = list(stats.name)
    for name in ("<root>::compiled.forward.0.input.0", "<root>::compiled.forward.0.output.0",
                 "<root>::compiled.backward.0.output.0", "<root>.forward.0.output.0"):
        assert name in names, name
    # the modules inside the region never ran as Python, so they have no records of their own
    assert not any(n.startswith(("a.", "n.", "b.")) and ".optimizer." not in n for n in names)
    row = stats[stats.name == "<root>::compiled.forward.0.output.0"].iloc[0]
    assert (row.module, row.op, row.phase) == ("<root>", "compiled", "forward")


@pytest.mark.slow
def test_a_fault_only_the_compiled_code_has_is_named_at_its_region(tmp_path):
    _train(tmp_path / "a")
    _train(tmp_path / "b", fault=True)
    res = diff(tmp_path / "a", tmp_path / "b")
    fd = res.first_divergence
    assert res.status == "diverged" and fd["name"] == "<root>::compiled.forward.0.output.0"
    assert fd["step"] == 0 and fd["module"] == "<root>" and fd["op"] == "compiled"
    # run eagerly, the dumped step cannot see it: the fault lives in the compiled code only
    _train(tmp_path / "ea", compiled="eager")
    _train(tmp_path / "eb", compiled="eager", fault=True)
    eager = diff(tmp_path / "ea", tmp_path / "eb", step=0)
    assert eager.status == "same"


@pytest.mark.slow
def test_the_setup_says_how_each_side_ran_compiled_code(tmp_path):
    _train(tmp_path / "a")
    _train(tmp_path / "b", compiled="eager")
    res = diff(tmp_path / "a", tmp_path / "b", step=0)
    setup = [c for c in res.changes if c["kind"] == "setup"]
    texts = [d["text"] for c in setup for d in c["differences"]]
    assert any("as compiled in A, eagerly in B" in t for t in texts), texts


@pytest.mark.slow
def test_graphs_compiled_before_the_dump_attached_are_said_once(tmp_path, monkeypatch):
    from tracer import SleuthWarning
    from tracer.capture import _regions

    monkeypatch.setattr(_regions, "_told_unwatched", False)
    torch._dynamo.reset()
    model = Net()
    call = torch.compile(model, backend="aot_eager")
    call(torch.randn(4, 8))  # compiled while no Dumper listened
    monkeypatch.setattr(_regions, "compiled_before", ["1 graph(s)"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for run in ("a", "b"):
            tracer.Dumper(model, {"path": str(tmp_path / run), "writer": "sync"}).close()
    said = [str(w.message) for w in seen if issubclass(w.category, SleuthWarning)
            and "before the dump attached" in str(w.message)]
    assert len(said) == 1, said


@pytest.mark.slow
def test_an_eager_run_against_its_compiled_run_is_same_not_two_codebases(tmp_path):
    # the compiled run's modules inside the region have no records of their own, so most
    # records of each side find no partner; that is how the two ran, not two codebases
    _train(tmp_path / "eager", how="none", level="op")
    _train(tmp_path / "compiled", level="op")
    res = diff(tmp_path / "eager", tmp_path / "compiled", step=0)
    counts = res.counts()
    assert counts["same"] + counts["diverged"] < min(counts["only_a"], counts["only_b"]), counts
    assert res.status == "same", res.notes
    assert "only B ran torch.compile'd code" in res.notes[0]
    assert "\"compiled\": \"interpret\"" in res.notes[0]
    assert explain(tmp_path / "eager", tmp_path / "compiled", step=0).status == "same"
    # an eager run that never called a compiled wrapper keeps no compile section, though
    # torch.compile is loaded in its process
    setups = [c for c in res.changes if c["kind"] == "setup"]
    assert [d["key"] for c in setups for d in c["differences"]] == ["compiled"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["method", "function"])
def test_module_compile_and_compiled_functions_are_regions_too(tmp_path, how):
    plain, seen_plain, _ = _train(tmp_path / "plain", dump=False, how=how)
    losses, seen, _ = _train(tmp_path / "run", how=how)
    assert losses == plain and seen == seen_plain
    names = set(tracer.open_dump(tmp_path / "run").stats(0, 0).name)
    regions = {n.split(".forward.")[0] for n in names if "::compiled" in n and ".forward." in n}
    assert regions, names
    if how == "method":
        # Module.compile() compiles the module's own call: named by that module
        assert any(r.startswith("<root>::compiled") for r in regions), regions


@pytest.mark.slow
def test_a_graph_break_makes_two_regions_and_the_dump_adds_none(tmp_path):
    plain, seen_plain, _ = _train(tmp_path / "plain", dump=False, break_graph=True)
    losses, seen, _ = _train(tmp_path / "run", break_graph=True)
    assert losses == plain and seen == seen_plain and seen["breaks"] >= 1
    stats = tracer.open_dump(tmp_path / "run").stats(0, 0)
    outputs = [n for n in stats.name if "::compiled" in n and ".forward." in n
               and ".output." in n]
    regions = {n.split(".forward.")[0] for n in outputs}
    # the code after the break is dynamo's resume function, named by the line it resumes at
    assert "<root>::compiled" in regions and any(
        r.startswith("<root>::compiled.torch_dynamo_resume_in_forward_at_") for r in regions), \
        regions


@pytest.mark.slow
def test_op_level_records_the_ops_the_compiled_code_dispatches(tmp_path):
    plain, _, _ = _train(tmp_path / "plain", dump=False)
    losses, seen, _ = _train(tmp_path / "run", level="mix")
    assert losses == plain and seen["breaks"] == 0
    stats = tracer.open_dump(tmp_path / "run").stats(0, 0)
    ops = stats[(stats.module == "<root>") & stats.op.str.startswith("aten.")]
    assert {"aten.addmm", "aten.native_layer_norm"} <= set(ops.op), set(ops.op)
    assert set(ops.phase) == {"forward", "backward"}


@pytest.mark.slow
def test_inductor_steps_dumped_compiled_keep_the_runs_losses(tmp_path):
    plain, seen_plain, w_plain = _train(tmp_path / "plain", dump=False, backend="inductor",
                                        level="mix")
    losses, seen, weights = _train(tmp_path / "run", backend="inductor", level="mix")
    assert losses == plain and seen == seen_plain
    assert all(torch.equal(weights[k], w_plain[k]) for k in w_plain)
    stats = tracer.open_dump(tmp_path / "run").stats(0, 0)
    # Inductor's external calls (the matrix products), scoped to the compiled module; the
    # fused kernels around them are no ops the mode sees
    externals = set(stats[stats.module == "<root>"].op)
    assert "aten.addmm" in externals or "aten.mm" in externals, externals
    assert "<root>::compiled.forward.0.output.0" in set(stats.name)
    _train(tmp_path / "bstatistics", backend="inductor", fault=True, level="mix")
    for run, fault in (("btensor", True), ("atensor", False)):
        _train(tmp_path / run, backend="inductor", fault=fault, level="mix", mode="tensor")
    fd = diff(tmp_path / "run", tmp_path / "bstatistics").first_divergence
    assert fd["module"] == "<root>" and fd["phase"] == "forward", fd
    # in statistics mode Inductor's fused kernels are not recorded, and what they made has
    # no maker among the records: the region is named, and how to see inside it, never
    # "inputs differ"
    e = explain(tmp_path / "run", tmp_path / "bstatistics")
    assert "compiled region <root>::compiled.forward.0" in e.verdict, e.verdict
    assert "inputs differ" not in e.verdict, e.verdict
    # in tensor mode each kernel's outputs are records, and the setup says what each fused:
    # B's kernel fuses the compile-only op, named at its line
    e = explain(tmp_path / "atensor", tmp_path / "btensor")
    assert e.status == "bug" and e.blamed["op"] == "aten.mul", e.verdict
    assert e.blamed["source"].endswith(f":{_line_of('h = h * 1.1')}"), e.verdict


@pytest.mark.slow
def test_interpret_mode_names_a_compile_only_fault_at_its_op_and_line(tmp_path):
    from tracer.analysis import explain

    plain, _, _ = _train(tmp_path / "plain", dump=False)
    losses, _, _ = _train(tmp_path / "a", level="mix", compiled="interpret", mode="tensor")
    assert losses == plain  # aot_eager: the interpreted graphs compute what the backend does
    _train(tmp_path / "b", level="mix", compiled="interpret", mode="tensor", fault=True)
    stats = tracer.open_dump(tmp_path / "a").stats(0, 0)
    # the graph's nodes under the modules that made them, at their lines, in both passes
    names = set(stats.name)
    assert {"a::aten.addmm.forward.0.output.0", "n::aten.native_layer_norm.forward.0.output.0",
            "b::aten.mm.backward.0.output.0"} <= names
    line = stats[stats.name == "b::aten.addmm.forward.0.output.0"].source.iloc[0]
    assert line.endswith(f"test_capture_compiled_regions.py:{_line_of('return self.b(h)')}")
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "bug" and e.blamed["fault"] == "added", e.verdict
    assert e.blamed["op"] == "aten.mul" and e.blamed["module"] == "<root>"
    assert e.blamed["source"].endswith(f":{_line_of('h = h * 1.1')}")


@pytest.mark.slow
def test_interpret_mode_names_a_fault_before_a_graph_break(tmp_path):
    # the first region's output is the first record that differs (the second region's ops
    # come after it): it is judged by the ops inside it, never re-run as one call
    from tracer.analysis import explain

    for run, fault in (("a", False), ("b", True)):
        _train(tmp_path / run, level="mix", compiled="interpret", mode="tensor",
               break_graph=True, fault=fault)
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.first_divergence["name"] == "<root>::compiled.forward.0.output.0"
    assert e.status == "bug" and e.blamed["fault"] == "added", e.verdict
    assert e.blamed["op"] == "aten.mul" and e.blamed["phase"] == "forward"
    assert e.blamed["source"].endswith(f":{_line_of('h = h * 1.1')}")


_MODEL: nn.Module | None = None


@torch.compile(backend="aot_eager")
def _global_step(x: torch.Tensor) -> torch.Tensor:
    return _MODEL(x).square().mean()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["global", "patched"])
def test_interpret_mode_names_modules_reached_through_globals(tmp_path, how):
    # dynamo's module paths start at the frame's globals too: a step function that reaches
    # the model as a global, a forward replaced by a function that calls the saved original
    # (its submodules' paths run through that global's __self__)
    global _MODEL, _SAVED_FORWARD
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _MODEL = Net()
    if how == "patched":
        _SAVED_FORWARD = model.forward
        model.forward = _patched
    call = _global_step if how == "global" else \
        (lambda x, c=torch.compile(model, backend="aot_eager"): c(x).square().mean())
    dumper = tracer.Dumper(model, {"path": str(tmp_path), "level": "op", "writer": "sync",
                                   "steps": "0", "on_error": "raise", "compiled": "interpret"})
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        call(torch.randn(4, 8)).backward()
        dumper.close()
    stats = tracer.open_dump(tmp_path).stats(0, 0)
    modules = set(stats[stats.op == "aten.addmm"].module)
    assert modules == {"a", "b"}, modules
    assert "n" in set(stats[stats.op == "aten.native_layer_norm"].module)


_SAVED_FORWARD = None


def _patched(x: torch.Tensor) -> torch.Tensor:
    return _SAVED_FORWARD(x)


_CONFIG = {"temperature": 1.0}


@torch._dynamo.assume_constant_result
def _temperature() -> float:
    return _CONFIG["temperature"]


class Tempered(nn.Module):
    """Logits divided by a temperature read through a function dynamo takes as constant: the
    graph keeps the value it was traced with, and no guard notices a change."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(h) / _temperature()


def _tempered(run, temperatures, compiled, reset_between=False, level="mix"):
    """Three steps whose temperature the loop changes as it goes; `reset_between` recompiles
    at each change (what a guard on the value would do)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Tempered()
    call = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dumper = tracer.Dumper(model, {"path": str(run), "level": level, "mode": "tensor",
                                   "writer": "sync", "steps": "2", "on_error": "raise",
                                   "compiled": compiled})
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for t in temperatures:
            if reset_between and t != _CONFIG["temperature"]:
                torch._dynamo.reset()
            _CONFIG["temperature"] = t
            call(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        dumper.close()
    _CONFIG["temperature"] = 1.0


@pytest.mark.slow
@pytest.mark.parametrize("compiled", ["compiled", "interpret"])
def test_a_constant_baked_in_at_trace_time_is_named(tmp_path, compiled):
    # A recompiles when the temperature changes; B keeps the graph traced with the first one.
    # At module level the compiled mode sees regions only
    level = "module" if compiled == "compiled" else "mix"
    _tempered(tmp_path / "a", (1.0, 1.0, 2.0), compiled, reset_between=True, level=level)
    _tempered(tmp_path / "b", (1.0, 1.0, 2.0), compiled, level=level)
    fd = diff(tmp_path / "a", tmp_path / "b").first_divergence
    if compiled == "compiled":
        assert fd["name"] == "<root>::compiled.forward.0.output.0", fd["name"]
        return
    from tracer.analysis import explain

    # the graph's own op, at its line, called with the baked value
    assert fd["name"].startswith("<root>::aten.div.forward.0.output"), fd["name"]
    assert fd["source"].endswith(f":{_line_of('return self.b(h) / _temperature()')}")
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.blamed is not None and e.blamed["op"] == "aten.div", e.verdict


def _line_of(text: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(inspect.getmodule(_line_of))
    return next(i for i, line in enumerate(lines, start or 1) if text in line)


def _llama(run, *, dump=True, backend="aot_eager", compiled="compiled", fault=False):
    """A Hugging Face Llama built from a config, compiled whole; `fault` scales layer 1's MLP
    output where the code runs compiled. Returns the losses of three steps."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    if fault:
        mlp = model.model.layers[1].mlp
        forward = mlp.forward

        def scaled(x):
            y = forward(x)
            return y * 1.5 if torch.compiler.is_compiling() else y  # the compile-only bug

        mlp.forward = scaled
    call = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dumper = tracer.Dumper(model, {"path": str(run), "level": "mix", "mode": "tensor",
                                   "writer": "sync", "steps": "0", "on_error": "raise",
                                   "compiled": compiled}) if dump else None
    def loss_of():
        ids = torch.randint(0, 128, (2, 16))
        return call(input_ids=ids, labels=ids).loss

    return train_steps(loss_of, opt, 3, dumper)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager"])
def test_a_hugging_face_llama_compiled(tmp_path, backend):
    from tracer.analysis import explain

    plain = _llama(tmp_path / "plain", dump=False, backend=backend)
    assert _llama(tmp_path / "a", backend=backend) == plain
    _llama(tmp_path / "b", backend=backend, fault=True)
    stats = tracer.open_dump(tmp_path / "a").stats(0, 0)
    # Hugging Face wraps the model's forward in decorators: the region is still its forward,
    # at the model's line, not the outermost decorator's
    region = stats[stats.name == "<root>::compiled.forward.0.output.0"]
    assert len(region) == 1
    assert "models/llama/modeling_llama.py:" in region.source.iloc[0], region.source.iloc[0]
    e = explain(tmp_path / "a", tmp_path / "b")
    # the compiled mode sees the region, never "inputs differ" for what its kernels made
    assert e.status != "inputs" and "inputs differ" not in e.verdict, e.verdict
    if backend == "inductor":
        assert "compiled region <root>::compiled.forward.0" in e.verdict, e.verdict
    # the interpreter mode names the op, its module and the line of the bug
    _llama(tmp_path / "ia", backend=backend, compiled="interpret")
    _llama(tmp_path / "ib", backend=backend, compiled="interpret", fault=True)
    e = explain(tmp_path / "ia", tmp_path / "ib")
    assert e.status == "bug" and e.blamed["op"] == "aten.mul", e.verdict
    assert e.blamed["module"] == "model.layers.1.mlp", e.verdict
    assert e.blamed["source"].endswith(f":{_line_of('the compile-only bug')}"), e.verdict
