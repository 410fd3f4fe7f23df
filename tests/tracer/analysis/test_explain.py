"""`sleuth explain`: ops on the divergence chain re-run on the reference's recorded inputs, and
one verdict. Models nobody here wrote (a Hugging Face Llama built from a config, a small
ResNet-style CNN), with injected faults of both kinds: a bug (a wrong epsilon, a changed custom
backward, operands swapped) must get "bug" and the right op; a pure precision change (bf16
autocast, a float16 island) must get "precision" with no op blamed."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import tracer
from sleuth.cli import main
from tracer.analysis import explain

TENSOR_OP = {"level": "op", "mode": "tensor"}


def _llama(eps: float = 1e-6) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, rms_norm_eps=eps,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def _dump_llama(path: Path, eps: float = 1e-6, bf16: bool = False, device: str = "cpu") -> Path:
    model = _llama(eps).to(device)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    with tracer.Dumper(model, {"path": str(path), **TENSOR_OP}):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("explain")
    return {"a": _dump_llama(root / "a"), "again": _dump_llama(root / "again"),
            "eps": _dump_llama(root / "eps", eps=1e-2),
            "bf16": _dump_llama(root / "bf16", bf16=True)}


def test_a_wrong_epsilon_is_a_bug_at_the_op_that_adds_it(llama):
    e = explain(llama["a"], llama["eps"])
    assert e.status == "bug" and e.exit_code == 1
    assert e.blamed["name"] == "model.layers.0.input_layernorm::aten.add.forward.0"
    assert e.blamed["received"] == 0.0 and e.blamed["introduced"] > 1e3 * e.blamed["entitled"]
    assert e.verdict.startswith("bug: op aten.add at ")
    # the next ops inherit the error: received, not introduced
    rsqrt = e.chain[1]
    assert rsqrt["op"] == "aten.rsqrt" and rsqrt["judged"] == "rounding"
    assert rsqrt["received"] > 1 and rsqrt["introduced"] == 0.0


def test_bf16_autocast_is_precision_with_no_op_blamed(llama):
    e = explain(llama["a"], llama["bf16"])
    assert e.status == "precision" and e.blamed is None and e.exit_code == 1
    assert all(x["judged"] != "bug" for x in e.chain)
    assert "bfloat16" in e.verdict and "lose the most" in e.verdict
    replayed = [x for x in e.chain if x["judged"] == "rounding"]
    assert replayed and max(x["introduced"] for x in replayed) > 1e-4  # bf16 rounding, seen


def test_the_same_run_twice_is_same(llama, capsys):
    assert explain(llama["a"], llama["again"]).status == "same"
    assert main(["explain", str(llama["a"]), str(llama["again"])]) == 0
    assert "agree on every record" in capsys.readouterr().out


def test_the_command_line_and_json(llama, capsys):
    assert main(["explain", str(llama["a"]), str(llama["eps"]), "--limit", "3"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("bug: op aten.add at ")
    assert "model.layers.0.input_layernorm::aten.add.forward.0" in out and "blamed:" in out
    assert main(["explain", str(llama["a"]), str(llama["eps"]), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "bug" and data["exit_code"] == 1 and len(data["chain"]) == 20
    assert data["blamed"]["op"] == "aten.add"
    assert main(["explain", str(llama["a"]), str(llama["eps"]), "--limit", "0"]) == 2
    assert "--limit must be 1 or more" in capsys.readouterr().err


class Block(nn.Module):
    """A ResNet-style block with a custom scaling whose backward the faulty run changes."""

    def __init__(self, swap: bool = False, half: bool = False, grad: float = 1.0) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.swap, self.half, self.grad = swap, half, grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv1(x)))
        if self.half:  # a float16 island
            h = (h.half() * 0.5).float()
        else:
            h = h * 0.5
        h = Scale.apply(self.conv2(h), self.grad)
        return torch.sub(h, x) if self.swap else torch.sub(x, h)


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grad):
        ctx.grad = grad
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * (2.0 * ctx.grad), None


def _dump_cnn(path: Path, **fault) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Block(**fault), nn.Flatten(),
                          nn.Linear(4 * 8 * 8, 10))
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    with tracer.Dumper(model, {"path": str(path), **TENSOR_OP}):
        model(x).square().mean().backward()
    return path


@pytest.fixture(scope="module")
def cnn(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("explain_cnn")
    return {"a": _dump_cnn(root / "a"), "swap": _dump_cnn(root / "swap", swap=True),
            "half": _dump_cnn(root / "half", half=True),
            "backward": _dump_cnn(root / "backward", grad=1.1)}


def test_swapped_operands_are_a_bug_at_the_call(cnn):
    e = explain(cnn["a"], cnn["swap"])
    assert e.status == "bug"
    assert e.blamed["name"] == "1::aten.sub.forward.0" and "operands swapped" in e.verdict
    assert e.blamed["source"].endswith(f"test_explain.py:{_line('torch.sub(h, x)')}")


def test_a_changed_custom_backward_is_a_bug_in_backward(cnn):
    e = explain(cnn["a"], cnn["backward"])
    assert e.status == "bug" and e.blamed["phase"] == "backward"
    assert e.blamed["op"] == "aten.mul" and e.blamed["received"] == 0.0


def test_a_float16_island_is_precision(cnn):
    e = explain(cnn["a"], cnn["half"])
    assert e.status == "precision" and e.blamed is None
    assert "float16" in e.verdict


def test_dumps_without_tensors_or_calls_are_a_clear_error(tmp_path, capsys):
    torch.manual_seed(0)
    for name in ("a", "b"):
        m = nn.Linear(4, 4)
        if name == "b":
            with torch.no_grad():
                m.bias.add_(1.0)
        with tracer.Dumper(m, {"path": str(tmp_path / name), "level": "op"}):
            m(torch.ones(2, 4)).sum().backward()
    assert main(["explain", str(tmp_path / "a"), str(tmp_path / "b")]) == 1  # weights differ
    assert "inputs differ from the start" in capsys.readouterr().out
    for name in ("c", "d"):
        m = nn.Linear(4, 4)
        torch.manual_seed(0)
        with tracer.Dumper(m, {"path": str(tmp_path / name), "level": "op"}):
            m(torch.ones(2, 4) * (2.0 if name == "d" else 1.0)).sum().backward()
    assert main(["explain", str(tmp_path / "c"), str(tmp_path / "d")]) in (1, 2)
    text = capsys.readouterr()
    assert "Traceback" not in text.err


def _line(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_a_call_made_on_a_device_this_process_lacks_is_re_run_on_the_cpu_and_says_so():
    """The spec names the device a call ran on; without it here, the re-run is on the CPU and
    the chain says so (a GPU kernel may round differently), never silently."""
    from tracer.analysis import replay
    from tracer.analysis._replay import CallSpec, replay_device
    from tracer.capture import encode_call

    x = torch.randn(3)
    spec = CallSpec.parse(encode_call(torch.ops.aten.mul.Tensor, (x, x), {}))
    assert spec.device == "cpu" and replay_device(spec) == "cpu"
    meta = torch.empty(3, device="meta")
    named = CallSpec.parse(encode_call(torch.ops.aten.mul.Tensor, (meta, meta), {}))
    assert named.args[0] == {"input": 0, "device": "meta"} and named.device == "meta"
    far = CallSpec("aten.mul.Tensor", [{"input": 0, "device": "cuda:7"},
                                       {"input": 1, "device": "cuda:7"}], {})
    if not torch.cuda.is_available() or torch.cuda.device_count() < 8:
        assert replay_device(far) == "cpu"
        out = replay(far, [x, x])[0]
        assert out.device.type == "cpu" and torch.equal(out, x * x)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_run_against_a_cpu_run_is_re_run_on_the_gpu(tmp_path):
    """The same model and batch in float32 on the CPU (A) and on CUDA (B): B's calls are
    re-run on CUDA, where they ran, and the verdict is rounding (or the same), never a bug."""
    def run(path: Path, device: str) -> Path:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256),
                              nn.Linear(256, 8)).to(device)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)).to(device)
        with tracer.Dumper(model, {"path": str(path), **TENSOR_OP}):
            model(x).square().mean().backward()  # THE BACKWARD LINE
        return path

    a, b = run(tmp_path / "cpu", "cpu"), run(tmp_path / "gpu", "cuda")
    e = explain(a, b)
    assert e.status in ("same", "precision"), e.verdict
    replayed = [x for x in e.chain if x["judged"] != "not replayed"]
    assert all(x["device"].startswith("cuda") and x["replayed_on"] == x["device"]
               for x in replayed)
    # CUDA runs backward in a thread of its own: its records name the same lines as the CPU's
    sources = []
    for path in (a, b):
        dump = tracer.open_dump(path)
        stats = dump.stats(0, dump.steps(0)[0])
        sources.append(dict(zip(stats["name"], stats["source"])))
    assert sources[0] == sources[1]
    backward = {s for n, s in sources[1].items() if ".backward." in n}
    assert backward == {f"tests/tracer/analysis/test_explain.py:{_line('# THE BACKWARD LINE')}"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_a_wrong_epsilon_is_a_bug_and_bf16_autocast_is_precision(tmp_path):
    """Both runs on CUDA, re-run on CUDA: the faults of both kinds get the verdicts they get on
    the CPU, and the same run twice (where CUDA kernels may add in another order) is never a
    bug."""
    pytest.importorskip("transformers")
    a = _dump_llama(tmp_path / "a", device="cuda")
    eps = explain(a, _dump_llama(tmp_path / "eps", eps=1e-2, device="cuda"))
    assert eps.status == "bug", eps.verdict
    assert eps.blamed["name"] == "model.layers.0.input_layernorm::aten.add.forward.0"
    assert eps.blamed["replayed_on"].startswith("cuda")
    bf16 = explain(a, _dump_llama(tmp_path / "bf16", bf16=True, device="cuda"))
    assert bf16.status == "precision" and bf16.blamed is None, bf16.verdict
    assert "bfloat16" in bf16.verdict
    again = explain(a, _dump_llama(tmp_path / "again", device="cuda"))
    assert again.status in ("same", "precision"), again.verdict


def test_a_seeded_op_that_draws_nothing_re_runs_and_one_that_draws_is_named():
    """Dropout of p 0 (and attention without dropout) is tagged random by torch but draws
    nothing: two re-runs agree, so it re-runs. A dropout of p 0.5 differs between re-runs:
    named as random, never judged."""
    from tracer.analysis import NotReplayable, replay
    from tracer.analysis._replay import CallSpec
    from tracer.capture import encode_call

    x = torch.randn(64)
    quiet = CallSpec.parse(encode_call(torch.ops.aten.native_dropout.default, (x, 0.0, True),
                                       {}))
    assert torch.equal(replay(quiet, [x])[0], x)
    noisy = CallSpec.parse(encode_call(torch.ops.aten.native_dropout.default, (x, 0.5, True),
                                       {}))
    with pytest.raises(NotReplayable, match="a random op: two re-runs differ"):
        replay(noisy, [x])


def _dropout_run(path: Path, seed: int, draws: int = 0) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.Linear(32, 4))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(seed)
    torch.rand(draws)
    with tracer.Dumper(model, {"path": str(path), **TENSOR_OP}):
        model(x).sum().backward()
    return path


def test_an_op_that_cannot_be_re_run_where_the_runs_part_is_never_called_rounding(tmp_path):
    """B's dropout draws another mask (the same seed, drawn from once more before): the first
    divergence is a random op, which cannot be re-run. The ops after it stay within their
    rounding, but the verdict does not say precision: whether the random op made the
    difference is not known."""
    e = explain(_dropout_run(tmp_path / "a", 1), _dropout_run(tmp_path / "b", 1, draws=1))
    assert e.status == "unexplained" and e.exit_code == 1, e.verdict
    assert "could not be re-run" in e.verdict and "aten.bernoulli_" in e.verdict


def test_another_seed_is_named_where_a_random_op_parts_the_runs(tmp_path):
    """Another seed: the step's setup names it, and the verdict is "setup", never precision
    nor a bug at the random op."""
    e = explain(_dropout_run(tmp_path / "a", 1), _dropout_run(tmp_path / "b", 2))
    assert e.status == "setup" and e.exit_code == 1, e.verdict
    assert "seed 1 in A, 2 in B" in e.verdict and "aten.bernoulli_" in e.verdict
    assert [d["kind"] for d in e.setup] == ["rng"]


def _link(name: str, received: float, introduced: float) -> dict:
    return {"name": name, "op": "aten.add", "source": "model.py:9", "received": received,
            "introduced": introduced, "entitled": 1e-8, "judged": "rounding",
            "b_dtype": "bfloat16", "changes": [], "why": ""}


def test_no_error_added_on_the_chain_and_no_dtype_differing_is_not_precision():
    """Two bf16 runs, a bug upstream of the chain in records the diff judged within tolerance:
    the chain's first op receives a 50 % difference and no op re-run adds any error. Rounding
    made none of it, so the verdict is not "precision"; with a dtype that differs, or an op
    that adds error, it is."""
    from tracer.analysis._explain import _verdict

    chain = [_link("layers.0::aten.add.forward.1", 0.5, 0.0),
             _link("layers.1::aten.pow.forward.0", 0.06, 0.0)]
    e = _verdict(chain, None, chain[0], {}, [])
    assert e.status == "unexplained", e.verdict
    assert "already receives inputs that differ by 0.5" in e.verdict and "--rtol" in e.verdict
    mixed = ["records differ in dtype, the first at x.input.0 (float32 vs bfloat16, m.py:3)"]
    assert _verdict(chain, None, chain[0], {}, mixed).status == "precision"
    lossy = [_link("layers.0::aten.add.forward.1", 0.5, 0.004)]
    assert _verdict(lossy, None, lossy[0], {}, []).status == "precision"


def test_a_model_left_in_eval_mode_is_the_setup_even_from_statistics_dumps(tmp_path):
    """Level mix statistics dumps keep no op calls to re-run, but the setup names what makes
    the first divergence (BatchNorm in eval mode in B): a verdict, never an exit 2."""
    def run(path, eval_mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                              nn.Linear(4 * 6 * 6, 2))
        if eval_mode:
            model.eval()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        with tracer.Dumper(model, {"path": str(path), "level": "mix", "mode": "statistics",
                                   "steps": "0"}):
            model(x).square().mean().backward()
            opt.step()

    run(tmp_path / "a", False)
    run(tmp_path / "b", True)
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "setup", e.verdict
    assert "in eval mode in B, train mode in A" in e.verdict
    assert 'dump both runs again with {"mode": "tensor"}' in e.verdict  # what the records would need


class _TokenLoss(nn.Module):
    """A model given its labels: the loss is computed inside, so the labels are the model's
    own input `<root>.forward.0.input.1`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(ids))
        return nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))


