"""The rules of profiler._diff_causes, on data: each cause is typed (what it rests on) and
carries the time it accounts for; the shapes cause counts only what the change of time per
call holds where the inputs moved the verdict's way; calls and shapes, read in each run alone,
decide where the step times cannot, and then come first. Hand-made tables and profiles."""
from __future__ import annotations

import pandas as pd
from handmade_profiles import Profile, steps, with_sites

import profiler
from profiler._diff_causes import (Kind, OutsideOps, Shapes, Site, Tables, find_causes, rank,
                                   shape_cause, shapes_load_free, site_kind)
from profiler._diff_pairs import line_diff, op_diff, rank as rank_rows
from profiler._diff_words import words

COLS = ["name", "input_shapes", "source", "module", "calls", "cpu_total_us", "cpu_self_us",
        "device_us"]


def _ops(*rows):
    """A raw op table of (name, shapes, source, calls a step, us a step) over one step."""
    return pd.DataFrame([dict(zip(COLS, (n, s, src, "", c, us, us, 0.0)))
                         for n, s, src, c, us in rows], columns=COLS)


def _breakdown(step_delta: float) -> pd.DataFrame:
    rows = [{"phase": p, "a_us": 0.0, "b_us": 0.0, "delta_us": 0.0}
            for p in ("data", "forward", "backward", "optimizer", "other", "comm", "tools")]
    return pd.DataFrame(rows + [{"phase": "step", "a_us": 1000.0, "b_us": 1000.0 + step_delta,
                                 "delta_us": step_delta}])


NO_MODULES = pd.DataFrame(columns=["module", "type", "source", "side", "calls_a", "calls_b",
                                   "self_a_us", "self_b_us", "delta_us", "from_calls_us"])
# a batch of 8 images against 4 micro-batches of 2 accumulated to the same 8: four times the
# calls of the model's ops, on inputs a quarter the size; the optimizer runs once either way
BATCH_8 = [("aten::convolution", "[[8,3,32,32],[8,3,7,7]]", "train.py:12", 1, 800.0),
           ("aten::relu", "[[8,16]]", "train.py:12", 1, 100.0),
           ("aten::add_", "[[16]]", "train.py:20", 1, 50.0)]
BATCH_2X4 = [("aten::convolution", "[[2,3,32,32],[8,3,7,7]]", "train.py:12", 4, 1400.0),
             ("aten::relu", "[[2,16]]", "train.py:12", 4, 200.0),
             ("aten::add_", "[[16]]", "train.py:20", 1, 50.0)]


def _tables(a, b, sign=1, step_delta=None, decided_by="steps") -> Tables:
    ops = rank_rows(op_diff(_ops(*a), _ops(*b), 1, 1, stacks=True), sign > 0)
    delta = float(ops["delta_us"].sum()) if step_delta is None else step_delta
    return Tables(sign=sign, step_us=1000.0, ops=ops, lines=line_diff(ops, sign > 0),
                  modules=NO_MODULES, breakdown=_breakdown(delta), stacks=True,
                  decided_by=decided_by)


def test_more_calls_on_smaller_inputs_are_the_calls_not_the_shapes():
    """Four times the calls on a quarter of the input each: B is slower by its calls (a
    smaller batch is no slowdown by its shapes), named at the line, with the smaller inputs
    beside the calls."""
    t = _tables(BATCH_8, BATCH_2X4)
    assert shape_cause(t.ops, 1, t.floor_us) is None
    found = find_causes(t)
    first = found[0]
    assert isinstance(first, Site) and first.scope == "line" and first.kind == Kind.NEW_CALLS
    assert first.us == 700.0 and first.smaller is not None
    assert (first.smaller.shapes_a, first.smaller.shapes_b) == ("[[8,3,32,32],[8,3,7,7]]",
                                                                "[[2,3,32,32],[8,3,7,7]]")
    assert not any(isinstance(c, Shapes) for c in found)
    text = words(first)
    assert text.startswith("train.py:12: +700 us a step (aten::convolution (calls 1 -> 4)"), text
    assert "its ops ran on smaller inputs, in more calls of less work each: aten::convolution" \
        in text and "larger" not in text, text


