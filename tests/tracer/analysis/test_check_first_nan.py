"""The first NaN is the first NaN: in-place writes to weights and buffers in the user's loop,
a nanoGPT-style causal mask's intended -inf, the config's allowlist."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracer
from sleuth.cli import main
from tracer.analysis._check import first_nan_origin
from tracer.analysis._origin import StepOrigin
from test_diff_synthetic import rec, write_step


def _line(marker: str) -> str:
    """'tests/tracer/analysis/test_check_first_nan.py:N' of the line of this file holding `marker`."""
    lines = open(__file__).read().splitlines()
    n = next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)
    return f"tests/tracer/analysis/test_check_first_nan.py:{n}"


def _mlp_with_weight_write(path, level):
    """A plain loop; at step 1 the user's code writes a NaN into the first layer's weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": str(path), "level": level, "writer": "sync"}):
        for step in range(3):
            x = torch.randn(2, 4)
            if step == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")  # the user's write
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("level", ["op", "mix"])
def test_in_place_weight_write_is_the_origin(tmp_path, capsys, level):
    _mlp_with_weight_write(tmp_path / "run", level)
    o = first_nan_origin(tmp_path / "run")
    assert o["name"] == "<none>::aten.copy_.forward.0.output.0"
    assert (o["op"], o["kind"], o["step"], o["values"]) == ("aten.copy_", "in_place_write", 1,
                                                            "NaN")
    assert o["source"] == _line("the user's write")
    assert "0.weight" in o["why"]
    assert main(["check", str(tmp_path / "run"), "--first-nan"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("first NaN: <none>::aten.copy_.forward.0.output.0 (op aten.copy_, "
                          "outside any module, forward, step 1")
    assert "non-finite when this step began" not in out


def test_in_place_weight_write_at_module_level_names_the_weight(tmp_path):
    _mlp_with_weight_write(tmp_path / "run", "module")
    o = first_nan_origin(tmp_path / "run")
    # no op records: the write itself is invisible, so fc1's output is not blamed; the weight
    # is, with what the dump can tell
    assert o["name"] == "0.weight.optimizer.0.param.0" and o["kind"] == "weight"
    assert o["first_seen"] == "0.forward.0.output.0" and o["step"] == 1
    assert "finite when the step began" in o["why"] and "outside any module" in o["why"]
    assert o["source"] == ""


class ScaledMLP(nn.Module):
    """A model with a buffer that scales its input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(4))
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x * self.scale)


def test_in_place_buffer_fill_is_the_origin(tmp_path):
    torch.manual_seed(0)
    model = ScaledMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": str(tmp_path), "level": "op", "writer": "sync"}):
        for step in range(2):
            if step == 1:
                model.scale.fill_(float("inf"))  # the buffer write
            model(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    o = first_nan_origin(tmp_path)
    assert (o["op"], o["kind"], o["step"], o["values"]) == ("aten.fill_", "in_place_write", 1,
                                                            "+Inf")
    assert o["source"] == _line("the buffer write")


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention without flash: a tril buffer, masked_fill(-inf), softmax."""

    def __init__(self, n_embd=16, n_head=2, block_size=8):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(0.0)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))
        self.temperature = 1.0

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att / self.temperature  # the injected bug: temperature 0
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(16)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _gpt_run(path, level="mix", nan_step=2):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.LayerNorm(16), nn.Linear(16, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tracer.Dumper(model, {"path": str(path), "level": level, "writer": "sync"}):
        for step in range(3):
            model[0].attn.temperature = 0.0 if step == nan_step else 1.0
            logits = model(torch.randn(2, 8, 16))
            F.cross_entropy(logits.view(-1, 10), torch.randint(0, 10, (16,))).backward()
            opt.step()
            opt.zero_grad()


def test_causal_mask_inf_is_not_the_origin(tmp_path, capsys):
    _gpt_run(tmp_path / "clean", nan_step=None)
    assert first_nan_origin(tmp_path / "clean") is None  # the mask's -inf is absorbed
    hits = tracer.check(tmp_path / "clean", first_nan=False)  # yet it is there, as a hit
    assert "0.attn::aten.masked_fill.forward.0.output.0" in set(hits["name"])
    # allowed, the mask and the softmax input holding the same values are no hits either
    assert main(["check", str(tmp_path / "clean"), "--nan-allow", "*::aten.masked_fill.*"]) == 0
    assert main(["check", str(tmp_path / "clean"), "--first-nan"]) == 0
    assert "no NaN or Inf" in capsys.readouterr().out
    _gpt_run(tmp_path / "run", nan_step=2)
    o = first_nan_origin(tmp_path / "run")
    assert (o["op"], o["module"], o["step"], o["kind"]) == ("aten.div", "0.attn", 2,
                                                            "computed")
    assert o["source"] == _line("the injected bug")
    # x/0 makes +-Inf, not NaN (softmax makes the NaN after): the kinds are told apart
    assert o["nan"] == 0 and o["posinf"] > 0 and o["neginf"] > 0
    assert o["values"] == "+Inf/-Inf"
    assert main(["check", str(tmp_path / "run"), "--first-nan", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_nan"]["name"] == "0.attn::aten.div.forward.0.output.0"
    assert main(["check", str(tmp_path / "run"), "--first-nan"]) == 1
    assert capsys.readouterr().out.startswith("first +Inf/-Inf: 0.attn::aten.div.forward.0")


def test_nan_allow_from_config_and_cli(tmp_path, capsys):
    write_step(tmp_path / "r", [
        rec("lse", "forward", "output", torch.tensor([0.0, -math.inf]).numpy(), op="aten.log",
            source="m.py:3"),
        rec("out", "forward", "output", torch.tensor([math.nan]).numpy(), op="aten.mul",
            source="m.py:4"),
    ])
    run = str(tmp_path / "r")
    assert first_nan_origin(run)["name"] == "lse::aten.log.forward.0.output.0"
    o = first_nan_origin(run, nan_allow=["lse::*"])
    assert o["name"] == "out::aten.mul.forward.0.output.0"
    assert o["skipped_values"][0]["why"] == "allowed by nan_allow"
    assert main(["check", run, "--first-nan", "--nan-allow", "lse::*", "--nan-allow",
                 "re:^out::"]) == 0
    assert main(["check", run, "--first-nan", "--nan-allow", "re:("]) == 2
    assert "nan_allow: bad regular expression" in capsys.readouterr().err
    config = tracer.DumpConfig.from_dict({"nan_allow": ["lse::aten.log*"]})
    assert config.nan_allow == ("lse::aten.log*",)
    import h5py

    with h5py.File(tmp_path / "r" / "dump" / "rank0" / "step0.h5", "r+") as f:
        f.attrs["config"] = json.dumps(config.to_dict())  # as the Dumper writes it
    assert first_nan_origin(run)["name"] == "out::aten.mul.forward.0.output.0"
    with pytest.raises(tracer.ConfigError, match="nan_allow: expected a list"):
        tracer.DumpConfig(nan_allow=[3])


def test_nan_in_the_batch_comes_from_outside(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = torch.randn(3, 2, 4)
    batches[2, 1, 3] = float("nan")  # bad data, loaded before the run
    with tracer.Dumper(model, {"path": str(tmp_path), "level": "op", "writer": "sync"}):
        for step in range(3):
            x = batches[step]  # the bad batch enters
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    o = first_nan_origin(tmp_path)
    assert (o["kind"], o["step"], o["module"]) == ("from_outside", 2, "<none>")
    assert o["name"] == "<none>::aten.select.forward.0.input.0"
    assert o["source"] == _line("the bad batch enters") and "the batch" in o["why"]


def test_long_chains_need_no_recursion():
    """A -inf carried through 3000 ops to softmax is absorbed; without softmax it is not."""
    def row(seq, call, direction, neginf, checksum, op="aten.add"):
        return dict(name=f"c{call}::{op}.forward.0.{direction}.0", module=f"c{call}", op=op,
                    phase="forward", direction=direction, index=0, dtype="float32", numel=4,
                    nan=0, posinf=0, neginf=neginf, checksum=checksum, min=0.0, max=0.0,
                    source="m.py:1", seq=seq)

    recs = [row(0, "a", "input", 0, 1), row(1, "a", "output", 1, 100)]
    for i in range(3000):
        recs += [row(len(recs), i, "input", 1, 100 + i), row(len(recs) + 1, i, "output", 1,
                                                             101 + i)]
    recs += [row(len(recs), "s", "input", 1, 3100, "aten._softmax"),
             row(len(recs) + 1, "s", "output", 0, 7, "aten._softmax")]
    assert StepOrigin(recs).find() is None
    recs[-1]["neginf"] = 1  # softmax lets it through: the first -inf counts
    assert StepOrigin(recs).find()["name"] == "ca::aten.add.forward.0.output.0"
