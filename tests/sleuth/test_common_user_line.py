"""One rule for the user's line (`sleuth.common.frame_kind`, `short_path`): an op of a Hugging
Face model gets the same line from a dump and from a profile, and no tool ever names a frame of
Sleuth's own packages as the user's."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import profiler
import tracer
from sleuth.common import INTERNAL, LIBRARY, USER, frame_kind, short_frame_kind, short_path

REPO = Path(__file__).resolve().parents[2]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
        use_cache=False, attn_implementation="eager")).eval()


def _short(site: str) -> str:
    path, _, line = site.rpartition(":")
    return f"{short_path(path)}:{line}"


def _forward(model, ids):
    with torch.no_grad():
        return model(input_ids=ids)  # THE MODEL CALL


def test_a_hugging_face_op_gets_one_line_in_the_dump_and_the_profile(tmp_path):
    model = _llama()
    ids = torch.randint(0, 32, (1, 6))
    with tracer.Dumper(model, {"path": str(tmp_path / "dump"), "level": "op", "writer": "sync",
                               "io": "output", "phases": "forward"}) as d:
        _forward(model, ids)
        d.step()
    stats = tracer.open_dump(tmp_path / "dump").stats(rank=0, step=0)
    cats = stats[stats["name"].str.contains("::aten.cat.forward")]
    dumped = set(cats["source"])
    # rotate_half's torch.cat (and the rotary and mask code's): the library's lines, each with
    # the user's call beside it
    assert "transformers/models/llama/modeling_llama.py" in {s.rpartition(":")[0] for s in dumped}
    assert all(s.startswith("transformers/") for s in dumped), dumped
    call = f"{short_path(__file__)}:{_line('# THE MODEL CALL')}"
    assert set(cats["caller"]) == {call}

    config = profiler.CollectorConfig(wait=0, warmup=0, active=1, with_stack=True,
                                      profile_memory=False, activities=("cpu",))
    with profiler.Collector(tmp_path / "prof", config=config) as c:
        _forward(model, ids)
        c.step()
    ops = profiler.read_profile(tmp_path / "prof").ops
    cat = ops[ops["name"] == "aten::cat"]
    assert {_short(s) for s in cat["source"]} == dumped
    assert {_short(s) for s in cat["caller"]} == {call}


def _line(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f.read().splitlines(), 1)
                    if text in line and "_line(" not in line)


def test_frames_of_sleuths_tools_are_never_the_line():
    import transformers
    for tool in ("tracer", "profiler", "irdump", "sleuth", "dashboard"):
        assert frame_kind(str(REPO / tool / "x.py")) == INTERNAL
        assert short_frame_kind(f"{tool}/x.py") == INTERNAL
    assert frame_kind(torch.__file__) == INTERNAL == frame_kind(os.__file__)
    assert frame_kind(transformers.__file__) == LIBRARY
    assert short_frame_kind("transformers/models/llama/modeling_llama.py") == LIBRARY
    assert frame_kind(str(REPO / "trainer" / "model.py")) == USER == frame_kind(__file__)
    assert short_path(transformers.__file__) == "transformers/__init__.py"
    assert short_path(str(REPO / "trainer" / "model.py")) == "trainer/model.py"


@pytest.mark.parametrize("tool", ["tracer", "profiler"])
def test_irdump_never_names_a_frame_inside_tracer_or_profiler(tool):
    """An op that a tool's code makes while irdump captures (a tracer hook, the profiler's
    module ranges) is the line of the user's code that ran the tool, never the tool's."""
    from irdump._source import stack_trace_location, user_frame_location

    namespace: dict = {}
    # code whose file lies inside the tool's package, as a hook of that tool runs
    exec(compile("def hook():\n    return user_frame_location(1)\n",
                 str(REPO / tool / "_hook.py"), "exec"),
         {"user_frame_location": user_frame_location}, namespace)
    here = namespace["hook"]()  # THE USER'S CALL
    assert here == f"{short_path(__file__)}:{_line('# THE USER' + chr(39) + 'S CALL')}"
    trace = (f'  File "{__file__}", line 7, in forward\n    x = f(x)\n'
             f'  File "{REPO / tool / "_hook.py"}", line 2, in hook\n    return g()\n')
    assert stack_trace_location(trace) == f"{short_path(__file__)}:7"