@pytest.mark.parametrize("edits", ["A", pytest.param("B", marks=pytest.mark.slow)])
def test_labels_one_run_edits_in_its_loop_are_that_edit_not_inputs(tmp_path, edits):
    """One run masks some labels with -100 in its loop (ops outside the model, recorded at
    level mix): the edit, at its line, whichever run makes it; never "inputs differ"."""
    def run(path, edit):
        torch.manual_seed(0)
        model = _TokenLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
        with tracer.Dumper(model, {"path": str(path), "level": "mix", "mode": "tensor",
                                   "steps": "0"}):
            labels = ids.clone()
            if edit:
                labels[ids < 4] = -100  # THE EDIT
            model(ids, labels).backward()
            opt.step()

    run(tmp_path / "a", edits == "A")
    run(tmp_path / "b", edits == "B")
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "bug", e.verdict
    word = "removed" if edits == "A" else "added"
    assert e.blamed["fault"] == word, e.verdict
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "# THE EDIT" in text)
    assert f"test_explain.py:{line}" in e.verdict, e.verdict


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * mask.unsqueeze(-1).to(torch.float32)
        return self.head(h).square().mean()


@pytest.mark.parametrize("level", ["mix", pytest.param("op", marks=pytest.mark.slow)])
def test_a_mask_edited_through_a_view_in_the_loop_is_that_write(tmp_path, level):
    """`mask[:, 0] = 0` in B's loop writes the mask through a view (an `aten.fill_` whose
    output is one column, no value the model reads): the write at its line, never "inputs
    differ" nor an op inside the model."""
    def run(path, edit):
        torch.manual_seed(0)
        model = _Masked()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
        with tracer.Dumper(model, {"path": str(path), "level": level, "mode": "tensor",
                                   "steps": "0"}):
            mask = torch.ones_like(ids)
            if edit:
                mask[:, 0] = 0  # THE MASK EDIT
            model(ids, mask).backward()
            opt.step()

    run(tmp_path / "a", False)
    run(tmp_path / "b", True)
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "bug" and e.blamed["fault"] == "written", e.verdict
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "# THE MASK EDIT" in text)
    assert f"at tests/tracer/analysis/test_explain.py:{line} " in e.verdict, e.verdict


def test_a_detach_only_one_run_makes_is_where_its_missing_backward_is_cut(tmp_path):
    """B detaches an intermediate in its forward: A's backward through the layers before it
    has no partner; the verdict names the detach at its line, not `loss.backward()`'s."""
    cut = []

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            if cut:
                h = h.detach()  # THE CUT
            return self.b(h).square().mean()

    def run(path, cuts):
        cut[:] = [True] if cuts else []
        torch.manual_seed(0)
        model = Two()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        with tracer.Dumper(model, {"path": str(path), "level": "mix", "mode": "tensor",
                                   "steps": "0"}):
            model(x).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    run(tmp_path / "a", False)
    run(tmp_path / "b", True)
    e = explain(tmp_path / "a", tmp_path / "b")
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "# THE CUT" in text)
    assert f"B cuts the graph in its forward there: aten.detach at " \
           f"tests/tracer/analysis/test_explain.py:{line} " in e.verdict, e.verdict
    assert not e.setup, e.setup  # the clipping call is given the same parameters in both
