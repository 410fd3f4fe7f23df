"""`profiler.diff_profiles` and the machine's speed drifting between two runs: with one profile a
side a verdict against the calls is withheld (B judged faster, by less than twice the floor,
while it makes calls A does not); with repeats of a config the floor includes the variation
between its runs, and the verdict pools the steps. Hand-made profiles: the rule, not a machine's
mood, is under test."""
from __future__ import annotations

import math

import pytest
from handmade_profiles import Profile as _Profile
from handmade_profiles import steps as _steps
from handmade_profiles import with_sites as _with_sites

import profiler
from profiler._diff import _against_calls
from profiler._noise import judge


BASE = [("aten::addmm", 3, 300.0), ("aten::relu", 1, 50.0)]
CHECK = BASE + [("aten::isfinite", 6, 60.0), ("aten::all", 6, 40.0)]


def test_faster_against_new_calls_is_withheld_with_one_profile_a_side():
    a = _Profile("a", _steps(2000), BASE)
    b = _Profile("b", _steps(1830), CHECK)  # 8.5 % faster steps, yet 12 new calls a step
    d = profiler.diff_profiles(a, b)
    assert d.verdict == "no change" and d.exit_code == 0
    assert any("against its calls" in n and "--repeat-a" in n for n in d.notes), d.notes
    assert d.causes == []


def test_a_clear_change_stands_against_the_calls():
    """Twice the floor and more: a real speed-up that adds a cheap cast (bf16) is kept."""
    a = _Profile("a", _steps(2000), BASE)
    b = _Profile("b", _steps(1200), CHECK)
    d = profiler.diff_profiles(a, b)
    assert d.verdict == "faster"
    assert "variation between runs not measured" in d.headline()


def test_repeats_put_the_drift_into_the_floor():
    a, a2 = _Profile("a", _steps(2000), BASE), _Profile("a2", _steps(2300), BASE)
    b = _Profile("b", _steps(2200), BASE)
    # alone, B's 10 % over A is a change
    assert profiler.diff_profiles(a, b).verdict == "slower"
    d = profiler.diff_profiles(a, b, repeat_a=[a2])
    assert d.verdict == "no change", d.headline()
    assert d.judgement.floor_from == "between runs"
    assert d.judgement.between == pytest.approx(0.15)
    assert d.step_a.n == 16 and d.repeats == {"a": ["a2"], "b": []}
    assert "(the variation between runs)" in d.headline()
    assert any("between runs of one config" in n and "A 15 %" in n for n in d.notes), d.notes
    assert not any("one profile a side" in n for n in d.notes)
    # a change larger than the drift is still a change
    b3 = _Profile("b3", _steps(3000), CHECK)
    d = profiler.diff_profiles(a, b3, repeat_a=[a2])
    assert d.verdict == "slower" and d.to_dict()["step_time"]["floor_from"] == "between runs"


def test_against_calls_leaves_measured_or_agreeing_verdicts():
    ops = 100.0  # B's new calls, us a step at A's time per call
    a = [1000.0] * 6
    faster = judge(a, [900.0] * 6)
    assert faster.verdict == "faster"
    assert _against_calls(faster, ops, 900.0, []).verdict == "no change"
    measured = judge(a, [900.0] * 6, between=0.02)
    assert _against_calls(measured, ops, 900.0, []).verdict == "faster"
    slower = judge(a, [1100.0] * 6)
    assert _against_calls(slower, ops, 1000.0, []).verdict == "slower"  # calls agree
    tiny = 5.0  # under 1 % of a step: no evidence
    assert _against_calls(faster, tiny, 900.0, []).verdict == "faster"
    assert not math.isnan(faster.change)
    # the same ops on larger inputs in B: as much evidence against "faster" as new calls
    notes: list[str] = []
    assert _against_calls(faster, 0.0, 900.0, notes, shapes_us=100.0).verdict == "no change"
    assert "against its shapes: B runs the same ops on larger inputs" in notes[0], notes
    assert _against_calls(faster, 0.0, 900.0, [], shapes_us=math.nan).verdict == "faster"
    assert _against_calls(slower, 0.0, 1000.0, [], shapes_us=100.0).verdict == "slower"


