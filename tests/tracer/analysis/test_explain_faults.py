"""`sleuth explain` on faults where the first paired divergence is not where the fault is: an
op that one run runs and the other does not (a norm that drops its weight, an extra op in a
custom backward, a linear without its bias), a module record first in a mix dump, a different
batch, a call that lost an argument, and two codebases read through a module map. Each verdict
must name the right op, its line in B, and the right kind; a refactor that only rounds
differently must stay precision."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracer
from sleuth.cli import main
from tracer.analysis import explain, map_modules

HERE = "tests/tracer/analysis/test_explain_faults.py"


def _line(text: str) -> str:
    lines = Path(__file__).read_text().splitlines()
    return f"{HERE}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


# -- a Hugging Face Llama built from a config ------------------------------------------------------
def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norm weights of ones would hide a norm that drops its weight
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    return model


def _rms_norm_without_weight(norm: nn.Module) -> None:
    """B's fault: this RMSNorm's forward normalises and never multiplies by its weight."""
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return h.to(hidden_states.dtype)  # THE NORM WITHOUT ITS WEIGHT

    norm.forward = forward


def _dump_llama(path: Path, level: str, *, no_weight: bool = False, seed: int = 1) -> Path:
    model = _llama()
    if no_weight:
        _rms_norm_without_weight(model.model.layers[1].post_attention_layernorm)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    with tracer.Dumper(model, {"path": str(path), "level": level, "mode": "tensor"}):
        model(input_ids=ids, labels=ids).loss.backward()
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("explain_faults")
    out = {}
    for level in ("op", "mix"):
        out[level] = _dump_llama(root / f"a_{level}", level)
        out[f"{level}_no_weight"] = _dump_llama(root / f"nw_{level}", level, no_weight=True)
    out["op_batch"] = _dump_llama(root / "batch_op", "op", seed=2)
    return out


@pytest.mark.parametrize("level", ["op", "mix"])
def test_a_norm_that_drops_its_weight_is_an_op_removed_not_a_bug_of_its_consumer(llama, level):
    """The first paired divergence is the next module's input (op) or the norm's own output
    record (mix); the fault is the multiply only A runs, and B passes on its input."""
    e = explain(llama[level], llama[f"{level}_no_weight"])
    assert e.status == "bug" and e.exit_code == 1, e.verdict
    norm = "model.layers.1.post_attention_layernorm"
    assert e.blamed["fault"] == "removed" and e.blamed["op"] == "aten.mul"
    assert e.blamed["name"] == f"{norm}::aten.mul.forward.1" and e.blamed["side"] == "A"
    assert e.verdict.startswith(f"bug: op removed: A runs aten.mul at ") and norm in e.verdict
    assert "B skips the op" in e.verdict
    if level == "mix":  # judged at the module record, never refused
        assert e.first_divergence["name"] == f"{norm}.forward.0.output.0"


def test_a_different_batch_at_level_op_is_inputs_not_a_bug_of_the_embedding(llama, capsys):
    e = explain(llama["op"], llama["op_batch"])
    assert e.status == "inputs" and e.blamed is None, e.verdict
    assert "aten.embedding" in e.verdict and "no recorded op made it" in e.verdict
    assert main(["explain", str(llama["op"]), str(llama["op_batch"])]) == 1
    assert capsys.readouterr().out.startswith("inputs differ: input 1 of aten.embedding")


# -- small hand-written models ---------------------------------------------------------------------
class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, extra):
        ctx.extra = extra
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        g = g * 2.0
        if ctx.extra:
            g = g.clamp(-1e-3, 1e-3)  # THE EXTRA BACKWARD OP
        return g, None


class Net(nn.Module):
    def __init__(self, fault: str = "") -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.norm = nn.LayerNorm(16)
        self._fault = fault  # private: a code difference, which no setup record shows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        y = self.fc2(h)
        if self._fault == "lost":
            z = torch.sub(y, y)  # THE LOST ARGUMENT
        elif self._fault == "swap":
            z = torch.sub(h, y)  # THE SWAP
        elif self._fault == "alpha":
            z = y.sub(h, alpha=2)  # THE ALPHA
        else:
            z = torch.sub(y, h)
        z = Twice.apply(z, self._fault == "extra")
        if self._fault == "no_bias":
            z = F.layer_norm(z, (16,), self.norm.weight)  # THE NORM WITHOUT BIAS
        else:
            z = F.layer_norm(z, (16,), self.norm.weight, self.norm.bias)
        if self._fault == "linear":
            return F.linear(z, self.head.weight)  # THE LINEAR WITHOUT BIAS
        return self.head(z)


def _dump_net(path: Path, fault: str = "", level: str = "op", mode: str = "tensor") -> Path:
    torch.manual_seed(0)
    model = Net(fault)
    with torch.no_grad():
        model.norm.bias.add_(0.2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    with tracer.Dumper(model, {"path": str(path), "level": level, "mode": mode}):
        model(x).square().mean().backward()
    return path


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("explain_net")
    out = {"a": _dump_net(root / "a"), "a_mix": _dump_net(root / "a_mix", level="mix")}
    for fault in ("extra", "lost", "swap", "alpha", "no_bias", "linear"):
        out[fault] = _dump_net(root / fault, fault)
    out["linear_mix"] = _dump_net(root / "linear_mix", "linear", level="mix")
    return out


def test_an_extra_op_in_a_custom_backward_is_an_op_added_at_its_line(net):
    e = explain(net["a"], net["extra"])
    assert e.status == "bug" and e.blamed["fault"] == "added", e.verdict
    assert e.blamed["op"] == "aten.clamp" and e.blamed["phase"] == "backward"
    assert e.blamed["source"] == _line("# THE EXTRA BACKWARD OP")
    assert e.verdict.startswith("bug: op added: B runs aten.clamp at "
                                f"{_line('# THE EXTRA BACKWARD OP')}")


@pytest.mark.parametrize("dump", ["linear", "linear_mix"])
def test_a_linear_without_its_bias_is_ops_replaced_at_both_lines(net, dump):
    """A's addmm against B's mm: both named, B's line first in `blamed`; at level mix the
    first divergence is the model's output record, judged by the ops inside it."""
    e = explain(net["a_mix" if dump.endswith("mix") else "a"], net[dump])
    assert e.status == "bug" and e.blamed["fault"] == "replaced", e.verdict
    assert e.blamed["op"] == "aten.mm" and e.blamed["source"] == _line("THE LINEAR WITHOUT")
    assert "A runs aten.addmm at " in e.verdict and "B runs aten.mm at " in e.verdict