def test_larger_inputs_are_the_time_per_call_they_add():
    """A sequence twice as long at the same calls: the shapes cause holds the change of time
    per call, worded larger; the same ops on smaller inputs make B faster, worded smaller."""
    a = [("aten::bmm", "[[16,128,32],[16,32,128]]", "train.py:30", 2, 600.0),
         ("aten::add_", "[[64]]", "train.py:40", 1, 50.0)]
    b = [("aten::bmm", "[[16,256,32],[16,32,256]]", "train.py:30", 2, 1500.0),
         ("aten::add_", "[[64]]", "train.py:40", 1, 50.0)]
    grew = shape_cause(_tables(a, b).ops, 1, 10.0)
    assert grew is not None and grew.larger and grew.us == 900.0 and grew.kind == Kind.SHAPES
    assert words(grew).startswith("the same ops on larger inputs: +900 us a step from 1 op(s)")
    shrank = shape_cause(_tables(b, a, sign=-1).ops, -1, 10.0)
    assert shrank is not None and not shrank.larger and shrank.us == -900.0
    assert words(shrank).startswith("the same ops on smaller inputs: -900 us a step")
    # larger inputs do not explain a faster B, nor smaller ones a slower B
    assert shape_cause(_tables(a, b, sign=-1).ops, -1, 10.0) is None
    assert shape_cause(_tables(b, a).ops, 1, 10.0) is None


def test_shapes_read_in_each_run_alone_do_not_move_with_load():
    """B's whole run on a machine 1.5 times slower: scaled by the ops that ran alike, the
    shapes cost what they cost at A's speed; without a shape change they cost nothing."""
    a = [("aten::bmm", "[[16,128,32]]", "train.py:30", 2, 600.0),
         ("aten::add_", "[[64]]", "train.py:40", 1, 200.0)]
    b = [("aten::bmm", "[[16,256,32]]", "train.py:30", 2, 1.5 * 1200.0),
         ("aten::add_", "[[64]]", "train.py:40", 1, 1.5 * 200.0)]
    assert shapes_load_free(_tables(a, b).ops) == 600.0
    loaded = [(n, s, src, c, 1.5 * us) for n, s, src, c, us in a]
    assert shapes_load_free(_tables(a, loaded).ops) == 0.0


def test_site_kind_rests_on_calls_where_they_explain_most():
    assert site_kind("B only", 50.0, 50.0) == Kind.NEW_CALLS
    assert site_kind("A only", -50.0, -50.0) == Kind.DROPPED_CALLS
    assert site_kind("both", 100.0, 60.0) == Kind.NEW_CALLS
    assert site_kind("both", -100.0, -60.0) == Kind.DROPPED_CALLS
    assert site_kind("both", 100.0, 10.0) == Kind.TIME_PER_CALL


def test_rank_puts_the_deciding_evidence_first():
    outside = OutsideOps(kind=Kind.OUTSIDE_OPS, us=500.0, rank_us=500.0, phase="other",
                         phase_us=500.0, share=80.0, ops_us=100.0, stacks=False)
    calls = Site(kind=Kind.NEW_CALLS, us=100.0, rank_us=100.0, scope="line", name="t.py:3")
    # the steps decided, and the calls hold less than the floor: by size
    assert rank([calls, outside], 1, 200.0) == [outside, calls]
    assert rank([outside, calls], 1, 200.0, "calls") == [calls, outside]
    assert rank([outside, calls], 1, 200.0, "shapes") == [outside, calls]
    # calls that hold more than the floor come first whatever decided
    new = Site(kind=Kind.NEW_CALLS, us=300.0, rank_us=300.0, scope="line", name="t.py:3",
               from_calls_us=300.0)
    assert rank([outside, new], 1, 200.0) == [new, outside]
    # time per call is no evidence load cannot move, however large
    slow = Site(kind=Kind.TIME_PER_CALL, us=300.0, rank_us=300.0, scope="line", name="t.py:3",
                from_calls_us=10.0)
    assert slow.load_proof_us == 0.0 and rank([outside, slow], 1, 200.0) == [outside, slow]


def test_an_op_never_ranks_above_its_line():
    t = _tables(BATCH_8, BATCH_2X4)
    scopes = [c.scope for c in find_causes(t) if isinstance(c, Site)]
    assert scopes == ["line", "op"]
    line, op = [c for c in find_causes(t) if isinstance(c, Site)]
    assert op.rank_us <= line.rank_us


