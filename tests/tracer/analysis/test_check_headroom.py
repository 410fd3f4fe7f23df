"""Numeric headroom: a record's distance to its dtype's ends from its statistics row, the watch
conditions on it (live and offline), and `headroom_trend`, the records heading toward overflow or
underflow, on Hugging Face models trained with a fault injected (tests/tracer/headroom_runs.py).
"""
from __future__ import annotations

import math

import pytest
import torch

import tracer
from tracer._errors import ConfigError, WatchpointHit
from tracer.analysis import first_nan_origin, headroom_trend, record_headroom
from tracer._dtype_ranges import FLOAT_RANGES
from tracer._watch_config import WatchConfig
from tracer.storage import Watcher

pytest.importorskip("transformers")
from tests.tracer.headroom_runs import (DYING, DYING_MODULE, GROWING,  # noqa: E402
                                        GROWING_MODULE, bert_dying_relu, gpt2_growing)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The four six-step runs, made once: each fault and the same model without it."""
    root = tmp_path_factory.mktemp("headroom")
    return {"growing": gpt2_growing(root / "growing"),
            "gpt2_healthy": gpt2_growing(root / "gpt2_healthy", fault=False),
            "dying": bert_dying_relu(root / "dying"),
            "bert_healthy": bert_dying_relu(root / "bert_healthy", fault=False)}


# -- one record ----------------------------------------------------------------------------------
def test_float_ranges_are_torch_finfo():
    for name, (largest, tiny) in FLOAT_RANGES.items():
        info = torch.finfo(getattr(torch, name))
        assert (largest, tiny) == (info.max, info.tiny), name


def _row(**kw):
    base = dict(name="m.forward.0.output.0", module="m", op="", phase="forward",
                direction="output", dtype="float16", numel=8, min=-256.0, max=2.0, mean=0.5,
                norm=300.0, nan=0, posinf=0, neginf=0, zeros=2, seq=0, source="x.py:1")
    base.update(kw)
    return base


def test_record_headroom_reads_only_what_the_row_holds():
    hr = record_headroom(_row())
    assert hr["overflow_bits"] == pytest.approx(math.log2(65504) - 8)  # max|x| = |min| = 2^8
    assert hr["underflow_bits"] == pytest.approx(8 + 14)  # float16's smallest normal is 2^-14
    assert hr["zero_share"] == 0.25
    # mixed signs with zeros: the smallest nonzero |x| is not in the row, only a bound from above
    # (the RMS of the six nonzero elements)
    assert not hr["smallest_exact"]
    assert hr["smallest_bits"] == pytest.approx(math.log2(300 / math.sqrt(6)) + 14)
    # one sign, no zero: the smallest magnitude is the min itself
    exact = record_headroom(_row(min=0.25, max=4.0, zeros=0))
    assert exact["smallest_exact"] and exact["smallest_bits"] == pytest.approx(-2 + 14)
    # one sign with zeros: the mean of the nonzero elements is the tighter bound
    one_sign = record_headroom(_row(min=0.0, max=4.0, mean=0.75, norm=100.0))
    assert one_sign["smallest_bits"] == pytest.approx(math.log2(0.75 * 8 / 6) + 14)
    assert record_headroom(_row(dtype="int64")) is None
    assert record_headroom(_row(numel=0)) is None
    assert record_headroom(_row(max=math.inf, posinf=1))["overflow_bits"] == -math.inf
    assert record_headroom(_row(min=math.nan, max=math.nan, nan=1))["overflow_bits"] is None
    assert record_headroom(_row(min=0.0, max=0.0, zeros=8))["overflow_bits"] == math.inf
    bf16 = record_headroom(_row(dtype="bfloat16"))
    assert bf16["overflow_bits"] == pytest.approx(math.log2(FLOAT_RANGES["bfloat16"][0]) - 8)


@pytest.mark.parametrize("cond,row,hit", [
    # the default is half the dtype's range: 256 * 256 overflows float16, 255 * 255 does not
    ({"condition": "overflow_headroom_lt"}, _row(), math.log2(65504) - 8),
    ({"condition": "overflow_headroom_lt"}, _row(min=-255.0), None),
    ({"condition": "overflow_headroom_lt"}, _row(dtype="float32"), None),
    ({"condition": "overflow_headroom_lt"}, _row(dtype="float32", min=-2.0**64), 64),
    ({"condition": "overflow_headroom_lt"}, _row(dtype="float32", min=-2.0**63), None),
    ({"condition": "overflow_headroom_lt", "threshold": 120}, _row(dtype="float32"),
     128 - 8),
    ({"condition": "overflow_headroom_lt"}, _row(max=math.inf, posinf=1), -math.inf),
    ({"condition": "overflow_headroom_lt"}, _row(min=math.nan, max=math.nan, nan=1), None),
    ({"condition": "overflow_headroom_lt"}, _row(dtype="int32", min=-1e9), None),
    ({"condition": "zero_share_gt", "threshold": 0.2}, _row(), 0.25),
    ({"condition": "zero_share_gt", "threshold": 0.25}, _row(), None),
    ({"condition": "zero_share_gt", "threshold": 0.2}, _row(dtype="int64"), None),  # ids, masks
])
def test_headroom_conditions(cond, row, hit):
    found = Watcher([WatchConfig.from_dict(cond)]).check(row)
    assert (found[0][1]["value"] if found else None) == (
        None if hit is None else pytest.approx(hit))


@pytest.mark.parametrize("cond,message", [
    ({"condition": "overflow_headroom_lt", "threshold": -3},
     r"threshold: -3 is out of range for overflow_headroom_lt: .* in bits .* e\.g\. 8"),
    ({"condition": "overflow_headroom_lt", "threshold": 0}, "above 0"),
    ({"condition": "overflow_headroom_lt", "threshold": "8"}, "expected a number, got '8'"),
    ({"condition": "zero_share_gt"},
     r'zero_share_gt needs a threshold, e\.g\. \{"condition": "zero_share_gt", '
     r'"threshold": 0\.9\}'),
    ({"condition": "zero_share_gt", "threshold": 90}, "for 90% use 0.9"),
    ({"condition": "zero_share_gt", "threshold": 1}, "all_zero"),
    ({"condition": "zero_share_gt", "threshold": -0.5}, "from 0 to below 1"),
    ({"condition": "overflow_headroom_lt", "treshold": 8}, "did you mean 'threshold'"),
    ({"condition": "overflow_headroom"}, "did you mean 'overflow_headroom_lt'"),
])
def test_bad_thresholds_say_the_fix(cond, message):
    with pytest.raises(ConfigError, match=message):
        WatchConfig.from_dict(cond)
    with pytest.raises(ConfigError, match=r"watch\[0\]"):  # as a dump config loads it
        tracer.DumpConfig(watch=[cond])


# -- live and offline, on the faults ---------------------------------------------------------------
@pytest.mark.slow
def test_overflow_headroom_watch_raises_live_at_the_growing_layer(tmp_path, runs):
    watch = [{"condition": "overflow_headroom_lt", "threshold": 13, "on_hit": "raise"}]
    with pytest.raises(WatchpointHit) as e:
        gpt2_growing(tmp_path / "run", watch=watch)
    hit = e.value.hit
    assert (hit["name"], hit["step"]) == (GROWING, 5)
    assert hit["value"] == pytest.approx(12.33, abs=0.05)
    assert f"hit by {GROWING} (module {GROWING_MODULE}, forward, step 5" in str(e.value)
    # offline on the run that went on: the same record, step and value come first
    hits = tracer.check(runs["growing"], watch=[{"condition": "overflow_headroom_lt",
                                                 "threshold": 13}])
    first = hits.iloc[0]
    assert (first["name"], first["step"], first["origin"]) == (GROWING, 5, "offline")
    assert first["value"] == pytest.approx(hit["value"])


def test_zero_share_watch_live_and_offline_name_the_dying_relu(tmp_path):
    watch = [{"condition": "zero_share_gt", "threshold": 0.72, "names": ["*.forward.*"]}]
    run = bert_dying_relu(tmp_path / "run", watch=watch)
    live = tracer.open_dump(run).hits(0, 4)
    assert live["name"].iat[0] == DYING
    assert [len(tracer.open_dump(run).hits(0, s)) for s in range(4)] == [0, 0, 0, 0]
    offline = tracer.check(run, watch=watch)
    assert offline["name"].iat[0] == DYING and offline["step"].iat[0] == 4
    assert offline["value"].iat[0] == pytest.approx(live["value"].iat[0])
    # without names, a bias that starts at zero is all zeros: the condition reads the row only
    hits = tracer.check(run, watch=[{"condition": "zero_share_gt", "threshold": 0.72}])
    assert "bert.embeddings.LayerNorm.bias.optimizer.0.param.0" in set(hits["name"])


# -- the trend -------------------------------------------------------------------------------------
def test_growing_activation_is_named_first_toward_overflow(runs):
    report = headroom_trend(runs["growing"])
    first = report.overflow.iloc[0]
    assert first["name"] == GROWING
    assert first["module"] == GROWING_MODULE and first["dtype"] == "float16"
    assert first["fit"] == "log2"
    assert first["growth_bits"] == pytest.approx(1.0, abs=0.1)  # the weight doubles each step
    assert 10 < first["steps_left"] < 14 and first["at_step"] == 17
    assert first["headroom_bits"] == pytest.approx(12.33, abs=0.05)
    # x*x overflows float16 once the headroom is below 8 bits, about 4 steps later
    assert first["square_steps_left"] == pytest.approx(
        (first["headroom_bits"] - math.log2(65504) / 2) / first["growth_bits"], rel=1e-6)
    # what the layer feeds grows with it, after it
    assert set(report.overflow["name"].head(4)) == {
        GROWING, f"{GROWING_MODULE[:-5]}.act.forward.0.input.0",
        f"{GROWING_MODULE[:-5]}.act.forward.0.output.0",
        f"{GROWING_MODULE[:-5]}.c_proj.forward.0.input.0"}
    assert report.exit_code == 1 and report.projected == report.records
    assert len(report.nonfinite) == 0


def test_healthy_run_lists_nothing_toward_overflow(runs):
    """The same float16 model without the fault: its zero-initialized biases grow fast in log2
    at first, but additively, so they are not projected as a blow-up."""
    report = headroom_trend(runs["gpt2_healthy"])
    assert report.overflow.empty
    assert report.projected == report.records > 100
    biases = report.table[report.table["name"].str.endswith("bias.optimizer.0.param.0")]
    assert (biases["fit"] == "linear").any()
    clean = headroom_trend(runs["bert_healthy"])
    assert clean.verdict == (0, "clean")


def test_dying_relu_is_named_first_toward_underflow(runs):
    report = headroom_trend(runs["dying"])
    first = report.underflow.iloc[0]
    assert (first["name"], first["kind"]) == (DYING, "zero_share")
    assert first["zero_share"] == pytest.approx(0.798, abs=0.01)
    assert first["zero_share_per_step"] == pytest.approx(0.065, abs=0.01)
    assert first["at_step"] == 9
    assert report.overflow.empty and report.exit_code == 1


def test_window_fits_the_last_steps(runs):
    report = headroom_trend(runs["growing"], window=3)
    assert report.overflow["name"].iat[0] == GROWING
    assert report.overflow["steps"].iat[0] == 3 and report.overflow["first_step"].iat[0] == 3


def test_fewer_than_three_steps_project_nothing(tmp_path):
    run = gpt2_growing(tmp_path / "run", steps=2)
    report = headroom_trend(run)
    assert report.projected == 0 and report.too_few == report.records > 0
    code, why = report.verdict
    assert code == 2
    assert why.startswith("no trend can be projected: no record holds 3 or more dumped steps")
    assert report.overflow.empty and report.underflow.empty


def test_a_record_already_non_finite_is_listed_not_projected(tmp_path):
    """Left to run, the doubling weight gives a NaN at step 9, in the backward of the layer: the
    backward of float16 GELU's tanh form takes 3*x*x, which overflows with 8.5 bits of headroom
    left."""
    run = gpt2_growing(tmp_path / "run", steps=12)
    report = headroom_trend(run)
    first = report.nonfinite.iloc[0]
    origin = first_nan_origin(run)
    assert (first["name"], first["first_step"]) == (origin["name"], origin["step"]) == (
        f"{GROWING_MODULE}.backward.0.output.0", 9)
    assert not set(report.nonfinite["name"]) & set(report.overflow["name"])
    assert report.exit_code == 1


@pytest.mark.parametrize("kwargs,message", [
    ({"horizon": 0}, "horizon: 0 is out of range; it is a number of steps ahead"),
    ({"horizon": math.inf}, "horizon: inf is out of range"),
    ({"min_steps": 2}, "use 3 or more"),
    ({"window": 2}, r"at least min_steps \(3\)"),
])
def test_bad_arguments_say_the_fix(runs, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        headroom_trend(runs["growing"], **kwargs)


# -- ranks and what was not read, on a dump written directly ------------------------------------
def write_ranks(root, steps=range(6)):
    """Two ranks of a float16 layer: rank 1's output doubles every step, rank 0's stays."""
    from tracer._config import DumpConfig
    from tracer.storage import RecordMeta, make_writer

    for rank in (0, 1):
        w = make_writer(DumpConfig(path=str(root), writer="sync"), rank=rank, world_size=2)
        for step in steps:
            w.begin_step(step)
            value = 2.0 ** step if rank == 1 else 1.5
            w.add(RecordMeta("layer.forward.0.output.0", "layer", "", "forward", "output", 0, 0,
                             "model.py:3"), torch.full((8,), value, dtype=torch.float16))
            w.end_step()
        w.close()
    return root


def test_each_rank_is_fitted_on_its_own(tmp_path):
    run = write_ranks(tmp_path / "run")
    report = headroom_trend(run)
    assert report.records == report.projected == 2 and report.steps == {0: list(range(6)),
                                                                         1: list(range(6))}
    [row] = report.overflow.to_dict("records")
    assert (row["rank"], row["name"], row["at_step"]) == (1, "layer.forward.0.output.0", 16)
    assert row["growth_bits"] == pytest.approx(1.0) and row["steps_left"] == pytest.approx(
        math.log2(65504) - 5)
    assert headroom_trend(run, rank=0).verdict == (0, "clean")


def test_an_unread_step_file_makes_it_incomplete(tmp_path):
    run = write_ranks(tmp_path / "run")
    step = run / "dump" / "rank0" / "step3.h5"
    with open(step, "r+b") as f:
        f.truncate(step.stat().st_size // 2)
    with pytest.warns(RuntimeWarning, match="skipped 1 partial, unreadable"):
        report = headroom_trend(run)
    assert report.overflow["rank"].tolist() == [1]  # the rest is still read and fitted
    code, why = report.verdict
    assert code == 2 and why.startswith("1 of 12 step file(s) could not be read")
    assert [u["step"] for u in report.coverage["unread"]] == [3]