def test_a_call_that_lost_an_argument_is_not_called_a_swap_and_shows_b_s_line(net):
    lost = explain(net["a"], net["lost"])
    assert lost.status == "bug" and lost.blamed["fault"] == "argument", lost.verdict
    assert "swapped" not in lost.verdict and "passes it twice" in lost.verdict
    assert "aten.relu" in lost.verdict  # what A passes there and B does not
    assert lost.blamed["source"] == _line("# THE LOST ARGUMENT")
    swap = explain(net["a"], net["swap"])
    assert swap.blamed["fault"] == "swapped" and "operands swapped" in swap.verdict
    assert swap.blamed["source"] == _line("# THE SWAP")


def test_other_arguments_are_named_as_the_reason(net, tmp_path, capsys):
    alpha = explain(net["a"], net["alpha"])
    assert alpha.status == "bug" and alpha.blamed["fault"] == "arguments", alpha.verdict
    assert "alpha: not passed in A, 2 in B" in alpha.verdict
    assert alpha.blamed["source"] == _line("# THE ALPHA")
    # the bias lost: B's call has one tensor fewer, re-run on A's tensors argument by argument
    bias = explain(net["a"], net["no_bias"])
    assert bias.status == "bug" and bias.blamed["op"] == "aten.native_layer_norm"
    assert "argument 3 (bias): a tensor in A, None in B" in bias.verdict
    assert bias.blamed["introduced"] > 1e3 * bias.blamed["entitled"]
    assert main(["explain", str(net["a"]), str(net["no_bias"]), "--repro",
                 str(tmp_path / "r")]) == 1
    assert "repro written" in capsys.readouterr().out
    text = (tmp_path / "r" / "repro_aten_native_layer_norm.py").read_text()
    assert "native_layer_norm.default(x[0], [16], x[1], None, 1e-05)" in text


def test_ops_replaced_within_their_rounding_are_precision(tmp_path):
    """B computes SiLU by hand in float16: other ops than A's aten.silu, whose float64 re-runs
    show the rounding they may add; B's value stays within it."""
    class Mlp(nn.Module):
        def __init__(self, half: bool) -> None:
            super().__init__()
            self.fc1, self.fc2, self.half = nn.Linear(8, 32), nn.Linear(32, 4), half

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(x)
            if self.half:
                hh = h.half()
                h = (hh / (1 + torch.exp(-hh))).float()
            else:
                h = F.silu(h)
            return self.fc2(h)

    def run(path: Path, half: bool) -> Path:
        torch.manual_seed(0)
        model = Mlp(half)
        x = 4 * torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
        with tracer.Dumper(model, {"path": str(path), "level": "op", "mode": "tensor"}):
            model(x).square().mean().backward()
        return path

    e = explain(run(tmp_path / "a", False), run(tmp_path / "b", True))
    assert e.status == "precision" and e.blamed is None, e.verdict
    assert "with other ops than A" in e.verdict and "within their rounding" in e.verdict


