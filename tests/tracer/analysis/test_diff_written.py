"""A weight written in place during a step (a forward pre-hook's `weight.mul_`, a manual update,
a `copy_` into it) is named by `sleuth diff` and `sleuth explain` as the op and line that wrote
it (kind "written", fault "written"), never as weights the step began with ("began step 0 with
different weights", "inputs differ"): the optimizer's param records are taken when
`optimizer.step()` begins, after the write (tracer.analysis._written)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import tracer
from fault_zoo import FAMILIES, VOCAB
from sleuth.cli import main
from tracer.analysis import diff, explain

HERE = "tests/tracer/analysis/test_diff_written.py"


def _line(text: str) -> str:
    lines = Path(__file__).read_text().splitlines()
    return f"{HERE}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        # reads fc2's weight before its pre-hook writes it: those records must agree
        penalty = self.fc2.weight.sum()
        return self.fc2(h).square().mean() + 1e-3 * penalty


def _scale(factor: float):
    def hook(module: nn.Module, args: tuple) -> None:
        with torch.no_grad():
            module.weight.mul_(factor)  # THE WRITE
    return hook


def _train(model, path: Path, level: str, mode: str, optimizer: str, loss,
           after_backward=None, steps: int = 2, config: dict | None = None) -> Path:
    """`model` (or what it returns, called inside the dump: the model built in its first step,
    as under `sleuth run`) trained `steps` steps, each step dumped (`config`: more keys)."""
    with tracer.Dumper(model if isinstance(model, nn.Module) else None,
                       {"path": str(path), "level": level, "mode": mode, "steps": "all",
                        **(config or {})}):
        if not isinstance(model, nn.Module):
            model = model()
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        for _ in range(steps):
            loss(model).backward()
            if after_backward is not None:
                after_backward(model)
            opt.step()
            opt.zero_grad()
    return path


def _mlp(path: Path, level: str, mode: str, optimizer: str = "adamw", factor: float | None = None,
         after_backward=None, built_in_step: bool = False, config: dict | None = None) -> Path:
    def build() -> Net:
        torch.manual_seed(0)
        model = Net()
        if factor is not None:
            model.fc2.register_forward_pre_hook(_scale(factor))
        return model

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return _train(build if built_in_step else build(), path, level, mode, optimizer,
                  lambda m: m(x), after_backward, config=config)


def _nudge(model: nn.Module) -> None:
    with torch.no_grad():
        model.fc1.bias.add_(1e-3)  # THE MANUAL UPDATE


def _hf(family: str, path: Path, level: str, mode: str, hook: bool) -> Path:
    """A Hugging Face model of the fault zoo's families, built from its config."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = FAMILIES[family]()
    if hook:
        def scale(module: nn.Module, args: tuple) -> None:
            module.weight.data.mul_(1.001)  # THE HF WRITE
        model.model.layers[1].mlp.up_proj.register_forward_pre_hook(scale)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    return _train(model, path, level, mode, "adamw",
                  lambda m: m(input_ids=ids, labels=ids).loss, steps=1)


