"""Is run B's step time a change or noise? A rank test on the steps plus a floor from their spread.

Step times are not normal (a few slow steps: a collection, a page fault, a neighbour's burst),
so the rule compares medians and uses the Mann-Whitney U test, which asks only whether B's steps
tend to be longer than A's. Significance alone is not enough with many steps (a 0.5 % shift is
significant over 1000 steps and matters to nobody), and a burst of load during one run shifts all
of its steps at once, which no test on steps can tell from a real change. So B is called slower
only when both hold:

1. the one-sided Mann-Whitney p-value that B's steps are longer is at most `alpha` (0.05);
2. B's median step is longer than A's by more than the noise floor: the largest of
   `threshold` (5 %), each run's quartile deviation ((q3 - q1) / 2) relative to its median, so
   a change smaller than the steps' own spread is not called a change, and, where a config was
   profiled more than once, the variation between its runs (`between_runs`): the machine's
   speed drifting from one run to the next moves every step of a run at once, which the steps'
   spread cannot show and only a second run of the same config measures.

With fewer than 3 steps on a side there is no test (3 against 3 fully apart is p = 0.05, the
least the test can say) and rule 2 decides alone; the verdict says so. Pure functions of two
lists of numbers, no numpy: tested on hand-made samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

Verdict = Literal["slower", "faster", "no change"]
MIN_STEPS = 3
_EXACT_MAX = 20  # above this many steps on both sides the normal approximation is used


@dataclass(frozen=True)
class Spread:
    """Step times of one run: how many, median, quartiles and mean (microseconds)."""

    n: int
    median: float
    q1: float
    q3: float
    mean: float

    @property
    def quartile_deviation(self) -> float:
        """(q3 - q1) / 2 relative to the median: the steps' own noise."""
        return (self.q3 - self.q1) / 2 / self.median if self.median > 0 else 0.0


@dataclass(frozen=True)
class Judgement:
    """The verdict on B against A, with what it rests on."""

    verdict: Verdict
    change: float
    """B's median over A's, minus 1 (0.25: B's median step is 25 % longer)."""
    p_slower: float
    """One-sided Mann-Whitney p-value that B's steps are longer (nan: too few steps)."""
    p_faster: float
    noise: float
    """The noise floor applied: the relative change a verdict needs."""
    tested: bool
    """False when a side had fewer than MIN_STEPS steps: the floor alone decided."""
    between: float = math.nan
    """The variation between runs of one config that the floor includes (nan: not measured,
    one profile a side)."""
    floor_from: str = "threshold"
    """What set the floor: "threshold", "spread" (the steps' own) or "between runs"."""
    withheld: str = ""
    """The steps' verdict ("slower", "faster") when it was withheld for going against the
    calls (profiler._diff); "" when none was."""
    calls_share: float = math.nan
    """Where the calls decided (the steps alone could not): what B's change in calls costs a
    step, over A's median step (0.16: B's calls add 16 %); nan where they did not."""
    shapes_share: float = math.nan
    """Where the shapes decided: what the same ops on other input shapes cost a step, read in
    each run alone, over A's median step; nan where they did not."""
    floor_in_run: float = math.nan
    """The floor without the variation between runs: the threshold or the largest spread of
    one run's steps alone (profiler._diff). Calls and shapes are read in each run alone, so
    the machine's speed drifting between runs does not move them, and this is the floor they
    must clear (nan: `noise`)."""

    @property
    def decided_by(self) -> str:
        """"steps", or the evidence load does not move that decided where the steps could not:
        "calls", "shapes" or "calls and shapes"."""
        parts = [name for name, share in (("calls", self.calls_share),
                                           ("shapes", self.shapes_share))
                 if not math.isnan(share)]
        return " and ".join(parts) or "steps"


def between_runs(medians: list[float]) -> float:
    """The variation between runs of one config: the largest median step over the smallest,
    minus 1 (0.06: one run's steps were 6 % longer); nan with fewer than two runs."""
    ms = [m for m in medians if m > 0]
    return max(ms) / min(ms) - 1 if len(ms) >= 2 else math.nan