def test_a_module_that_passes_on_another_value_is_blamed_in_a_mix_dump(tmp_path):
    """B's block computes its output and returns its input: no op differs, the block's output
    record does; the verdict names the block and what each run passed on."""
    class Block(nn.Module):
        def __init__(self, skip: bool) -> None:
            super().__init__()
            self.fc, self.skip = nn.Linear(8, 8), skip

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(self.fc(x))  # THE BLOCK'S TANH
            return x if self.skip else y

    def run(path: Path, skip: bool) -> Path:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), Block(skip), nn.Linear(8, 2))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
        with tracer.Dumper(model, {"path": str(path), "level": "mix", "mode": "tensor"}):
            model(x).sum().backward()  # THE BLOCK'S CALLER
        return path

    e = explain(run(tmp_path / "a", False), run(tmp_path / "b", True))
    assert e.status == "bug" and e.blamed["fault"] == "passed", e.verdict
    assert e.first_divergence["name"] == "1.forward.0.output.0"
    assert e.verdict.startswith("bug: module 1 passes on another value")
    tanh = _line("# THE BLOCK'S TANH")
    assert f"in A the output of aten.tanh at {tanh}" in e.verdict
    assert "in B, the output of aten.addmm" in e.verdict  # the block's own input
    assert e.blamed["source"] == _line("# THE BLOCK'S CALLER")  # a module record's line


def test_refusals_and_unmeasured_verdicts_say_what_the_dumps_are(tmp_path, capsys):
    """Level module: refused, naming that level. Level mix in statistics mode: the op removed
    is named, but with no tensors its rounding is not measured, and the verdict says so."""
    for name, fault in (("a", ""), ("b", "linear")):
        _dump_net(tmp_path / f"module_{name}", fault, level="module")
        _dump_net(tmp_path / f"stats_{name}", fault, level="mix", mode="statistics")
    assert main(["explain", str(tmp_path / "module_a"), str(tmp_path / "module_b")]) == 2
    err = capsys.readouterr().err
    assert "dump A is level module" in err and "Traceback" not in err
    e = explain(tmp_path / "stats_a", tmp_path / "stats_b")
    assert e.status == "unexplained" and e.blamed["fault"] == "replaced", e.verdict
    assert "aten.mm" in e.verdict and "mode statistics" in e.verdict


# -- two codebases ---------------------------------------------------------------------------------
class Ported(nn.Module):
    """Net's layers under other names, as another codebase writes them."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.LayerNorm(16, eps=eps)])
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)  # THE PORT'S LAYER CALL
        return self.out(x)


class Original(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.norm, self.head = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(x)))


def test_two_codebases_are_explained_through_a_module_map(tmp_path, capsys):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    for name, model in (("a", Original()), ("b", Ported(eps=1e-2))):
        with tracer.Dumper(model, {"path": str(tmp_path / name), "level": "op",
                                   "mode": "tensor"}):
            model(x).square().mean().backward()
    a, b = tmp_path / "a", tmp_path / "b"
    alone = explain(a, b)
    assert alone.status == "unexplained" and "no record diverged" not in alone.verdict
    assert "sleuth explain --map map.yaml A B" in alone.verdict
    e = explain(a, b, module_map=map_modules(a, b))
    assert e.status == "bug" and e.blamed["op"] == "aten.native_layer_norm", e.verdict
    assert e.blamed["b_name"] == "layers.1::aten.native_layer_norm.forward.0"
    assert e.blamed["source"] == _line("# THE PORT'S LAYER CALL")
    assert "argument 4 (eps): 1e-05 in A, 0.01 in B" in e.verdict
    (tmp_path / "map.yaml").write_text(map_modules(a, b).to_yaml())
    assert main(["explain", "--map", str(tmp_path / "map.yaml"), str(a), str(b)]) == 1
    assert capsys.readouterr().out.startswith("bug: op aten.native_layer_norm at ")
    assert main(["explain", "--map", str(tmp_path / "none.yaml"), str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "none.yaml: cannot read it" in err and "Traceback" not in err


def test_an_argument_is_named_by_the_schema_and_a_reduction_by_its_word():
    from tracer.analysis._explain_sides import arg_changes
    from tracer.analysis._replay import CallSpec

    def call(reduction: int, op: str = "aten.nll_loss_forward.default") -> CallSpec:
        return CallSpec(op, [{"input": 0}, {"input": 1}, None, reduction, -100], {})

    assert arg_changes(call(1), call(2)) == ["argument 3 (reduction): 1 (mean) in A, 2 (sum) in B"]
    # an overload this torch does not have keeps the position alone
    assert arg_changes(call(1, "aten.no_such_op.default"), call(2, "aten.no_such_op.default")) \
        == ["argument 3: 1 in A, 2 in B"]
