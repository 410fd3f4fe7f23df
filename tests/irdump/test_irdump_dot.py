"""DOT output, collapsing, and SVG rendering with the real Graphviz `dot`."""
from __future__ import annotations

import shutil

import pytest
import torch

import irdump
from irdump._dot import op_color
from irdump_models import Deep, make_tiny


@pytest.fixture(scope="module")
def deep_graph():
    torch.manual_seed(0)
    return irdump.capture_graphs(Deep(levels=5), (torch.randn(2, 4),),
                                 stages=("forward_eager",))[0]


def test_colors_come_from_op_names_only():
    assert op_color("aten.addmm") == op_color("aten.addmm")
    assert op_color("aten.addmm") != op_color("aten.relu")
    assert op_color("aten.addmm").startswith("#") and len(op_color("aten.addmm")) == 7


def test_nested_clusters_and_shape_labels(deep_graph):
    dot = irdump.to_dot(deep_graph)
    assert dot.startswith("// sleuth-ir format_version=1.0\n")
    assert 'label="inner.inner (Deep)"' in dot
    # clusters nest: the depth-2 cluster opens inside the depth-1 one
    assert dot.index('label="inner (Deep)"') < dot.index('label="inner.inner (Deep)"')
    assert '-> ' in dot and 'label="[2,4]"' in dot


def test_depth_option_collapses_deeper_modules(deep_graph):
    dot = irdump.to_dot(deep_graph, depth=2)
    # each level-3 module is one node holding everything below it (3 levels x t, addmm, tanh)
    assert 'label="inner.inner.inner (Deep)\\n8 nodes"' in dot
    assert 'label="inner.inner.fc (Linear)\\n2 nodes"' in dot
    assert "inner.inner.inner::" not in dot and "inner.inner.fc::" not in dot
    assert "inner.fc::aten.addmm.forward.0" in dot  # level 2 stays expanded
    assert 'label="inner.inner (Deep)"' in dot  # as a cluster
    assert dot.count("shape=box3d") == 2
    flat = irdump.to_dot(deep_graph, depth=0)
    assert "subgraph cluster" not in flat and 'label="inner (Deep)\\n' in flat


def test_large_graphs_collapse_automatically(deep_graph):
    dot = irdump.to_dot(deep_graph, max_nodes=10)
    assert "collapsed to module depth 1 automatically" in dot
    assert dot.count("shape=box3d") == 2  # inner.fc and inner.inner
    assert "collapsed" not in irdump.to_dot(deep_graph)


def test_svg_rendered_by_real_dot(tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed")
    paths = irdump.save_graphs(make_tiny(), (torch.randn(2, 16),), tmp_path,
                               formats=("dot", "svg"), stages=("forward_eager",))
    svg = paths[1].read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and svg.rstrip().endswith("</svg>")
    assert "layers.0.fc::aten.addmm.forward.0" in svg
    assert "sleuth&#45;ir format_version=1.0" in svg


def test_missing_dot_is_a_clear_error(deep_graph, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` anywhere
    with pytest.raises(irdump.RenderError, match="install Graphviz"):
        irdump.render_svg(irdump.to_dot(deep_graph))
