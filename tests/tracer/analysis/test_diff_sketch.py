"""Sketches in statistics dumps (tracer.storage._sketch): a diff of two statistics dumps sees
elements that moved, which no statistic shows.

The fault is one a weight conversion makes: a Hugging Face Llama (built from a config, nothing
downloaded) whose first layer has attention heads 0 and 1 swapped in q_proj, k_proj and
v_proj. Every record up to the attention output is then a permutation of the right one (the
same values, the same statistics), and the first value that differs is o_proj's output. A
statistics diff without sketches blames o_proj; with them it names the swapped weight.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import tracer
from tracer.storage import SKETCH_SIZE, open_dump, sketch_positions
from tracer.storage._sketch import from_array, offsets

pytest.importorskip("transformers")

HEAD = 8  # head_dim of the tiny Llama below
Q = "model.layers.0.self_attn.q_proj.weight.optimizer.0.param.0"


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                         max_position_embeddings=32)
    return LlamaForCausalLM(config)


def _swap_heads(model: torch.nn.Module) -> None:
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            w = proj.weight
            w[:2 * HEAD] = torch.cat([w[HEAD:2 * HEAD].clone(), w[:HEAD].clone()])


def _run(path: Path, swap: bool, **config) -> Path:
    model = _llama()
    if swap:
        _swap_heads(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with tracer.Dumper(model, {"path": str(path), "level": "module", "mode": "statistics",
                               **config}):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sketch")
    return {"a": _run(root / "a", False), "b": _run(root / "b", True),
            "a_async": _run(root / "a_async", False, writer="async"),
            "a_plain": _run(root / "a_plain", False, sketch=False),
            "b_plain": _run(root / "b_plain", True, sketch=False)}


def test_a_head_swap_is_named_at_the_swapped_weight(runs):
    result = tracer.diff(runs["a"], runs["b"])
    first = result.first_divergence
    assert result.status == "diverged" and result.compared == "statistics"
    assert first["name"] == Q and first["compared"] == "sketch"
    assert first["reason"].startswith("statistics agree, but 128 sampled elements:")
    # the values that moved, not values that changed: every statistic agrees there
    rec = result.records.set_index("name").loc[Q]
    assert rec["checksum_equal"] and rec["cosine"] < 0.9
    # each record of layer 0 whose elements moved is named, each with the reason
    moved = result.records[result.records["reason"].str.startswith("statistics agree")]
    assert {"model.layers.0.self_attn.q_proj.forward.0.output.0",
            "model.layers.0.self_attn.v_proj.forward.0.output.0"} <= set(moved["name"])


def test_without_sketches_the_diff_blames_the_first_value_that_changed(runs):
    first = tracer.diff(runs["a_plain"], runs["b_plain"]).first_divergence
    assert first["compared"] == "statistics"
    assert first["name"] != Q and "o_proj" in first["name"]


def test_the_same_run_twice_is_the_same_on_every_sketch(runs):
    result = tracer.diff(runs["a"], runs["a_async"])
    assert result.status == "same"
    sketched = result.records[result.records["compared"] == "sketch"]
    assert len(sketched) == len(result.records)
    assert (sketched["cosine"] > 1 - 1e-6).all() and (sketched["max_abs_err"] == 0).all()


def test_a_dump_without_sketches_on_one_side_compares_statistics(runs):
    result = tracer.diff(runs["a_plain"], runs["b"])
    assert set(result.records["compared"]) == {"statistics"}
    assert result.first_divergence["name"] != Q


def test_each_record_keeps_the_elements_at_its_positions(runs):
    """The stored sketch of a record is its tensor's elements at `sketch_positions(numel)`:
    checked against a tensor dump of the same run."""
    d = open_dump(runs["a"])
    tensor_run = _run(runs["a"].parent / "a_tensor", False, mode="tensor")
    t = open_dump(tensor_run)
    table = d.stats(0, 0)
    assert d.sketches(0, 0).shape == (len(table), SKETCH_SIZE)
    for name, numel in zip(table["name"], table["numel"]):
        sketch = d.sketch(0, 0, name)
        if numel == 0:
            assert sketch is None
            continue
        want = from_array(t.tensor(0, 0, name).astype(np.float64))
        np.testing.assert_array_equal(sketch, want, err_msg=name)
        assert np.isnan(sketch[len(sketch_positions(numel)):]).all()
    assert t.sketches(0, 0) is None  # a tensor dump keeps the elements themselves


def test_positions_are_stratified_and_fixed():
    """The rule is part of the format: these values must never change."""
    assert list(sketch_positions(5)) == [0, 1, 2, 3, 4]
    pos = sketch_positions(10_000)
    assert len(pos) == SKETCH_SIZE and (np.diff(pos) > 0).all()
    slices = [j * 10_000 // SKETCH_SIZE for j in range(SKETCH_SIZE + 1)]
    assert all(slices[j] <= p < slices[j + 1] for j, p in enumerate(pos))
    assert list(sketch_positions(1000)[:4]) == [1, 14, 15, 24]


def test_a_strided_tensor_is_sampled_as_its_contiguous_copy():
    from tracer.storage._sampling import device_sample, sketch_of

    x = torch.randn(40, 30)
    for view in (x.t(), x[::2, 3:], x.t()[5:, ::3], x.expand(2, 40, 30), x.to(torch.bfloat16).t(),
                 torch.arange(1000).reshape(10, 100).t(), x[0, 0]):
        want = from_array(view.contiguous().to(torch.float64).numpy())
        np.testing.assert_array_equal(sketch_of(view), want)
        np.testing.assert_array_equal(device_sample(view).numpy(), want)
    assert sketch_of(torch.zeros(0, 3)) is None
    assert np.frombuffer(offsets((3,), (1,)), np.int64).tolist()[:4] == [0, 1, 2, -1]


def test_rounding_is_not_a_divergence():
    """A sketch is judged with the dtype's tolerance, element by element, like a tensor."""
    from tracer.analysis._compare import Tolerance, compare_sketch

    a = torch.randn(4096)
    b = a * (1 + 1e-7 * torch.randn(4096))
    sa, sb = from_array(a.numpy()), from_array(b.numpy())
    same = compare_sketch(sa, sb, 4096, "float32", "float32", Tolerance())
    assert same["verdict"] == "same" and same["cosine"] > 1 - 1e-9
    moved = from_array(a.roll(1).numpy())
    diverged = compare_sketch(sa, moved, 4096, "float32", "float32", Tolerance())
    assert diverged["verdict"] == "diverged" and math.isfinite(diverged["cosine"])


