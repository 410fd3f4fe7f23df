"""Golden files for the three text formats on a small model.

Refresh with `SLEUTH_UPDATE_GOLDEN=1 python3 -m pytest tests/irdump/test_irdump_golden.py` and
review the diff. The files pin torch's export output for the installed torch version.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import irdump
from irdump_models import make_tiny

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parents[2]
UPDATE = os.environ.get("SLEUTH_UPDATE_GOLDEN") == "1"


@pytest.fixture(scope="module")
def graphs():
    cwd = os.getcwd()
    os.chdir(REPO)  # source paths are relative to the cwd
    try:
        torch.manual_seed(0)
        model = make_tiny()
        x = torch.randn(2, 16)
        return {g.stage: g for g in irdump.capture_graphs(model, (x,))}
    finally:
        os.chdir(cwd)


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"missing golden {path}; create it with SLEUTH_UPDATE_GOLDEN=1"
    expected = path.read_text(encoding="utf-8")
    assert text == expected, f"{name} differs from its golden file; if intended, refresh with " \
        "SLEUTH_UPDATE_GOLDEN=1 and review the diff"


@pytest.mark.parametrize("stage", ["forward", "forward_aten_decomposed", "backward",
                                   "forward_eager"])
def test_golden_formats(graphs, stage):
    g = graphs[stage]
    _check(f"tiny_{stage}.ir", irdump.to_ir(g))
    _check(f"tiny_{stage}.sorted.ir", irdump.to_sorted_ir(g))
    _check(f"tiny_{stage}.dot", irdump.to_dot(g))


def test_golden_sorted_by_op(graphs):
    _check("tiny_forward_eager.by_op.sorted.ir", irdump.to_sorted_ir(graphs["forward_eager"],
                                                                     mode="op"))


def test_header_and_stage_methods(graphs):
    assert graphs["forward"].method == "torch.export"
    assert graphs["forward_aten_decomposed"].method == "torch.export+decompositions"
    assert graphs["backward"].method == "autograd"
    assert graphs["forward_eager"].method == "dispatch"
    text = irdump.to_ir(graphs["forward"])
    assert "# capture: torch.export" in text
    assert "#   parameter layers.0.fc.weight: float32[16,16]" in text
    assert "# parameters: 10 (676 elements)" in text


def test_sorted_has_same_nodes_and_execution_order(graphs):
    g = graphs["forward_eager"]
    ir = irdump.to_ir(g).splitlines()
    sorted_text = irdump.to_sorted_ir(g)
    node_lines = [line for line in ir if line and not line.startswith("#")]
    sorted_lines = [line for line in sorted_text.splitlines() if line and not line.startswith("#")]
    assert sorted(node_lines) == sorted(sorted_lines)
    assert sorted_lines != node_lines  # grouped by module, not execution order
    order = [ln for ln in sorted_text.splitlines() if ln.startswith("# Order: ")][0]
    assert order == "# Order: " + " ".join(str(i) for i in range(len(g.nodes)))


def test_read_ir_round_trip(graphs, tmp_path):
    g = graphs["forward_eager"]
    path = tmp_path / "x.ir"
    path.write_text(irdump.to_ir(g))
    df = irdump.read_ir(path)
    assert list(df.columns[:8]) == ["index", "name", "op", "module", "source", "inputs",
                                    "output_shapes", "output_dtypes"]
    assert df.attrs["stage"] == "forward_eager" and df.attrs["capture"] == "dispatch"
    assert list(df["name"]) == [n.name for n in g.nodes]
    assert list(df["op"]) == [n.op for n in g.nodes]
    assert list(df["module"]) == [n.module for n in g.nodes]
    for row, node in zip(df.itertuples(), g.nodes):
        assert row.inputs == list(node.operands)
        assert row.output_shapes == [t.shape for t in node.output_types]
        assert row.output_dtypes == [t.dtype for t in node.output_types]
        assert row.source == node.source
    sdf = irdump.read_ir(_write(tmp_path / "x.sorted.ir", irdump.to_sorted_ir(g)))
    assert sorted(sdf["index"]) == list(df["index"])


def test_read_backward_links(graphs, tmp_path):
    df = irdump.read_ir(_write(tmp_path / "b.ir", irdump.to_ir(graphs["backward"])))
    fwd = set(n.name for n in graphs["forward_eager"].nodes)
    linked = df[df["forward"] != ""]
    assert len(linked) >= 10
    assert set(linked["forward"]) <= fwd


def test_read_ir_rejects_other_files(tmp_path):
    with pytest.raises(irdump.IrFormatError, match="not a sleuth IR file"):
        irdump.read_ir(_write(tmp_path / "a.ir", "hello\n"))
    with pytest.raises(irdump.IrFormatError, match="format_version 2.0"):
        irdump.read_ir(_write(tmp_path / "b.ir", "# sleuth-ir format_version=2.0\n"))


def test_format_pinned_by_checked_in_file():
    # a file written by format 1.0: later versions must still read it
    df = irdump.read_ir(GOLDEN / "tiny_backward.ir")
    assert df.attrs["format_version"] == "1.0"
    assert (df["op"] == "AccumulateGrad").sum() == 10


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