def test_shapes_decide_where_the_steps_cannot():
    """The steps move +7.5 % against a 13.5 % floor (two runs of A apart), but B's attention
    runs on twice the sequence, +24.3 % of A's pooled median step at A's speed (the
    optimizer's ops, alike in both, set the scale): B is slower by its shapes, said first."""
    a_ops = [("aten::bmm", "[[16, 128, 32], [16, 32, 128]]", "train.py:30", 2, 300.0),
             ("aten::_foreach_add_", "[[64, 64]]", "train.py:40", 1, 500.0)]
    b_ops = [("aten::bmm", "[[16, 256, 32], [16, 32, 256]]", "train.py:30", 2, 900.0),
             ("aten::_foreach_add_", "[[64, 64]]", "train.py:40", 1, 550.0)]
    a = with_sites(Profile("a", steps(2000), []), a_ops)
    a2 = with_sites(Profile("a2", steps(2270), []), a_ops)
    b = with_sites(Profile("b", steps(2150), []), b_ops)
    d = profiler.diff_profiles(a, b, repeat_a=[a2])
    assert d.verdict == "slower" and d.judgement.decided_by == "shapes", d.headline()
    assert d.headline().startswith("B is slower, by its shapes: B runs the same ops on larger "
                                   "inputs, +24.3 % of A's step at A's speed"), d.headline()
    assert d.to_dict()["step_time"]["decided_by"] == "shapes"
    assert d.findings[0].kind == Kind.SHAPES
    assert d.causes[0].startswith("the same ops on larger inputs"), d.causes
    assert d.to_dict()["findings"][0]["type"] == "Shapes"
    # the same shapes, every op slower by the same load: the steps alone judge, and cannot
    loaded = with_sites(Profile("b", steps(2150), []),
                        [(n, s, src, c, us * 1.1) for n, s, src, c, us in a_ops])
    same = profiler.diff_profiles(a, loaded, repeat_a=[a2])
    assert same.verdict == "no change" and same.judgement.decided_by == "steps", same.headline()


def test_a_smaller_batch_accumulated_is_slower_by_its_calls():
    """The resnet case of test_profiler_diff_models on data: a clear slowdown whose first
    cause is the line whose calls multiplied, never "the same ops on larger inputs"."""
    a = with_sites(Profile("a", steps(2000), []), BATCH_8)
    b = with_sites(Profile("b", steps(2700), []), BATCH_2X4)
    d = profiler.diff_profiles(a, b)
    assert d.verdict == "slower", d.headline()
    assert d.causes[0].startswith("train.py:12: +700 us a step (aten::convolution (calls 1 -> 4)")
    assert "smaller inputs" in d.causes[0] and "larger inputs" not in " ".join(d.causes)


def test_the_line_of_larger_inputs_follows_the_shapes():
    """Every op at one line (a model called from a loop) on a sequence three times as long:
    the line holds as much as the shapes do, but its calls did not change; the shapes say why
    and come first, the line says where."""
    a = [("aten::mm", "[[128,64],[64,128]]", "train.py:12", 2, 400.0),
         ("aten::bmm", "[[16,32,16],[16,16,32]]", "train.py:12", 1, 100.0),
         ("aten::add_", "[[64]]", "train.py:20", 1, 50.0)]
    b = [("aten::mm", "[[384,64],[64,128]]", "train.py:12", 2, 1200.0),
         ("aten::bmm", "[[16,96,16],[16,16,96]]", "train.py:12", 1, 500.0),
         ("aten::add_", "[[64]]", "train.py:20", 1, 50.0)]
    found = find_causes(_tables(a, b))
    assert isinstance(found[0], Shapes) and found[0].us == 1200.0
    line = found[1]
    assert isinstance(line, Site) and line.scope == "line" and line.us == 1200.0
    assert line.kind == Kind.TIME_PER_CALL


def test_findings_as_plain_data_name_their_type():
    a = with_sites(Profile("a", steps(2000), []), BATCH_8)
    b = with_sites(Profile("b", steps(2700), []), BATCH_2X4)
    first = profiler.diff_profiles(a, b).to_dict()["findings"][0]
    assert first["type"] == "Site" and first["kind"] == "new calls" and first["scope"] == "line"
    assert first["smaller"]["shapes_b"] == "[[2,3,32,32],[8,3,7,7]]"