def test_a_damaged_sketch_array_is_named_not_read_as_same(runs, tmp_path):
    """Sketch bytes changed on disk fail their CRC-32: the diff says incomplete and names the
    file, instead of comparing sampled elements that are not the run's."""
    import shutil

    import h5py

    b = tmp_path / "b"
    shutil.copytree(runs["a_async"], b)
    path = b / "dump" / "rank0" / "step0.h5"
    with h5py.File(path, "r+") as f:
        f["sketches"][0, 0] = f["sketches"][0, 0] + 1.0
    result = tracer.diff(runs["a"], b)
    assert result.status == "incomplete" and result.exit_code == 2
    assert any("/sketches" in p.reason and p.side == "B" for p in result.problems)
    with pytest.raises(tracer.DumpFormatError, match="/sketches array is damaged"):
        open_dump(b).sketches(0, 0)


class _Heads(torch.nn.Module):
    """Multi-head attention written by hand; `right=False` merges the heads without moving
    the head dimension back (the classic transposed-reshape bug)."""

    def __init__(self, right: bool) -> None:
        super().__init__()
        self.right = right
        self.qkv, self.proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in self.qkv(x).split(16, dim=2))
        y = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1) @ v
        y = (y.transpose(1, 2) if self.right else y).reshape(b, t, 16)
        return self.proj(y)


def test_a_transposed_reshape_is_named_at_the_op_that_makes_it(tmp_path):
    """Op level: the wrong reshape's output holds the right values in another order. The
    sketch names that op and its line; without sketches the next op (the projection) is
    blamed."""
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(2))
    runs = {}
    for right in (True, False):
        for sketch in (True, False):
            torch.manual_seed(0)
            model = _Heads(right)
            path = tmp_path / f"{right}{sketch}"
            with tracer.Dumper(model, {"path": str(path), "level": "op", "params": False,
                                       "sketch": sketch}) as d:
                model(x).sum().backward()
                d.step()
            runs[right, sketch] = path
    first = tracer.diff(runs[True, True], runs[False, True]).first_divergence
    # the first paired record that differs: the projection's input, the right values moved
    assert first["name"] == "proj::aten.view.forward.0.input.0"
    assert first["reason"].startswith("statistics agree, but")
    # and the ops the two runs did differently right before it: the reshape's, on its line
    line = f"test_diff_sketch.py:{_reshape_line()}"
    before = first["unpaired_before"]
    assert {b["side"] for b in before} == {"A", "B"}
    assert all(b["source"].endswith(line) for b in before)
    assert {b["op"] for b in before if b["side"] == "A"} >= {"aten.transpose", "aten.clone"}
    assert [b["op"] for b in before if b["side"] == "B"] == ["aten.view", "aten.view"]
    plain = tracer.diff(runs[True, False], runs[False, False]).first_divergence
    assert plain["op"] == "aten.addmm"  # without sketches: the projection's result


def _reshape_line() -> int:
    import inspect

    lines, start = inspect.getsourcelines(_Heads.forward)
    return start + next(i for i, line in enumerate(lines) if "self.right else y" in line)


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_a_transposed_view_keeps_its_own_sketch(tmp_path, writer):
    """A transpose shares its base's memory and statistics, but not its order: the record of
    `aten.t`'s output (and of the addmm that reads it) holds the sketch of W.t(), not of W.
    So a port that multiplies by W where the reference multiplies by W.t() (a square weight:
    shapes do not show it) is named at the op that reads it."""
    from tracer.storage._sampling import sketch_of

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)

    class Wrong(torch.nn.Module):  # the port's bug: the weight used untransposed
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.bias = layer.weight, layer.bias

        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight)

    def dump(model, path):
        with tracer.Dumper(model, {"path": str(path), "level": "op", "mode": "statistics",
                                   "writer": writer}):
            model(x)
        return path

    a = dump(torch.nn.Sequential(layer), tmp_path / "a")
    d = open_dump(a)
    table, sketches = d.stats(0, d.steps(0)[0]), d.sketches(0, d.steps(0)[0])
    rows = {n: i for i, n in enumerate(table["name"])}
    want = sketch_of(layer.weight.detach().t())
    for name in ("0::aten.t.forward.0.output.0", "0::aten.addmm.forward.0.input.2"):
        np.testing.assert_array_equal(sketches[rows[name]], want, err_msg=name)
    np.testing.assert_array_equal(sketches[rows["0::aten.t.forward.0.input.0"]],
                                  sketch_of(layer.weight.detach()))
    b = dump(torch.nn.Sequential(Wrong()), tmp_path / "b")
    first = tracer.diff(a, b).first_divergence
    assert first["name"] == "0::aten.addmm.forward.0.input.2", first
    assert "elements moved" in first["reason"]