def test_withheld_verdict_says_so_in_the_headline():
    d = profiler.diff_profiles(_Profile("a", _steps(2000), BASE), _Profile("b", _steps(1830), CHECK))
    assert d.judgement.withheld == "faster"
    assert "the steps alone say faster, against its calls or shapes" in d.headline()
    # the p-value shown is the one of what the steps said
    assert f"p = {d.judgement.p_faster:.3g}" in d.headline()


def test_new_calls_within_noise_are_noted_not_judged():
    """Steps too noisy to judge (a 30 % spread), and B makes 12 new calls a step: no verdict,
    and a note that names the calls, so a noisy machine does not hide them."""
    wide = [2000 * f for f in (0.6, 1.4, 0.8, 1.2, 1.0, 0.7, 1.3, 1.0)]
    d = profiler.diff_profiles(_Profile("a", wide, BASE), _Profile("b", wide, CHECK))
    assert d.verdict == "no change" and not d.judgement.withheld
    assert any(n.startswith("B makes more calls than A, +100 us a step") and "not judged" in n
               for n in d.notes), d.notes
    same = profiler.diff_profiles(_Profile("a", wide, BASE), _Profile("b", wide, BASE))
    assert not any("calls than A" in n for n in same.notes)


def test_a_repeat_must_be_another_run_of_the_same_config():
    from profiler import ProfileFormatError, ProfilerError
    a, b = _Profile("a", _steps(2000), BASE), _Profile("b", _steps(2200), CHECK)
    with pytest.raises(ProfilerError, match=r"--repeat-a a: that run is already in this diff"):
        profiler.diff_profiles(a, b, repeat_a=[a])
    a2 = _Profile("a2", _steps(2100), BASE)
    with pytest.raises(ProfilerError, match=r"--repeat-b a2: that run is already"):
        profiler.diff_profiles(a, b, repeat_a=[a2], repeat_b=[a2])
    other = _Profile("bert", _steps(2000), [("aten::bmm", 12, 900.0), ("aten::softmax", 4, 80.0)])
    with pytest.raises(ProfilerError, match=r"--repeat-a bert is not a run of A's config: its op "
                                            r"calls a step differ from its side.s by 500 % .*aten::bmm 0 -> 12"):
        profiler.diff_profiles(a, b, repeat_a=[other])
    with pytest.raises(ProfileFormatError, match=r"--repeat-b empty: no profiled steps"):
        profiler.diff_profiles(a, b, repeat_b=[_Profile("empty", [], CHECK)])
    with pytest.raises(ProfileFormatError, match=r"A \(empty\) has no profiled steps"):
        profiler.diff_profiles(_Profile("empty", [], BASE), b)
    # the same config with a few calls more (a data-dependent branch) is one
    near = _Profile("a3", _steps(2050), BASE + [("aten::clone", 0.2, 1.0)])
    assert profiler.diff_profiles(a, b, repeat_a=[near]).repeats["a"] == ["a3"]


def test_a_run_directory_given_alone_is_one_repeat(tmp_path):
    from profiler._repeats import as_list, identity
    assert as_list(str(tmp_path)) == [str(tmp_path)] and as_list(tmp_path) == [tmp_path]
    assert as_list(None) == [] and as_list([tmp_path, tmp_path]) == [tmp_path, tmp_path]
    # one run however it is spelled
    assert identity(str(tmp_path) + "/") == identity(tmp_path / "." ) == identity(tmp_path)


def test_an_extra_forward_is_another_config():
    """A sixth more calls of the same ops (an extra no_grad forward) is not a repeat."""
    from profiler import ProfilerError
    a, b = _Profile("a", _steps(2000), BASE), _Profile("b", _steps(2400), CHECK)
    extra = _Profile("xfwd", _steps(2300), [("aten::addmm", 3.6, 360.0), ("aten::relu", 1.2, 60.0)])
    with pytest.raises(ProfilerError, match=r"--repeat-a xfwd is not a run of A's config: its "
                                            r"op calls a step differ from its side's by 20 %"):
        profiler.diff_profiles(a, b, repeat_a=[extra])


