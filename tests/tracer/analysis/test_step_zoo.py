"""The training-step zoo (step_zoo.py): a bug around the model in run B must be named as what it
is: the setup difference first in `sleuth diff` (and no setup difference where there is
none), and `sleuth explain`'s verdict naming the hyperparameter, group, clipping call, frozen
parameter, buffer, constant or seed, or the op and line of a bug in the loop. The fast lane
(`-m "not slow"`) runs each class but `SWEPT_ONLY` once, at level op on the plain MLP; the
`slow` sweep, which CI runs, the MLP at level mix too and the Llama and the GPT-2 at one level
each (the generator picks which)."""
from __future__ import annotations

import re
import zlib
from pathlib import Path

import pytest

from step_zoo import CONSTANT, DROPOUT, FAULTS, Case, fault_line, families_for, train

pytest.importorskip("transformers")

ALL = [Case(f, fault, level) for fault in FAULTS for f in families_for(fault)
       for level in ("op", "mix")]


HOME = "mlp"
"""The family every class runs on in the fast lane (and at both levels): the plain token MLP,
whose step costs a tenth of a Hugging Face model's."""


# classes the quick lane leaves to the sweep: it is at its time bound, and each costs a run
SWEPT_ONLY = frozenset({"fp16", "fp16_bug", "buffer_written", "bf16_grad_hook",
                        "frozen_clipped", "cleared_between", "scaler_only", "tied"})


def _fast(case: Case) -> bool:
    return case.level == "op" and case.family == HOME and case.fault not in SWEPT_ONLY


def _swept(case: Case) -> bool:
    """Each class at both levels on its home family; the other families at one level each,
    picked by the generator (both levels of every family cost twice the time and find the
    same: the level changes what is recorded, the family what is computed)."""
    if case.family == HOME:
        return True
    return case.level == ("op", "mix")[zlib.crc32(f"{case.family}/{case.fault}".encode()) % 2]


CASES = [pytest.param(c, id=c.id, marks=() if _fast(c) else pytest.mark.slow)
         for c in ALL if _swept(c)]
_REFERENCES: dict[tuple, Path] = {}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Run A of each (family, optimizer, level, clips, steps), made once for the cases that
    share it."""
    root = tmp_path_factory.mktemp("step_zoo")

    def get(case: Case) -> Path:
        key = (case.family, case.optimizer, case.level, case.clips, case.steps, case.dumped)
        if key not in _REFERENCES:
            path = root / "-".join(map(str, key))
            train(case, False, path)
            _REFERENCES[key] = path
        return _REFERENCES[key]

    return get


def _pattern(name: str) -> str:
    """A parameter's name as the setup words it among others alike (block numbers as `*`)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


