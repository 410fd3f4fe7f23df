"""The Diff page on damaged dumps: files not fully read are named in an error panel and the
status is never "same"; the worst-records table puts records without a partner last."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tracer"))
from models import MLP, train_and_dump  # noqa: E402

from dashboard._context import Context  # noqa: E402
from dashboard._page_diff import body, worst  # noqa: E402
from dashboard._runs import load_runs  # noqa: E402


def _texts(component) -> list[tuple[str | None, str]]:
    """(id, text) of every component under `component`, depth first."""
    out = []

    def walk(c, owner=None):
        if c is None:
            return
        if isinstance(c, (list, tuple)):
            for x in c:
                walk(x, owner)
            return
        if isinstance(c, (str, int, float)):
            out.append((owner, str(c)))
            return
        cid = getattr(c, "id", None)
        walk(getattr(c, "children", None), cid or owner)

    walk(component)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffpage")
    for name in ("a", "b"):
        train_and_dump(MLP, lambda: (torch.randn(4, 8),), root / name, steps=3,
                       level="module", mode="tensor", writer="sync")
    return root


def test_damaged_run_shows_error_panel_never_same(runs, tmp_path):
    damaged = tmp_path / "c"
    shutil.copytree(runs / "b", damaged)
    step1 = damaged / "dump" / "rank0" / "step1.h5"
    with open(step1, "r+b") as f:
        f.truncate(4000)
    (damaged / "dump" / "rank0" / "step2.h5").unlink()
    ctx = Context(runs=load_runs([runs / "a", damaged]))
    texts = _texts(body(ctx, 0, 1, 0, None, None, None))
    status = [t for i, t in texts if i == "diff-status"]
    assert status == ["status: incomplete"], texts
    panel = " ".join(t for i, t in texts if i == "diff-problems")
    assert str(step1) in panel and "truncated" in panel
    assert str(damaged / "dump" / "rank0" / "step2.h5") in panel and "missing" in panel
    # the same runs undamaged: "same", no panel
    ctx = Context(runs=load_runs([runs / "a", runs / "b"]))
    texts = _texts(body(ctx, 0, 1, 0, None, None, None))
    assert [t for i, t in texts if i == "diff-status"] == ["status: same"]
    assert not [t for i, t in texts if i == "diff-problems"]


def test_unreadable_everywhere_is_an_error_panel(runs, tmp_path):
    damaged = tmp_path / "c"
    shutil.copytree(runs / "b", damaged)
    for f in (damaged / "dump" / "rank0").glob("step*.h5"):
        f.rename(f.with_name(f.name + ".partial"))
    ctx = Context(runs=load_runs([runs / "a", damaged]))
    texts = _texts(body(ctx, 0, 1, 0, None, None, None))
    panel = " ".join(t for i, t in texts if i == "diff-problems")
    assert "step0.h5.partial" in panel and "no readable complete step file" in panel, texts


def test_a_setup_difference_heads_the_page(runs, tmp_path):
    """Run B's optimizer had another learning rate: the page names it above the records."""
    train_and_dump(MLP, lambda: (torch.randn(4, 8),), tmp_path / "lr", steps=3,
                   level="module", mode="tensor", writer="sync", lr=0.07)
    ctx = Context(runs=load_runs([runs / "a", tmp_path / "lr"]))
    texts = _texts(body(ctx, 0, 1, 0, None, None, None))
    panel = " ".join(t for i, t in texts if i == "diff-setup")
    assert "SGD lr 0.05 in A, 0.07 in B (every parameter)" in panel, texts
    ctx = Context(runs=load_runs([runs / "a", runs / "b"]))
    assert not [t for i, t in _texts(body(ctx, 0, 1, 0, None, None, None)) if i == "diff-setup"]


def test_worst_puts_unpartnered_rows_after_divergences():
    nan = float("nan")
    rec = pd.DataFrame({
        "order": [0, 1, 2, 3, 4], "step": [0, 0, 0, 1, 1],
        "name": ["only", "big", "nanrow", "same", "small"],
        "verdict": ["only_b", "diverged", "diverged", "same", "diverged"],
        "max_rel_err": [nan, 0.5, float("inf"), 0.0, 0.01],
        "nan_diff": [nan, 0, 3, 0, 0], "inf_diff": [nan, 0, 0, 0, 0]})
    assert worst(rec)["name"].tolist() == ["nanrow", "big", "small", "same", "only"]


class AutocastMLP(MLP):
    """The same MLP (the same record names) run under bf16 autocast."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x)


def test_worst_records_of_fp32_against_bf16_rank_by_error(tmp_path):
    def batch():
        return (torch.randn(4, 8),)

    for name, model in (("a", MLP), ("b", AutocastMLP)):
        train_and_dump(model, batch, tmp_path / name, steps=1, level="mix", mode="statistics",
                       writer="sync")
    ctx = Context(runs=load_runs([tmp_path / "a", tmp_path / "b"]))
    result = body(ctx, 0, 1, 0, None, None, None)
    rows = next(c for c in result if getattr(c, "id", None) == "diff-table").data
    verdicts = [r["verdict"] for r in rows]
    diverged = [r for r in rows if r["verdict"] == "diverged"]
    assert len(diverged) > 3 and verdicts[:len(diverged)] == ["diverged"] * len(diverged)
    # by the one number per record, worst first; never a pair of two unlike records
    errors = [r["error"] for r in diverged]
    assert all(isinstance(e, float) for e in errors), errors
    assert errors == sorted(errors, reverse=True), errors
    from tracer import diff

    records = diff(tmp_path / "a", tmp_path / "b", step=0).records
    paired = records[records["verdict"].isin(["same", "diverged"])]
    assert (paired["shape"] == paired["b_shape"]).all()
    # B's casts have no partner: listed last, never among the divergences
    verdicts = worst(records, len(records))["verdict"].tolist()
    unpaired = [i for i, v in enumerate(verdicts) if v in ("only_a", "only_b")]
    assert unpaired and unpaired == list(range(len(verdicts) - len(unpaired), len(verdicts)))
