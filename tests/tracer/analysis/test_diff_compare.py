"""Metrics, tolerances and dtype decoding of the diff, on plain numpy arrays (no dump, no torch)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tracer.analysis._compare import (TensorMetrics, Tolerance, compare_arrays, compare_stats,
                                      decode, judge_tensor)
from tracer._errors import ConfigError


def test_identical_arrays_are_same():
    a = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    m = compare_arrays(a, a.copy())
    assert m["verdict"] == "same"
    assert m["cosine"] == 1.0 and m["max_abs_err"] == 0.0 and m["within"] == 1.0


def test_metrics_match_direct_formulas():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(5000)
    b = a + rng.standard_normal(5000) * 1e-3
    m = compare_arrays(a, b, Tolerance(rtol=0.0, atol=2e-3))
    d = np.abs(a - b)
    assert m["max_abs_err"] == pytest.approx(d.max())
    assert m["mean_abs_err"] == pytest.approx(d.mean())
    assert m["rmse"] == pytest.approx(np.sqrt((d ** 2).mean()))
    cos = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    assert m["cosine"] == pytest.approx(cos, abs=1e-12)
    assert m["within"] == pytest.approx((d <= 2e-3).mean())
    rel = d / np.maximum(np.abs(a), np.abs(b))
    assert m["max_rel_err"] == pytest.approx(rel.max())
    assert m["verdict"] == "diverged"


def test_cosine_keeps_precision_for_close_float32():
    rng = np.random.default_rng(2)
    a = rng.standard_normal(200_000).astype(np.float32)
    b = (a * (1 + 1e-4 * rng.standard_normal(a.size))).astype(np.float32)
    m = compare_arrays(a, b)
    exact = (a.astype(np.float64) @ b) / np.linalg.norm(a.astype(np.float64)) / np.linalg.norm(
        b.astype(np.float64))
    assert 1 - m["cosine"] == pytest.approx(1 - exact, rel=1e-3)


def test_nan_inf_positions():
    a = np.array([1.0, np.nan, np.inf, 4.0, np.nan], np.float32)
    b = np.array([1.0, np.nan, np.inf, np.nan, 5.0], np.float32)
    m = compare_arrays(a, b)
    assert m["nan_diff"] == 2 and m["inf_diff"] == 0
    assert m["verdict"] == "diverged" and "NaN" in m["reason"]
    m2 = compare_arrays(a[:3], b[:3])
    assert m2["verdict"] == "same"


def test_streamed_equals_one_shot():
    rng = np.random.default_rng(3)
    a = rng.standard_normal(300_001).astype(np.float32)
    b = a + np.float32(1e-4) * rng.standard_normal(a.size).astype(np.float32)
    acc = TensorMetrics(1e-5, 1e-5)
    for i in range(0, a.size, 70_000):
        acc.add_raw(a[i:i + 70_000].view(np.uint8), b[i:i + 70_000].view(np.uint8),
                    "float32", "float32")
    one = compare_arrays(a, b)
    got = acc.result()
    for k in ("max_abs_err", "max_rel_err", "mean_abs_err", "rmse", "within", "cosine"):
        assert got[k] == pytest.approx(one[k], rel=1e-6), k


def test_dtype_fair_tolerance():
    rng = np.random.default_rng(4)
    a = rng.standard_normal(4096).astype(np.float32)
    bits = (a.view(np.uint32) + 0x8000) >> 16  # round to bf16 (ties away, fine here)
    b = decode(bits.astype(np.uint16).view(np.uint8), "bfloat16")
    assert compare_arrays(a, b, dtype_a="float32", dtype_b="bfloat16")["verdict"] == "same"
    assert compare_arrays(a, b, dtype_a="float32", dtype_b="float32")["verdict"] == "diverged"
    rtol, atol, cos = Tolerance(rtol=0.5).resolve("float32", "bfloat16")
    assert rtol == 0.5 and atol == pytest.approx(1e-2)


def test_decode_bf16_and_fp8():
    bf = np.array([0x3F80, 0xC000, 0x7FC0], np.uint16)  # 1, -2, nan
    out = decode(bf.view(np.uint8), "bfloat16")
    assert out[0] == 1.0 and out[1] == -2.0 and math.isnan(out[2])
    e4 = decode(np.array([0x38, 0x7E, 0x7F, 0x01], np.uint8), "float8_e4m3fn")
    assert e4[0] == 1.0 and e4[1] == 448.0 and math.isnan(e4[2]) and e4[3] == 2.0 ** -9
    e5 = decode(np.array([0x3C, 0x7C, 0x7B], np.uint8), "float8_e5m2")
    assert e5[0] == 1.0 and e5[1] == np.inf and e5[2] == 57344.0


def test_tolerance_validation():
    with pytest.raises(ConfigError, match="rtol"):
        Tolerance(rtol=-1)
    with pytest.raises(ConfigError, match="cosine_min"):
        Tolerance(cosine_min=2)


def test_compare_stats():
    row = dict(dtype="float32", numel=100, min=-1.0, max=2.0, mean=0.1, norm=10.0, nan=0,
               posinf=0, neginf=0, checksum=123)
    same = compare_stats(row, dict(row), Tolerance())
    assert same["verdict"] == "same" and same["checksum_equal"] is True
    other = dict(row, max=2.5, checksum=7)
    res = compare_stats(row, other, Tolerance())
    assert res["verdict"] == "diverged" and "max" in res["reason"]
    assert res["max_rdiff"] == pytest.approx(0.2)
    nan = compare_stats(row, dict(row, nan=3, checksum=1), Tolerance())
    assert nan["nan_diff"] == 3 and nan["verdict"] == "diverged"
    assert compare_stats(row, dict(row, dtype="bfloat16", checksum=5), Tolerance())[
        "checksum_equal"] is None


def test_judge_tensor_reports_reason():
    v = judge_tensor(dict(nan_diff=0, inf_diff=0, within=0.5, max_abs_err=1.0, cosine=0.9), 0.99)
    assert v["verdict"] == "diverged" and "50%" in v["reason"] and "cosine" in v["reason"]


def test_cosine_of_rounding_noise_around_zero_is_not_judged():
    """A conv bias followed by BatchNorm gets a gradient of rounding noise (~1e-9): its cosine
    between two runs is meaningless, the elements are all within atol, and the record is the
    same. The cosine still counts once either side rises above atol."""
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(8) * 3e-9).astype(np.float32)
    b = (rng.standard_normal(8) * 3e-9).astype(np.float32)
    m = compare_arrays(a, b)
    assert m["cosine"] < 0.99 and m["within"] == 1.0 and m["rms"] < 1e-5
    assert m["verdict"] == "same", m["reason"]
    # the same directions at a scale atol cannot excuse: the cosine decides
    big = compare_arrays(a * 1e6, b * 1e6, Tolerance(rtol=2.0, atol=1e-5))
    assert big["within"] == 1.0 and big["verdict"] == "diverged"
    assert "cosine" in big["reason"]
    # judge_tensor without the RMS (older callers) judges the cosine as before
    assert judge_tensor({**m, "rms": math.inf}, 0.99999, 1e-5)["verdict"] == "diverged"