def _assert_named(a: Path, b: Path, param: str, op: str, module: str, line: str,
                  written_by: str, capsys, cli: bool = True) -> None:
    """diff's changes and first divergence and explain's verdict, and with `cli` the headline
    and both commands' --json, all name the write."""
    res = diff(a, b)
    fd = res.first_divergence
    assert fd["kind"] == "written" and fd["step"] == 0, fd
    assert fd["written"]["param"] == param and fd["written"]["op"] == op
    assert fd["written"]["module"] == module and fd["written"]["source"] == line
    assert fd["written"]["written_by"] == written_by
    (ch,) = [c for c in res.changes if c["kind"] == "written"]
    assert (ch["param"], ch["op"], ch["source"], ch["step"]) == (param, op, line, 0)
    assert not any(c["kind"] == "parameter" for c in res.changes)
    # every record before the first divergence agrees: the weight as read before the write too
    rows = res.records
    first = rows.index[rows["name"] == fd["name"]][0]
    before = rows[rows["order"] < rows.loc[first, "order"]]
    assert (before["verdict"] != "diverged").all()

    e = explain(a, b)
    assert e.status == "bug" and e.exit_code == 1, e.verdict
    assert e.blamed["fault"] == "written" and e.blamed["op"] == op
    assert e.blamed["module"] == module and e.blamed["source"] == line
    assert e.blamed["param"] == param
    assert e.verdict.startswith(f"bug: written in place: {op} at {line}")
    assert module in e.verdict and param in e.verdict and "inputs differ" not in e.verdict
    if not cli:
        return
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "different weights" not in out and "first divergence (written)" in out
    assert f"wrote {param} in place during step 0" in out and f"{op} at {line}" in out
    assert main(["diff", str(a), str(b), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_divergence"]["kind"] == "written"
    assert [c["kind"] for c in doc["changes"]] == ["written"]
    assert main(["explain", str(a), str(b), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["blamed"]["fault"] == "written"


@pytest.mark.parametrize("level,mode,optimizer", [
    ("op", "tensor", "adamw"), ("op", "statistics", "sgd"), ("mix", "tensor", "sgd"),
    ("mix", "statistics", "adamw")])
def test_a_pre_hook_that_scales_a_weight_is_named_with_its_line(tmp_path, capsys, level, mode,
                                                                 optimizer):
    a = _mlp(tmp_path / "a", level, mode, optimizer)
    b = _mlp(tmp_path / "b", level, mode, optimizer, factor=1.001)
    _assert_named(a, b, "fc2.weight", "aten.mul_", "fc2", _line("# THE WRITE"), "B", capsys)
    # the step after: the weights differ when it begins (step 0 wrote them), written or not
    later = diff(a, b, step=1).first_divergence
    assert later["kind"] == "parameter" and later["direction"] == "param", later


class Wide(Net):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 128), nn.Linear(128, 4)  # fc2.weight: 512 elements


@pytest.mark.parametrize("mode", [pytest.param("tensor", marks=pytest.mark.slow), "statistics"])
def test_a_weight_doubled_is_named_though_its_checksum_is_unchanged(tmp_path, capsys, mode):
    # doubling a float32 adds 2**23 to its bits: over 512 elements the checksum (the bits' sum,
    # wrapped to 32 bits) moves by 2**32, so only the extremes tell the two values apart
    def build(factor: float | None) -> Callable[[], Wide]:
        def made_in_the_step() -> Wide:
            torch.manual_seed(0)
            model = Wide()
            if factor is not None:
                with torch.no_grad():
                    model.fc2.weight.mul_(factor)  # THE INIT WRITE
            return model
        return made_in_the_step

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    a = _train(build(None), tmp_path / "a", "op", mode, "adamw", lambda m: m(x), steps=1)
    b = _train(build(2.0), tmp_path / "b", "op", mode, "adamw", lambda m: m(x), steps=1)
    rows = tracer.open_dump(b).stats(0, 0)
    write = rows[rows["name"].str.startswith("<none>::aten.mul_.forward.0.")]
    assert write["checksum"].nunique() == 1 and len(write) == 2, "the collision this test is about"
    _assert_named(a, b, "fc2.weight", "aten.mul_", "<none>", _line("# THE INIT WRITE"), "B", capsys)
    assert "forged" not in " ".join(diff(a, b).records["reason"].astype(str))


def test_a_write_in_every_step_is_named_when_the_dump_begins_after_it(tmp_path):
    # dumped from step 1: the weights already differ as the dump begins, and the write only
    # B makes, in that step too, is where they parted
    a = _mlp(tmp_path / "a", "op", "statistics", config={"steps": "1"})
    b = _mlp(tmp_path / "b", "op", "statistics", factor=1.001, config={"steps": "1"})
    e = explain(a, b)
    assert e.status == "inputs" and "the weights differ" in e.verdict, e.verdict
    assert f"B also writes in place in this step what the other run does not (aten.mul_ at " \
           f"{_line('# THE WRITE')})" in e.verdict, e.verdict


def test_a_model_built_in_the_dumped_step_is_no_write_of_its_weights(tmp_path, capsys):
    """Under `sleuth run` the first step builds the model: both runs' initialisations write
    every weight (`aten.uniform_`), alike, before the write that differs."""
    a = _mlp(tmp_path / "a", "op", "statistics", built_in_step=True)
    b = _mlp(tmp_path / "b", "op", "statistics", factor=1.001, built_in_step=True)
    _assert_named(a, b, "fc2.weight", "aten.mul_", "fc2", _line("# THE WRITE"), "B", capsys)


def test_both_runs_writing_other_values_name_the_write_itself(tmp_path, capsys):
    a = _mlp(tmp_path / "a", "op", "statistics", factor=1.002)
    b = _mlp(tmp_path / "b", "op", "statistics", factor=1.001)
    _assert_named(a, b, "fc2.weight", "aten.mul_", "fc2", _line("# THE WRITE"), "both", capsys)
    assert diff(a, b).first_divergence["name"] == "fc2::aten.mul_.forward.0.output.0"


def test_a_manual_update_between_backward_and_step_is_named(tmp_path, capsys):
    a = _mlp(tmp_path / "a", "op", "statistics", "sgd")
    b = _mlp(tmp_path / "b", "op", "statistics", "sgd", after_backward=_nudge)
    _assert_named(a, b, "fc1.bias", "aten.add_", "<none>", _line("# THE MANUAL UPDATE"), "B",
                  capsys)


def test_a_write_into_part_of_a_weight_is_no_claim_of_other_weights(tmp_path, capsys):
    """A slice's values are not the weight's, so the write is not tied to it by values; but a
    write the runs made differently comes before anything else differs: never "began step 0
    with different weights" nor "inputs differ"."""
    def row(module: nn.Module, args: tuple) -> None:
        with torch.no_grad():
            module.weight[0].mul_(1.5)  # THE SLICE WRITE

    def build() -> Net:
        torch.manual_seed(0)
        return Net()

    a = _mlp(tmp_path / "a", "op", "statistics")
    model = build()
    model.fc1.register_forward_pre_hook(row)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    b = _train(model, tmp_path / "b", "op", "statistics", "adamw", lambda m: m(x))
    fd = diff(a, b).first_divergence
    assert fd["kind"] == "parameter" and fd["when"] == "unmatched", fd
    assert fd["write"]["op"] == "aten.mul_" and fd["write"]["source"] == _line("# THE SLICE")
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "began step" not in out and "wrote in place differently: aten.mul_" in out
    e = explain(a, b)
    assert e.status == "unexplained" and "aten.mul_" in e.verdict, e.verdict


@pytest.mark.parametrize("io", ["input", "output"])
def test_a_write_whose_other_side_was_not_dumped_is_no_claim_of_other_weights(tmp_path, io):
    """With one side of each call dumped (`io`), a write cannot be followed back to the weight
    it wrote; it is named as a write the runs made differently, never "began with other
    weights"."""
    a = _mlp(tmp_path / "a", "op", "statistics", "sgd", config={"io": io})
    b = _mlp(tmp_path / "b", "op", "statistics", "sgd", factor=1.001, config={"io": io})
    fd = diff(a, b).first_divergence
    assert fd["kind"] == "parameter" and fd["when"] == "unmatched", fd
    assert fd["write"]["op"] == "aten.mul_" and fd["write"]["source"] == _line("# THE WRITE")


def test_a_module_dump_does_not_claim_the_step_began_with_other_weights(tmp_path, capsys):
    a = _mlp(tmp_path / "a", "module", "statistics")
    b = _mlp(tmp_path / "b", "module", "statistics", factor=1.001)
    fd = diff(a, b).first_divergence
    assert fd["kind"] == "parameter" and fd["when"] == "unknown"
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "began step" not in out and "cannot tell" in out
    e = explain(a, b)
    assert e.status == "unexplained" and "cannot tell" in e.verdict
    assert "inputs differ" not in e.verdict

    # written after its module's forward read it: the module records date it to the step
    c = _mlp(tmp_path / "c", "module", "statistics", after_backward=_nudge)
    fd = diff(a, c).first_divergence
    assert fd["name"] == "fc1.bias.optimizer.0.param.0" and fd["when"] == "in_step"
    assert main(["diff", str(a), str(c)]) == 1
    assert "changed during step 0 after that forward read it" in capsys.readouterr().out


@pytest.mark.parametrize("family,level,mode", [("llama", "op", "statistics"),
                                               ("mistral", "mix", "tensor")])
def test_a_hugging_face_mlp_weight_a_pre_hook_scales(tmp_path, capsys, family, level, mode):
    pytest.importorskip("transformers")
    a = _hf(family, tmp_path / "a", level, mode, hook=False)
    b = _hf(family, tmp_path / "b", level, mode, hook=True)
    up = "model.layers.1.mlp.up_proj"
    # the commands' words are held to it on the small model: here the records' verdicts
    _assert_named(a, b, f"{up}.weight", "aten.mul_", up, _line("# THE HF WRITE"), "B", capsys,
                  cli=False)


@pytest.mark.filterwarnings("ignore:.*belong to no step")  # the EMA after the last step
def test_a_manual_update_after_the_step_beside_an_ema_is_a_write_not_data(tmp_path):
    """`head.bias.data.add_` after `optimizer.step()` in B alone, an EMA of the weights in
    both: those in-place ops run before the next step's first model call, where the batch is
    made; they update what they hold, so they are a write, never "fed different data"."""
    def run(path, nudge):
        torch.manual_seed(0)
        model = Net()
        ema = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(1)
        with tracer.Dumper(model, {"path": str(path), "level": "mix", "mode": "tensor",
                                   "steps": "all"}):
            for _ in range(2):
                model(torch.randn(4, 8, generator=data)).backward()
                opt.step()
                opt.zero_grad()
                if nudge:
                    model.fc2.bias.data.add_(0.01)  # THE LATE UPDATE
                for e, p in zip(ema, model.parameters()):
                    e.mul_(0.9).add_(p.data, alpha=0.1)

    run(tmp_path / "a", False)
    run(tmp_path / "b", True)
    res = diff(tmp_path / "a", tmp_path / "b")
    assert res.first_divergence["kind"] == "written", res.first_divergence
    (ch,) = [c for c in res.changes if c["kind"] == "written"]
    assert ch["param"] == "fc2.bias" and ch["source"] == _line("# THE LATE UPDATE")
    assert not any(c["kind"] == "data" for c in res.changes)
