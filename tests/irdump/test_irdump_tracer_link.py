"""IR node names equal the tracer's op record stems: a diff's first divergence is in the graph."""
from __future__ import annotations

import pytest
import torch

import irdump
from irdump_models import make_tiny


def _tracer_api():
    try:
        from tracer import Dumper, open_dump
    except (ImportError, AttributeError) as e:
        pytest.skip(f"tracer.Dumper / tracer.open_dump are not importable yet ({e}); this test "
                    "runs once the tracer's op-level capture lands")
    return Dumper, open_dump


def test_every_forward_op_record_has_a_graph_node(tmp_path):
    Dumper, open_dump = _tracer_api()
    torch.manual_seed(0)
    model = make_tiny()
    x = torch.randn(2, 16)
    graphs = {g.stage: g for g in irdump.capture_graphs(model, (x,),
                                                        stages=("backward", "forward_eager"))}
    nodes = {n.name for n in graphs["forward_eager"].nodes}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Dumper(model, {"path": str(tmp_path), "level": "op", "writer": "sync"}):
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
    stats = open_dump(tmp_path).stats(rank=0, step=0)
    ops = stats[(stats["op"] != "") & (stats["phase"] == "forward")
                & (stats["module"] != "<none>")]  # the loss runs outside the model
    stems = {name.rsplit(".", 2)[0] for name in ops["name"]}
    assert stems, "the tracer recorded no forward op inside the model"
    missing = sorted(stems - nodes)
    assert not missing, f"op records without a graph node: {missing[:10]}"
    # and each backward node's forward link is a name the tracer uses too
    linked = {n.forward for n in graphs["backward"].nodes if n.forward}
    assert linked <= stems | {n for n in nodes if "::aten.detach." in n}