@pytest.mark.parametrize("case", CASES)
def test_the_step_fault_is_named_as_what_it_is(case: Case, references, tmp_path) -> None:
    from tracer.analysis import diff, explain

    a = references(case)
    b = tmp_path / "b"
    picked = train(case, True, b)
    expect = FAULTS[case.fault]
    res = diff(a, b)
    assert res.status == "diverged", res.status
    kinds = [c["kind"] for c in res.changes]
    e = explain(a, b)
    setup = [d["text"] for c in res.changes if c["kind"] == "setup" for d in c["differences"]]
    where = f"{case.id} {picked}: diff {kinds} {setup} {(res.first_divergence or {}).get('name')}; {e.verdict}"
    assert (kinds[:1] == ["setup"]) == expect.setup, where
    assert e.status == expect.status, where
    v = e.verdict
    f = case.fault
    if f == "hyper":
        assert f"{picked['key']} " in v and " in A, " in v, where
    elif f == "group_decay":
        assert "weight_decay 0 in A, 0.2 in B" in v, where
    elif f == "group_moved":
        assert "weight_decay 0 in A, 0.1 in B" in v and \
            (picked["site"] in v or _pattern(picked["site"]) in v), where
    elif f == "scheduler":
        assert " lr 0.01 in A, 0.005 in B (every parameter)" in v, where
    elif f == "clip_only_b":
        assert "B clips gradients (clip_grad_norm_, max_norm 0.5" in v, where
        assert f"step_zoo.py:{fault_line('clip_only_b')}" in v, where
    elif f == "clip_norm":
        assert "max_norm 0.5 in A, 0.05 in B" in v, where
    elif f in ("frozen", "frozen_clipped", "frozen_first"):
        assert "B freezes" in v and (picked["site"] in v or _pattern(picked["site"]) in v), \
            where
    elif f == "buffer":
        assert "buffer" in v and (picked["site"] in v or _pattern(picked["site"]) in v), where
    elif f == "dropout":
        key = next(iter(DROPOUT[case.family]))
        assert any(d["kind"] in ("config", "module") for d in e.setup), where
        assert key in v or " p 0 in A, 0.2 in B" in v, where
    elif f == "seed":
        assert "seed 0 in A, 1 in B" in v, where
    elif f == "constant":
        key = next(iter(CONSTANT[case.family]))
        texts = " ".join(d["text"] for d in e.setup)
        assert key in texts or "eps" in texts, where
        assert e.blamed is not None and "arguments" in v, where
    elif f == "bf16":
        assert "bfloat16" in v, where
    elif f in ("bf16_bug", "fp16_bug", "bf16_grad_hook"):
        assert "rounding is present too" in v, where
    elif f == "fp16":
        assert "float16" in v, where
    elif f == "data_order":
        # the batch's fingerprint says which input differs: the model's own batch
        assert "the batch differs: the model's call 0 is given input_ids" in v, where
    elif f == "tied":
        assert " ties " in v and "(one tensor under both names)" in v, where
    elif f == "scaler_only":
        assert "B scales the loss with a GradScaler" in v and "is the loss it scales" in v, where
        assert "the optimizer's updates agree" in v and "bug" not in v, where
    elif f == "cleared_between":
        assert "B clears gradients between backward passes" in v, where
    elif f == "grad_edit":
        assert "written in place" in v and "writing the gradient of " in v, where
    elif f == "buffer_written":
        assert e.blamed is not None and e.blamed.get("fault") == "written", where
        assert "writing buffer " in v and picked["site"] in v, where
    elif f == "inplace_hook":
        assert e.blamed is not None and e.blamed.get("fault") == "written", where
        assert picked["site"] in v, where
    if f.startswith("fp16"):
        # B alone scales its loss: the setup says so, and the scaler's ops are no bug
        assert setup[:1] and setup[0].startswith("B scales the loss with a GradScaler"), where
    if expect.op_line:
        line = f"step_zoo.py:{fault_line(case.fault)}"
        blamed = e.blamed or {}
        assert str(blamed.get("source", "")).endswith(line) or \
            str(blamed.get("caller", "")).endswith(line) or line in v, where
    if not expect.setup:
        assert not e.setup, where


@pytest.mark.slow  # the quick lane runs the zoo's frozen_first on the MLP
@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
def test_a_weight_frozen_in_one_run_is_never_same(tmp_path, clip) -> None:
    """AdamW, one step dumped: B's frozen weight has no gradient and no update, and every
    record both runs make agrees. A "same" there sent the user away; the records one run alone
    makes are the divergence, and the frozen weight its cause."""
    import torch
    from torch import nn

    import tracer
    from tracer.analysis import diff, explain

    def run(path: Path, freeze: bool) -> Path:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        if freeze:
            model[0].weight.requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        with tracer.Dumper(model, {"path": str(path), "level": "op", "mode": "tensor",
                                   "steps": "0"}):
            model(x).square().mean().backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        return path

    a, b = run(tmp_path / "a", False), run(tmp_path / "b", True)
    res = diff(a, b)
    assert res.status == "diverged" and res.exit_code == 1, res.notes
    e = explain(a, b)
    assert e.status == "setup" and "B freezes 0.weight (requires_grad False)" in e.verdict, \
        e.verdict
