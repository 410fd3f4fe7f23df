"""End to end: pairs of real dumps from the Dumper with one known fault; the diff must name the
faulty record as the first divergence (and report nothing for identical runs or a no-op)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import tracer
from sleuth.cli import main


class WrongScale(torch.autograd.Function):
    """y = 2x with a backward that is right (2) or wrong (3)."""

    @staticmethod
    def forward(ctx, x, wrong):
        ctx.wrong = wrong
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * (3 if ctx.wrong else 2), None


class Scale(nn.Module):
    def __init__(self, wrong: bool):
        super().__init__()
        self.wrong = wrong

    def forward(self, x):
        return WrongScale.apply(x, self.wrong)


class Block(nn.Module):
    def __init__(self, eps=1e-5, wrong_backward=False, noop=False):
        super().__init__()
        self.ln = nn.LayerNorm(16, eps=eps)
        self.fc = nn.Linear(16, 16)
        self.act = Scale(wrong_backward)
        self.noop = noop

    def forward(self, x):
        h = self.fc(self.ln(x))
        if self.noop:
            h = h + 0.0
        return x + self.act(torch.tanh(h))


class Net(nn.Module):
    def __init__(self, eps1=1e-5, wrong_backward=False, noop=False, bf16_block=None):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block(eps=eps1, wrong_backward=wrong_backward,
                                                    noop=noop), Block()])
        self.head = nn.Linear(16, 4)
        self.bf16_block = bf16_block

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == self.bf16_block:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    x = layer(x)
            else:
                x = layer(x)
        return self.head(x)


class PlainSGD(torch.optim.Optimizer):
    """p -= lr * grad, except that `target` (if given) gets a wrong update (1.5x)."""

    def __init__(self, params, lr, target=None):
        super().__init__(params, {"lr": lr})
        self.target = target

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    scale = 1.5 if p is self.target else 1.0
                    p.add_(p.grad, alpha=-group["lr"] * scale)


def run(path, *, level="module", mode="tensor", batch_seed=1, rank=0, perturb=None,
        corrupt=False, **model_kw):
    torch.manual_seed(0)
    model = Net(**model_kw)
    if perturb is not None:
        with torch.no_grad():
            dict(model.named_parameters())[perturb].mul_(1.01)
    opt = PlainSGD(model.parameters(), lr=0.1,
                   target=model.layers[2].fc.bias if corrupt else None)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(batch_seed))
    config = {"path": str(path), "level": level, "mode": mode, "writer": "sync"}
    with tracer.Dumper(model, config, rank=rank, world_size=2):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return path


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ref"))


def _first(ref, other, **kw):
    res = tracer.diff(ref, other, **kw)
    assert res.status == "diverged", res.records[["name", "verdict"]]
    return res.first_divergence


def test_identical_runs_same(ref, tmp_path, capsys):
    other = run(tmp_path / "b")
    res = tracer.diff(ref, other)
    assert res.status == "same" and res.first_divergence is None
    assert res.counts()["only_a"] == res.counts()["only_b"] == 0
    assert main(["diff", str(ref), str(other)]) == 0


def test_layernorm_eps(ref, tmp_path):
    fd = _first(ref, run(tmp_path / "b", eps1=0.5))
    assert (fd["name"], fd["module"], fd["phase"]) == ("layers.1.ln.forward.0.output.0",
                                                       "layers.1.ln", "forward")
    assert fd["source"].endswith("test_diff_faults.py:" + fd["source"].rsplit(":", 1)[1])
    assert fd["kind"] == "compute"


def test_bf16_autocast_block(ref, tmp_path):
    res = tracer.diff(ref, run(tmp_path / "b", bf16_block=1))
    fd = res.first_divergence
    assert fd["module"].startswith("layers.1") and fd["phase"] == "forward", fd
    # the hint points at where the dtype changed, inside the same block
    assert any("differ in dtype, the first at layers.1." in n and "bfloat16" in n
               for n in res.notes), res.notes


def test_gradients_accumulated_in_another_order_never_pair_unlike_records(tmp_path):
    # under autocast the casts of fc's weight and bias are autograd nodes of their own, and
    # autograd accumulates fc's two gradients (an aten.detach each) in the other order
    a = run(tmp_path / "a", level="mix", mode="statistics")
    b = run(tmp_path / "b", level="mix", mode="statistics", bf16_block=1)
    res = tracer.diff(a, b)
    recs = res.records
    paired = recs[recs["verdict"].isin(["same", "diverged"])]
    unlike = paired[paired["shape"] != paired["b_shape"]]
    assert unlike.empty, unlike[["name", "b_name", "shape", "b_shape"]].to_string()
    grads = recs[recs["name"].str.startswith("layers.1.fc::aten.detach.backward.")]
    assert len(grads) == 4 and grads["verdict"].isin(["same", "diverged"]).all(), grads
    assert set(grads["shape"]) == {"16", "16,16"}
    assert (recs["verdict"] != "only_a").all()  # B only adds its casts
    # the report's table: the first divergence, the worst others by their error, then B's
    # casts, listed apart and never ranked among the divergences
    shown = res.shown["verdict"].tolist()
    n = shown.count("diverged")
    assert n > 3 and shown[:n] == ["diverged"] * n and set(shown[n:]) == {"only_b"}
    errors = res.shown["error"].iloc[1:n].tolist()
    assert errors == sorted(errors, reverse=True) and all(e > 0 for e in errors), errors


def test_wrong_custom_backward(ref, tmp_path):
    other = run(tmp_path / "b", wrong_backward=True)
    res = tracer.diff(ref, other)
    fd = res.first_divergence
    assert (fd["module"], fd["phase"], fd["direction"]) == ("layers.1.act", "backward", "input")
    forward = res.records[res.records["phase"] == "forward"]
    assert (forward["verdict"] == "same").all()  # the forward is untouched


def test_corrupted_optimizer_update(ref, tmp_path):
    fd = _first(ref, run(tmp_path / "b", corrupt=True))
    assert fd["name"] == "layers.2.fc.bias.optimizer.0.update.0" and fd["phase"] == "optimizer"


def test_different_batch_is_data_divergence(ref, tmp_path, capsys):
    other = run(tmp_path / "b", batch_seed=2)
    fd = _first(ref, other)
    assert fd["name"] == "<root>.forward.0.input.0" and fd["kind"] == "data"
    assert main(["diff", str(ref), str(other)]) == 1
    assert "the two runs were fed different data" in capsys.readouterr().out


def test_inserted_noop_op_level(tmp_path):
    a = run(tmp_path / "a", level="op")
    b = run(tmp_path / "b", level="op", noop=True)
    res = tracer.diff(a, b)
    assert res.status == "same", res.records[res.records.verdict != "same"][
        ["name", "b_name", "verdict", "reason"]].to_string()
    only_b = res.records[res.records["verdict"] == "only_b"]
    assert len(only_b) >= 1 and (only_b["op"] == "aten.add").all()
    assert (only_b["module"] == "layers.1").all()
    # msprobe-style exact-name join: B's no-op takes the name of A's residual add, so the
    # residual add is paired with the no-op and reported as a (false) divergence
    from tracer.analysis._align import align_by_name

    sa, sb = tracer.open_dump(a).stats(0, 0), tracer.open_dump(b).stats(0, 0)
    mispaired = [sa["name"].iat[i] for i, j in align_by_name(sa, sb)
                 if i is not None and j is not None
                 and sa["checksum"].iat[i] != sb["checksum"].iat[j]]
    assert "layers.1::aten.add.forward.0.output.0" in mispaired


def test_perturbed_rank_names_the_parameter(tmp_path, capsys):
    run(tmp_path / "ddp", rank=0)
    run(tmp_path / "ddp", rank=1, perturb="layers.0.fc.weight")
    fd = _first(tmp_path / "ddp", tmp_path / "ddp", rank=0, b_rank=1)
    assert fd["name"] == "layers.0.fc.weight.optimizer.0.param.0" and fd["kind"] == "parameter"
    assert main(["diff", str(tmp_path / "ddp"), str(tmp_path / "ddp"), "--b-rank", "1",
                 "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_divergence"]["name"] == "layers.0.fc.weight.optimizer.0.param.0"
    assert doc["first_divergence"]["b_rank"] == 1


def test_statistics_dumps(ref, tmp_path):
    a = run(tmp_path / "a", mode="statistics")
    b = run(tmp_path / "b", mode="statistics", eps1=0.5)
    res = tracer.diff(a, b)
    assert res.compared == "statistics"
    assert res.first_divergence["name"] == "layers.1.ln.forward.0.output.0"
    assert tracer.diff(a, ref).status == "same"  # statistics against tensors: statistics
