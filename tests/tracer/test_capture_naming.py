"""Record names, call counters and user source lines (pure helpers of the capture side)."""
from __future__ import annotations

import torch
import torch.nn as nn

from tracer.capture._naming import CallCounter, module_names, op_name, op_scope, record_name
from tracer.capture._source import user_source


def test_record_name_format():
    assert record_name("layers.0.attn", "forward", 0, "output", 0) == \
        "layers.0.attn.forward.0.output.0"
    assert record_name(op_scope("layers.0.attn", "aten.mm"), "forward", 2, "input", 1) == \
        "layers.0.attn::aten.mm.forward.2.input.1"
    assert record_name("layers.0.attn.qkv.weight", "optimizer", 0, "grad", 0) == \
        "layers.0.attn.qkv.weight.optimizer.0.grad.0"


def test_op_name_is_the_overload_packet():
    assert op_name(torch.ops.aten.mm.default) == "aten.mm"
    assert op_name(torch.ops.aten.add.Tensor) == "aten.add"
    assert op_name(torch.ops.aten.add_.Tensor) == "aten.add_"


def test_module_names_root_and_shared_modules():
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    names = module_names(model)
    assert names[model] == "<root>" and names[shared] == "0" and len(names) == 3
    assert module_names(model, "<root1>")[shared] == "<root1>.0"


def test_call_counter_counts_per_scope_and_phase():
    c = CallCounter()
    assert [c.next("fc", "forward"), c.next("fc", "forward"), c.next("fc", "backward")] == [0, 1, 0]
    assert c.peek("fc", "forward") == 2
    c.reset()
    assert c.next("fc", "forward") == 0


def helper_inside_user_code():
    return user_source(1)


def test_user_source_points_at_this_file_relative_to_cwd(monkeypatch, tmp_path):
    src = helper_inside_user_code()
    path, line = src.rsplit(":", 1)
    assert path.endswith("test_capture_naming.py") and int(line) > 0
    # frames inside torch are skipped: a module's forward called through nn.Module.__call__
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(user_source(1))
            return x

    Probe()(torch.zeros(1))  # PROBE LINE
    with open(__file__) as f:
        lines = f.read().splitlines()
    assert "seen.append" in lines[int(seen[0].rsplit(":", 1)[1]) - 1]
