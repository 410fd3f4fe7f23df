"""Capture: fallback on data-dependent control flow, backward links, no side effects, API."""
from __future__ import annotations

import pytest
import torch

import irdump
from irdump_models import Branchy, TinyNet, make_branchy


def test_fallback_on_data_dependent_control_flow(tmp_path):
    model = make_branchy()
    x = torch.ones(2, 8)
    paths = irdump.save_graphs(model, (x,), tmp_path, formats=("ir",),
                               stages=("forward", "forward_aten_decomposed"))
    assert [p.name for p in paths] == ["00_forward.ir", "01_forward_aten_decomposed.ir"]
    text = paths[0].read_text()
    assert "# capture: dispatch" in text
    assert "# note: torch.export failed:" in text and "fell back to one traced call" in text
    df = irdump.read_ir(paths[0])
    # the branch actually taken (x.sum() > 0) is in the graph, the other one is not
    assert "a::aten.addmm.forward.0" in set(df["name"])
    assert not (df["module"] == "b").any()
    assert df.attrs["capture"] == "dispatch"


def test_backward_nodes_link_to_forward_nodes():
    torch.manual_seed(0)
    model = TinyNet()
    graphs = {g.stage: g for g in irdump.capture_graphs(model, (torch.randn(2, 16),),
                                                        stages=("backward", "forward_eager"))}
    fwd = {n.name: n for n in graphs["forward_eager"].nodes}
    bwd = graphs["backward"]
    linked = [n for n in bwd.op_nodes if n.forward]
    assert all(n.forward in fwd for n in linked)
    by_op = {n.op: n for n in linked}
    assert by_op["AddmmBackward0"].forward.endswith("::aten.addmm.forward.0")
    # gradient shapes match the shapes of the forward tensors they belong to
    for n in linked:
        assert n.input_types[0] == fwd[n.forward].output_types[0]
        assert n.module == fwd[n.forward].module
    acc = [n for n in bwd.op_nodes if n.op == "AccumulateGrad"]
    assert sorted(dict(n.attrs)["param"] for n in acc) == sorted(
        name for name, _ in model.named_parameters())
    # every edge goes from an earlier node to a later one (execution order)
    index = {n.name: n.index for n in bwd.nodes}
    for n in bwd.nodes:
        for ref in n.operands:
            assert index[ref.split("#")[0]] < n.index


def test_capture_leaves_model_rng_and_grads_untouched():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 4)
    state = torch.get_rng_state()
    irdump.capture_graphs(model, (x,))
    assert torch.equal(torch.get_rng_state(), state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_kwargs_and_multiple_outputs():
    class TwoOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x, scale=None):
            y = self.fc(x)
            return y, y * scale

    g = irdump.capture_graphs(TwoOut(), {"x": torch.randn(2, 3), "scale": torch.ones(2, 3)},
                              stages=("forward",))[0]
    names = [n.name for n in g.nodes]
    assert names[:2] == ["<root>.forward.0.input.0", "<root>.forward.0.input.1"]
    assert len(g.nodes[-1].operands) == 2


def test_unknown_stage_and_format_suggest_the_closest():
    with pytest.raises(irdump.IrDumpError, match="did you mean 'backward'"):
        irdump.capture_graphs(Branchy(), (torch.ones(1, 8),), stages=("backwards",))
    g = irdump.capture_graphs(Branchy(), (torch.ones(1, 8),), stages=("forward_eager",))
    with pytest.raises(irdump.IrDumpError, match="did you mean 'sorted'"):
        from irdump._save import write_graphs
        write_graphs(g, "/nonexistent", formats=("sortd",))
    with pytest.raises(irdump.IrDumpError, match="unknown sort mode"):
        irdump.to_sorted_ir(g[0], mode="size")  # type: ignore[arg-type]


def test_list_graphs(tmp_path):
    irdump.save_graphs(make_branchy(), torch.ones(1, 8), tmp_path / "ir",
                       formats=("ir", "dot"), stages=("backward", "forward_eager"))
    (tmp_path / "ir" / "02_backward.ir.partial").write_text("left by a crash")
    df = irdump.list_graphs(tmp_path)
    assert list(df.columns) == ["stage", "name", "ir", "sorted_ir", "dot", "svg"]
    assert list(df["stage"]) == [2, 3]
    assert list(df["name"]) == ["backward", "forward_eager"]
    assert df["ir"][0].endswith("02_backward.ir") and df["svg"][0] is None
    assert df["sorted_ir"].isna().all()
    assert irdump.list_graphs(tmp_path / "missing").empty


def test_sort_mode_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEUTH_SAVE_GRAPHS_SORT_MODE", "op")
    paths = irdump.save_graphs(make_branchy(), torch.ones(1, 8), tmp_path, formats=("sorted",),
                               stages=("forward_eager",))
    text = paths[0].read_text()
    assert "# sort: op" in text and "# op aten.addmm" in text
