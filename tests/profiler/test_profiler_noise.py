"""The noise rule of `sleuth profile diff` (profiler._noise): Mann-Whitney p-values against
known values, and the verdicts on hand-made step times."""
from __future__ import annotations

import math

import pytest

from profiler._noise import judge, mann_whitney_greater, spread


def test_mann_whitney_exact_values():
    # 3 against 3 fully apart: 1 ordering of C(6, 3) = 20 is as extreme
    assert mann_whitney_greater([4, 5, 6], [1, 2, 3]) == pytest.approx(0.05)
    assert mann_whitney_greater([1, 2, 3], [4, 5, 6]) == pytest.approx(1.0)
    # scipy.stats.mannwhitneyu([1.2, 3.1, 2.2, 5.0], [1.0, 2.0, 3.0], 'greater', exact): 0.2
    assert mann_whitney_greater([1.2, 3.1, 2.2, 5.0], [1.0, 2.0, 3.0]) == pytest.approx(0.2)


def test_mann_whitney_normal_approximation():
    x = [float(i) for i in range(30)]
    y = [v + 0.5 for v in x]
    p = mann_whitney_greater(y, x)  # shifted by half a step: no evidence
    assert 0.2 < p < 0.6
    assert mann_whitney_greater([v + 40 for v in x], x) < 1e-9


def test_verdicts():
    a = [1000, 1010, 990, 1005, 995, 1002]
    assert judge(a, [v * 1.2 for v in a]).verdict == "slower"
    assert judge(a, [v * 0.8 for v in a]).verdict == "faster"
    assert judge(a, [v * 1.02 for v in a]).verdict == "no change"  # under the 5 % threshold
    # a 20 % shift inside steps that spread by +-50 % is not called a change
    wide = [500, 1500, 700, 1300, 1000, 900, 1100]
    j = judge(wide, [v * 1.2 for v in wide])
    assert j.verdict == "no change" and j.noise >= 0.2
    # too few steps for a test: the floor alone decides, and says so
    j = judge([1000], [2000])
    assert j.verdict == "slower" and not j.tested and math.isnan(j.p_slower)


def test_spread():
    s = spread([4.0, 1.0, 3.0, 2.0])
    assert (s.n, s.median, s.q1, s.q3) == (4, 2.5, 1.75, 3.25)
    assert s.quartile_deviation == pytest.approx(0.3)


def test_between_runs():
    from profiler._noise import between_runs
    assert math.isnan(between_runs([1000.0]))
    assert between_runs([1000.0, 1100.0, 1050.0]) == pytest.approx(0.1)
    assert math.isnan(between_runs([]))


def test_the_variation_between_runs_raises_the_floor():
    """Every step of B 12 % longer, tight steps: a change, until two runs of A's own config are
    seen to differ by 20 % (the machine drifting between runs); then it is noise."""
    a = [1000, 1010, 990, 1005, 995, 1002]
    b = [v * 1.12 for v in a]
    j = judge(a, b)
    assert j.verdict == "slower" and j.floor_from == "threshold" and math.isnan(j.between)
    j = judge(a, b, between=0.2)
    assert j.verdict == "no change" and j.noise == pytest.approx(0.2)
    assert j.floor_from == "between runs" and j.between == pytest.approx(0.2)
    # a small variation between runs leaves the threshold as the floor
    j = judge(a, b, between=0.01)
    assert j.verdict == "slower" and j.floor_from == "threshold"
    wide = [500, 1500, 700, 1300, 1000, 900, 1100]
    assert judge(wide, wide).floor_from == "spread"