NEW_CALLS = BASE + [("aten::mul", 4, 240.0), ("aten::add", 4, 160.0)]  # +400 us a step


def test_calls_above_the_floor_decide_where_the_steps_cannot():
    """The steps move +7.5 % against a 13.5 % floor (the variation between two runs of A), but
    B makes calls A does not worth 20 % of A's step: calls do not drift with load, so B is
    slower (+18.7 % of A's pooled median step), and the headline says the calls decided."""
    a, a2 = _Profile("a", _steps(2000), BASE), _Profile("a2", _steps(2270), BASE)
    b = _Profile("b", _steps(2150), NEW_CALLS)
    d = profiler.diff_profiles(a, b, repeat_a=[a2])
    assert d.verdict == "slower" and d.exit_code == 1, d.headline()
    assert d.headline().startswith("B is slower, by its calls: B makes more calls than A, +18.7 %")
    assert d.to_dict()["step_time"]["decided_by"] == "calls"
    # the same calls on both sides: the steps alone judge, and they cannot
    same = profiler.diff_profiles(a, _Profile("b", _steps(2150), BASE), repeat_a=[a2])
    assert same.verdict == "no change", same.headline()
    assert same.to_dict()["step_time"]["decided_by"] == "steps"


def test_calls_within_the_floor_decide_nothing():
    a, a2 = _Profile("a", _steps(2000), BASE), _Profile("a2", _steps(2270), BASE)
    few = BASE + [("aten::mul", 1, 40.0)]  # +2 % a step
    d = profiler.diff_profiles(a, _Profile("b", _steps(2150), few), repeat_a=[a2])
    assert d.verdict == "no change", d.headline()


def test_a_longer_sequence_is_the_same_ops_on_larger_inputs():
    """Attention's two matmuls at one line, on a sequence twice as long: the same ops at the
    same site on other shapes, paired by size, never "in B only", and said first."""
    a = _with_sites(_Profile("a", _steps(2000), []), [
        ("aten::bmm", "[[16, 128, 32], [16, 32, 128]]", "train.py:30", 2, 600.0),
        ("aten::bmm", "[[16, 128, 128], [16, 128, 32]]", "train.py:30", 2, 600.0),
        ("aten::addmm", "[[64], [512, 64], [64, 64]]", "train.py:28", 4, 800.0)])
    b = _with_sites(_Profile("b", _steps(3600), []), [
        ("aten::bmm", "[[16, 256, 32], [16, 32, 256]]", "train.py:30", 2, 1200.0),
        ("aten::bmm", "[[16, 256, 256], [16, 256, 32]]", "train.py:30", 2, 1600.0),
        ("aten::addmm", "[[64], [1024, 64], [64, 64]]", "train.py:28", 4, 1600.0)])
    d = profiler.diff_profiles(a, b)
    assert d.verdict == "slower", d.headline()
    assert (d.ops["side"] == "both").all(), d.ops[["name", "side", "input_shapes_a"]]
    assert d.causes[0].startswith("the same ops on larger inputs: +2400 us a step from 3 op(s)")
    assert "aten::bmm at train.py:30 [[16, 128, 128], [16, 128, 32]] -> " \
           "[[16, 256, 256], [16, 256, 32]] (+1000 us)" in d.causes[0], d.causes
    assert not any("in B only" in c for c in d.causes), d.causes


def _attention(name: str, step_us: float, seq: int, bmm_us: float, alike_us: float) -> _Profile:
    """Attention's matmul at one line on a sequence of `seq`, beside the optimizer's update
    on the parameters, which runs alike whatever the sequence (the machine's speed)."""
    return _with_sites(_Profile(name, _steps(step_us), []), [
        ("aten::bmm", f"[[16, {seq}, 32], [16, 32, {seq}]]", "train.py:30", 2, bmm_us),
        ("aten::_foreach_add_", "[[64, 64]]", "train.py:40", 1, alike_us)])