def spread(values: list[float]) -> Spread:
    xs = sorted(values)
    if not xs:
        return Spread(0, math.nan, math.nan, math.nan, math.nan)
    return Spread(len(xs), _quantile(xs, 0.5), _quantile(xs, 0.25), _quantile(xs, 0.75),
                  sum(xs) / len(xs))


def _quantile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default), of a sorted list."""
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def judge(a: list[float], b: list[float], *, threshold: float = 0.05,
          alpha: float = 0.05, between: float = math.nan) -> Judgement:
    """Whether B's step times are slower, faster or no change beyond noise (module docstring).
    `between`: the variation between runs of one config (`between_runs`), nan if unmeasured."""
    sa, sb = spread(a), spread(b)
    if sa.n == 0 or sb.n == 0 or not sa.median > 0:
        return Judgement("no change", math.nan, math.nan, math.nan, threshold, False, between)
    floors = {"threshold": threshold,
              "spread": max(sa.quartile_deviation, sb.quartile_deviation),
              "between runs": 0.0 if math.isnan(between) else between}
    floor_from = max(floors, key=floors.__getitem__)
    noise = floors[floor_from]
    change = sb.median / sa.median - 1
    tested = min(sa.n, sb.n) >= MIN_STEPS
    p_slower = mann_whitney_greater(b, a) if tested else math.nan
    p_faster = mann_whitney_greater(a, b) if tested else math.nan
    verdict: Verdict = "no change"
    if change > noise and (not tested or p_slower <= alpha):
        verdict = "slower"
    elif sb.median > 0 and sa.median / sb.median - 1 > noise and (not tested or p_faster <= alpha):
        verdict = "faster"
    return Judgement(verdict, change, p_slower, p_faster, noise, tested, between, floor_from)


def mann_whitney_greater(x: list[float], y: list[float]) -> float:
    """One-sided p-value of the Mann-Whitney U test that values of `x` tend to exceed `y`'s.

    U counts the pairs with x > y (ties count one half). Exact (the distribution of U over all
    orderings) when both samples are small, else the normal approximation with continuity and
    tie corrections.
    """
    m, n = len(x), len(y)
    if m == 0 or n == 0:
        return math.nan
    u = sum(1.0 if xi > yj else 0.5 if xi == yj else 0.0 for xi in x for yj in y)
    if m <= _EXACT_MAX and n <= _EXACT_MAX:
        counts = _u_counts(m, n)
        total = sum(counts)
        k = math.ceil(u - 1e-9)  # ties make U a half: count the orderings at least as extreme
        return sum(counts[k:]) / total
    ranks = _ranks(list(x) + list(y))
    ties = _tie_term(list(x) + list(y))
    mu = m * n / 2
    sigma = math.sqrt(m * n / 12 * ((m + n + 1) - ties / ((m + n) * (m + n - 1))))
    if sigma == 0:
        return 1.0
    r1 = sum(ranks[:m])
    u = r1 - m * (m + 1) / 2
    z = (u - mu - 0.5) / sigma
    return 0.5 * math.erfc(z / math.sqrt(2))


@lru_cache(maxsize=256)
def _u_counts(m: int, n: int) -> tuple[int, ...]:
    """How many orderings of m x's and n y's give U = 0, 1, ..., m*n (x above y pairs)."""
    # f[j][u]: orderings of i x's and j y's with U = u, built up over i
    f = [[1] + [0] * (m * n) for _ in range(n + 1)]
    for _i in range(1, m + 1):
        g = [[0] * (m * n + 1) for _ in range(n + 1)]
        for j in range(n + 1):
            for u in range(m * n + 1):
                # the largest value is an x (it beats all j y's) or a y
                v = f[j][u - j] if u >= j else 0
                if j > 0:
                    v += g[j - 1][u]
                g[j][u] = v
        f = g
    return tuple(f[n])


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _tie_term(values: list[float]) -> float:
    counts: dict[float, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return float(sum(t ** 3 - t for t in counts.values()))