def test_shapes_above_the_change_overrule_steps_that_say_the_other_way():
    """A sequence eight times as long, profiled while the machine was quieter than for A and
    its repeat: B's steps are 28 % faster past a 15 % floor the repeats set, yet its matmuls
    on the longer inputs cost more than A's whole step at A's speed. For the steps to hold,
    everything else would have had to run twice as fast: the machine's speed moved, not the
    program, so the shapes give the verdict and the headline says the steps went against it."""
    a = _attention("a", 2000, 128, 600.0, 1400.0)
    a2 = _attention("a2", 2300, 128, 690.0, 1610.0)
    b = _attention("b", 1650, 1024, 1450.0, 200.0)  # the update 7 times as fast: the machine
    d = profiler.diff_profiles(a, b, repeat_a=[a2])
    assert d.judgement.withheld == "faster" and d.verdict == "slower", d.headline()
    assert d.judgement.decided_by == "shapes"
    assert d.headline().startswith("B is slower, by its shapes: B runs the same ops on larger "
                                   "inputs"), d.headline()
    assert "which the step times alone (step time" in d.headline() and "go against" in d.headline()
    assert any("so they decide the verdict" in n for n in d.notes), d.notes
    assert d.causes[0].startswith("the same ops on larger inputs"), d.causes


def test_a_real_speed_up_beside_a_few_new_calls_stands_with_repeats():
    """Faster by more than the new calls cost, past the floor: kept (a cast added by bf16
    while the matmuls got faster)."""
    a, a2 = _Profile("a", _steps(2000), BASE), _Profile("a2", _steps(2100), BASE)
    d = profiler.diff_profiles(a, _Profile("b", _steps(1500), CHECK), repeat_a=[a2])
    assert d.verdict == "faster" and not d.judgement.withheld, d.headline()


def test_a_line_comes_before_its_module_that_comes_first():
    """A module called a second time from a new line: the module's new call holds more than
    the floor while the line's own count, merged with the first call's line, does not. The
    line holds the module's time, so it is named first, with the module after it."""
    from profiler._diff_causes import Kind, Site, rank
    line = Site(kind=Kind.TIME_PER_CALL, us=58.0, rank_us=58.0, scope="line",
                name="train.py:11,15", from_calls_us=40.0)
    module = Site(kind=Kind.NEW_CALLS, us=150.0, rank_us=58.0, scope="module", name="0",
                  from_calls_us=150.0)
    assert rank([line, module], 1, 100.0) == [line, module]


def test_shapes_clear_the_floor_of_one_run_whatever_the_drift_between_runs():
    """A and its repeat 60 % apart (a machine shared with a heavy job): the steps cannot
    judge B's +30 %, but its matmuls on twice the sequence, read in B's run alone, cost a
    third of A's step at A's speed, over the 5 % floor one run's steps set. The drift between
    runs does not move shapes, so they decide, and the headline names both floors."""
    a = _attention("a", 2000, 128, 600.0, 1400.0)
    a2 = _attention("a2", 3200, 128, 960.0, 2240.0)
    b = _attention("b", 2600, 256, 1300.0, 1300.0)
    d = profiler.diff_profiles(a, b, repeat_a=[a2])
    assert d.judgement.noise == pytest.approx(0.6) and d.judgement.floor_in_run == 0.05
    assert d.verdict == "slower" and d.judgement.decided_by == "shapes", d.headline()
    assert "above the floor of one run, 5 % (the drift between runs moves neither calls nor " \
           "shapes; noise floor 60 % (the variation between runs)" in d.headline(), d.headline()
    # A against its repeat: the same calls on the same shapes, so no evidence, whatever the drift
    assert profiler.diff_profiles(a, a2).judgement.decided_by == "steps"
