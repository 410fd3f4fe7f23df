"""`headroom_trend`: the records of a dump heading toward overflow or underflow, found from the
statistics rows of the steps it holds (never tensor bytes) before any NaN exists.

Per record name and rank, over the dumped steps:

- **toward overflow**: log2 max |x| fitted against the step number by least squares; a growth g
  bits per step and a headroom of h bits (tracer.analysis._headroom) leave h / g steps;
- **toward underflow**: the share of exact zeros fitted the same way and rising toward 1, and
  records whose max |x| is already below the dtype's smallest normal (every element subnormal or
  zero) without climbing back.

A falling max |x| is projected too (`HeadroomReport.table`, `underflow_left`) but not listed: the
gradients and updates of a run that converges fall that way for a while, and in float16 nearly
all of them would be listed. Values that do underflow become zeros, which the zero share counts.

Two guards keep a healthy run quiet. A growth that is additive (a straight line in |x| fits the
steps better than one in log2 |x|: what steady optimizer updates do to a weight that starts at
zero, like a bias) is projected as additive; projected as multiplicative, every bias growing
from zero would look like an overflow within a hundred steps. And a trend is listed only when
even the slowest growth the fit allows (the slope minus `MIN_T` standard errors) reaches the limit
within the horizon, so neither the noise of a few steps nor a slow drift stretched far beyond the
dumped steps (a ReLU's zero share moving by a percent) is read as a trend. Records with fewer than `MIN_STEPS` steps are not projected, and a record that
already holds a NaN or an infinity is listed as such: where it started is `first_nan_origin`'s
question.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from tracer._config import _as_str_tuple
from tracer._dtype_ranges import FLOAT_RANGES, log2_range
from tracer._errors import ConfigError
from tracer.analysis._check import Coverage, _allow, _allowed_names, read_steps
from tracer.analysis._diff import _rows
from tracer.analysis._headroom import record_headroom

DEFAULT_HORIZON = 100.0
"""Steps ahead a trend is listed within: far enough to act on (stop, lower the learning rate,
change a dtype), near enough that a straight line through the dumped steps still says
something. `sleuth check --headroom --horizon N` changes it."""
MIN_STEPS = 3
"""Fewer points than this fit any line exactly, so no trend is projected from them."""
MIN_T = 2.0
"""Standard errors taken off a slope before it is projected against the horizon."""

_KEEP = ("seq", "name", "module", "op", "phase", "direction", "source", "dtype", "numel", "min",
         "max", "mean", "norm", "nan", "posinf", "neginf", "zeros")
_WHO = ("rank", "name", "module", "op", "phase", "direction", "source", "dtype")
OVERFLOW_COLUMNS = (*_WHO, "steps", "first_step", "last_step", "seq", "max_abs",
                    "headroom_bits", "growth_bits", "fit", "steps_left", "at_step",
                    "square_steps_left")
UNDERFLOW_COLUMNS = (*_WHO, "kind", "steps", "first_step", "last_step", "seq", "zero_share",
                     "zero_share_per_step", "max_abs", "underflow_bits", "growth_bits",
                     "smallest_bits", "smallest_exact", "fit", "steps_left", "at_step")
NONFINITE_COLUMNS = (*_WHO, "first_step", "seq", "nan", "posinf", "neginf", "steps")


@dataclass
class HeadroomReport:
    """What `headroom_trend` found. The three tables are pandas DataFrames, soonest first."""

    overflow: Any
    """Records heading toward overflow within `horizon` steps (OVERFLOW_COLUMNS): headroom_bits
    now, growth_bits per step, the fit ("log2": multiplicative, "linear": additive), steps_left
    and at_step, the first step the trend is past the dtype's largest value, and
    square_steps_left, the steps until x*x overflows (headroom below half the dtype's range:
    where a variance, a norm or q.k in attention make the first Inf)."""
    underflow: Any
    """Records heading toward underflow within `horizon` (UNDERFLOW_COLUMNS); `kind` is
    "zero_share" (the share of exact zeros rising toward 1) or "subnormal" (max |x| already
    below the smallest normal and not rising: steps_left 0)."""
    nonfinite: Any
    """Records already holding NaN or Inf (not projected; NONFINITE_COLUMNS), by first step."""
    table: Any
    """Every projected record: its headroom at its last step (headroom_bits, underflow_bits,
    zero_share), the fitted growth_bits and fit, and the steps left by each projection
    (overflow_left, square_left, underflow_left for a falling max |x|, zero_left; inf when
    none)."""
    horizon: float = DEFAULT_HORIZON
    window: int | None = None
    min_steps: int = MIN_STEPS
    steps: dict[int, list[int]] = field(default_factory=dict)
    """The steps read, per rank."""
    records: int = 0
    """Float records (per rank and name) read."""
    projected: int = 0
    """Of them, those with at least `min_steps` steps and no NaN/Inf."""
    too_few: int = 0
    """Of them, those with fewer than `min_steps` steps: not projected."""
    coverage: dict[str, Any] = field(default_factory=dict)
    """`Coverage.to_dict()`: the step files read, those that could not be, interrupted ones."""

    @property
    def found(self) -> bool:
        return bool(len(self.overflow) or len(self.underflow) or len(self.nonfinite))

    @property
    def verdict(self) -> tuple[int, str]:
        """(exit code, why), as `sleuth check` gives them: 0 nothing heading anywhere in a dump
        read completely, 1 found, 2 not everything read or nothing could be projected."""
        cov = {"read": 0, "unread": [], "interrupted": [], **self.coverage}
        unfound = None if self.projected else self.no_trend_reason()
        return Coverage.verdict(cov, self.found, unfound=unfound)

    @property
    def exit_code(self) -> int:
        return self.verdict[0]

    def no_trend_reason(self) -> str:
        most = max((len(s) for s in self.steps.values()), default=0)
        if not self.records:
            return "no trend can be projected: the steps read hold no floating-point record"
        return (f"no trend can be projected: no record holds {self.min_steps} or more dumped "
                f"steps without NaN/Inf (the most steps a rank holds: {most}); dump more steps")

    def to_dict(self) -> dict[str, Any]:
        code, verdict = self.verdict
        return {"status": {0: "clean", 1: "hit", 2: "incomplete"}[code], "exit_code": code,
                "verdict": verdict, "found": self.found, "horizon": self.horizon,
                "window": self.window, "min_steps": self.min_steps,
                "steps": {str(r): s for r, s in self.steps.items()}, "records": self.records,
                "projected": self.projected, "too_few": self.too_few,
                "overflow": _records(self.overflow), "underflow": _records(self.underflow),
                "nonfinite": _records(self.nonfinite), "read": self.coverage.get("read", 0),
                "unread": self.coverage.get("unread", []),
                "interrupted": self.coverage.get("interrupted", [])}


def _records(df: Any) -> list[dict[str, Any]]:
    out = []
    for row in df.to_dict("records"):
        clean = {}
        for k, v in row.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, float) and not math.isfinite(v):
                v = None if math.isnan(v) else str(v)
            clean[k] = v
        out.append(clean)
    return out


def _check_args(horizon: float, window: int | None, min_steps: int) -> None:
    if isinstance(horizon, bool) or not isinstance(horizon, (int, float)) or not horizon > 0 \
            or not math.isfinite(horizon):
        raise ConfigError(f"horizon: {horizon!r} is out of range; it is a number of steps "
                          "ahead, above 0, e.g. 100")
    if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < MIN_STEPS:
        raise ConfigError(f"min_steps: {min_steps!r} is out of range; a line through fewer than "
                          f"{MIN_STEPS} points has no error to judge it by: use {MIN_STEPS} or "
                          "more")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < min_steps):
        raise ConfigError(f"window: {window!r} is out of range; it is the number of each "
                          f"record's last dumped steps to fit, at least min_steps ({min_steps})")


def _linfit(gid: Any, ngroups: int, t: Any, y: Any) -> tuple[Any, Any, Any, Any]:
    """Least squares of y on t per group: (n, slope, r2, standard error of the slope)."""
    import numpy as np

    n = np.bincount(gid, minlength=ngroups).astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        tm = np.bincount(gid, t, ngroups) / n
        ym = np.bincount(gid, y, ngroups) / n
        dt, dy = t - tm[gid], y - ym[gid]
        stt = np.bincount(gid, dt * dt, ngroups)
        sty = np.bincount(gid, dt * dy, ngroups)
        syy = np.bincount(gid, dy * dy, ngroups)
        slope = np.where(stt > 0, sty / stt, 0.0)
        ssr = np.maximum(syy - slope * sty, 0.0)
        r2 = np.where(syy > 0, 1.0 - ssr / syy, 1.0)
        se = np.where((n > 2) & (stt > 0), np.sqrt(ssr / np.maximum(n - 2, 1) / stt), np.inf)
    return n, slope, r2, se


def headroom_trend(path: str | os.PathLike | Any, *, rank: int | None = None,
                   horizon: float = DEFAULT_HORIZON, window: int | None = None,
                   min_steps: int = MIN_STEPS, nan_allow: Iterable[str] = ()) -> HeadroomReport:
    """Which records of a dump are heading toward overflow or underflow (module doc).

    Args:
        path: run directory, dump directory or step file (or an open Dump).
        rank: only this rank (default: each rank on its own).
        horizon: list a trend that reaches its limit within this many steps after the record's
            last dumped step.
        window: fit only each record's last `window` dumped steps (default: all of them).
        min_steps: fewest steps a record needs to be projected (at least 3).
        nan_allow: record-name patterns whose NaN/Inf are intended (added to the dump config's
            `nan_allow`), not listed as non-finite.

    Raises:
        DumpFormatError for a missing dump or rank; ConfigError for a bad argument.
    """
    import numpy as np
    import pandas as pd

    from tracer.storage import open_dump

    _check_args(horizon, window, min_steps)
    patterns = _as_str_tuple("nan_allow", list(nan_allow))
    dump = path if hasattr(path, "stats") else open_dump(path)
    coverage = Coverage()
    frames, steps = [], {}
    for r, s, df, attrs in read_steps(dump, coverage, rank=rank):
        steps.setdefault(r, []).append(s)
        if not len(df):
            continue
        df = df[df["dtype"].isin(list(FLOAT_RANGES)) & (df["numel"] > 0)]
        if not len(df):
            continue
        part = df.loc[:, list(_KEEP)].copy()
        bad = (part["nan"] + part["posinf"] + part["neginf"]) > 0
        recs = _rows(df[bad]) if bad.any() else []
        allowed = (_allowed_names(recs, _allow(patterns, attrs, recs, str(dump.path(r, s))))
                   if recs else set())
        part["unallowed_bad"] = bad & ~part["name"].isin(allowed)
        part["rank"], part["step"] = r, s
        frames.append(part)
    report = HeadroomReport(*(pd.DataFrame(columns=list(c)) for c in (
        OVERFLOW_COLUMNS, UNDERFLOW_COLUMNS, NONFINITE_COLUMNS)), pd.DataFrame(),
        horizon=float(horizon), window=window, min_steps=min_steps,
        steps={r: sorted(s) for r, s in steps.items()}, coverage=coverage.to_dict())
    if not frames:
        return report
    tab = pd.concat(frames, ignore_index=True)
    tab = tab.sort_values(["rank", "name", "step"], kind="stable").reset_index(drop=True)
    tab["gid"] = tab.groupby(["rank", "name"], sort=False).ngroup()
    ngroups = int(tab["gid"].max()) + 1
    report.records = ngroups

    # records already non-finite: listed, never projected
    bad_rows = tab[tab["unallowed_bad"]]
    bad_gids = set(bad_rows["gid"].tolist())
    if len(bad_rows):
        first = bad_rows.groupby("gid", sort=False).head(1).copy()
        first["first_step"] = first["step"]
        first["steps"] = first["gid"].map(bad_rows.groupby("gid").size())
        report.nonfinite = first.sort_values(["first_step", "seq", "rank"], kind="stable")[
            list(NONFINITE_COLUMNS)].reset_index(drop=True)

    if window is not None:
        tab = tab[tab.groupby("gid").cumcount(ascending=False) < window]
    counts = np.bincount(tab["gid"].to_numpy(), minlength=ngroups)
    ok = counts >= min_steps
    if bad_gids:
        ok[list(bad_gids)] = False
    report.too_few = int((counts < min_steps).sum())
    report.projected = int(ok.sum())
    if not report.projected:
        return report
    tab = tab[ok[tab["gid"].to_numpy()]].reset_index(drop=True)

    logs = {k: log2_range(k) for k in FLOAT_RANGES}
    tab["log_max"] = tab["dtype"].map(lambda d: logs[d][0])
    tab["log_tiny"] = tab["dtype"].map(lambda d: logs[d][1])
    m = np.maximum(tab["min"].abs().to_numpy(), tab["max"].abs().to_numpy())
    tab["max_abs"] = m
    tab["zero_share"] = tab["zeros"].to_numpy() / tab["numel"].to_numpy()
    groups = range(ngroups)

    # the zero share, over every step
    gid, t = tab["gid"].to_numpy(), tab["step"].to_numpy(dtype=float)
    _, zslope, _, zse = _linfit(gid, ngroups, t, tab["zero_share"].to_numpy())
    last = tab.groupby("gid", sort=False).tail(1).set_index("gid").reindex(groups)
    first_step = tab.groupby("gid", sort=False)["step"].min().reindex(groups)

    # max |x|, over the steps where it has a logarithm; both fits, the better one projects
    mag = tab[np.isfinite(m) & (m > 0)]
    mgid, mt = mag["gid"].to_numpy(), mag["step"].to_numpy(dtype=float)
    ylog = np.log2(mag["max_abs"].to_numpy())
    yval = np.exp2(ylog - mag["log_max"].to_numpy())  # |x| in units of the dtype's largest
    mn, lslope, lr2, lse = _linfit(mgid, ngroups, mt, ylog)
    _, vslope, vr2, vse = _linfit(mgid, ngroups, mt, yval)
    mlast = mag.groupby("gid", sort=False).tail(1).set_index("gid").reindex(groups)
    mfirst = mag.groupby("gid", sort=False)["step"].min().reindex(groups)

    with np.errstate(divide="ignore", invalid="ignore"):
        has_mag = ok & (mn >= min_steps)
        log_fit = lr2 >= vr2  # a tie goes to the multiplicative fit: the earlier warning
        slope, se = np.where(log_fit, lslope, vslope), np.where(log_fit, lse, vse)
        # the slowest rise (fall) the fit allows: what decides whether a trend is listed
        up, down = slope - MIN_T * se, -slope - MIN_T * se
        mlog = np.log2(mlast["max_abs"].to_numpy(dtype=float))
        head = mlast["log_max"].to_numpy(dtype=float) - mlog
        floor = mlog - mlast["log_tiny"].to_numpy(dtype=float)
        v_last = np.exp2(-head)
        v_tiny = np.exp2(mlast["log_tiny"].to_numpy(dtype=float)
                         - mlast["log_max"].to_numpy(dtype=float))
        growth = np.where(log_fit, lslope, vslope / (v_last * math.log(2)))
        rises = has_mag & (up > 0)
        over_left = np.where(rises, np.where(log_fit, head, 1 - v_last) / slope, np.inf)
        over_slow = np.where(rises, np.where(log_fit, head, 1 - v_last) / up, np.inf)
        half = mlast["log_max"].to_numpy(dtype=float) / 2
        square_left = np.where(rises, np.maximum(np.where(
            log_fit, head - half, np.exp2(-half) - v_last), 0) / slope, np.inf)
        # a falling max |x| is projected for the table only (module doc)
        under_left = np.where(has_mag & (down > 0),
                              np.where(log_fit, np.maximum(floor, 0) / -slope,
                                       np.maximum(v_last - v_tiny, 0) / -slope), np.inf)
        now_log = np.log2(last["max_abs"].to_numpy(dtype=float))
        now_head = last["log_max"].to_numpy(dtype=float) - now_log
        now_floor = now_log - last["log_tiny"].to_numpy(dtype=float)
        # every element subnormal or zero now, and not climbing out of it (a bias leaving its
        # zero initialization passes through the subnormals on its way up)
        subnormal = ok & np.isfinite(now_floor) & (now_floor < 0) & ~rises
        z_last = last["zero_share"].to_numpy(dtype=float)
        zup = zslope - MIN_T * zse
        zero_left = np.where(ok & (zup > 0), (1 - z_last) / zslope, np.inf)
        zero_slow = np.where(ok & (zup > 0), (1 - z_last) / zup, np.inf)

    fit = np.where(has_mag, np.where(log_fit, "log2", "linear"), None)

    def mag_cols(g: int) -> dict[str, Any]:
        return {"steps": int(mn[g]), "first_step": int(mfirst.iat[g]),
                "last_step": int(mlast["step"].iat[g]), "seq": int(mlast["seq"].iat[g]),
                "dtype": str(mlast["dtype"].iat[g]), "max_abs": float(mlast["max_abs"].iat[g]),
                "growth_bits": float(growth[g]), "fit": fit[g]}

    over, under = [], []
    for g in np.flatnonzero(over_slow <= horizon):
        over.append({**_who(last, g), **mag_cols(g),
                     "headroom_bits": float(head[g]), "steps_left": float(over_left[g]),
                     "square_steps_left": float(square_left[g]),
                     "at_step": _at(mlast["step"].iat[g], over_left[g])})
    now = np.where(subnormal, 0.0, np.inf)
    for kind, left, slow in (("zero_share", zero_left, zero_slow), ("subnormal", now, now)):
        for g in np.flatnonzero(slow <= horizon):
            hr = record_headroom(last.iloc[g].to_dict())
            under.append({**_who(last, g), "kind": kind, "steps": int(counts[g]),
                          "first_step": int(first_step.iat[g]),
                          "last_step": int(last["step"].iat[g]), "seq": int(last["seq"].iat[g]),
                          "zero_share": hr["zero_share"],
                          "zero_share_per_step": float(zslope[g]), "max_abs": hr["max_abs"],
                          "underflow_bits": hr["underflow_bits"],
                          "growth_bits": float(growth[g]), "smallest_bits": hr["smallest_bits"],
                          "smallest_exact": hr["smallest_exact"],
                          "fit": "linear" if kind == "zero_share" else None,
                          "steps_left": float(left[g]),
                          "at_step": _at(last["step"].iat[g], left[g])})
    sel = np.flatnonzero(ok)
    report.table = pd.DataFrame({
        **{k: last[k].to_numpy()[sel] for k in _WHO}, "steps": counts[sel],
        "last_step": last["step"].to_numpy()[sel], "max_abs": last["max_abs"].to_numpy()[sel],
        "zero_share": z_last[sel], "zero_share_per_step": zslope[sel],
        "headroom_bits": now_head[sel], "underflow_bits": now_floor[sel],
        "growth_bits": growth[sel],
        "fit": fit[sel], "overflow_left": over_left[sel], "square_left": square_left[sel],
        "underflow_left": under_left[sel],
        "zero_left": zero_left[sel]})
    report.table["rank"] = report.table["rank"].astype(int)
    report.overflow = _sorted(over, OVERFLOW_COLUMNS)
    report.underflow = _sorted(under, UNDERFLOW_COLUMNS)
    return report


def _item(values: Any, g: int) -> Any:
    v = values.iat[g]
    return v.item() if hasattr(v, "item") else v


def _who(last: Any, g: int) -> dict[str, Any]:
    row = {k: _item(last[k], g) for k in _WHO}
    row["rank"] = int(row["rank"])
    return row


def _at(last_step: int, left: float) -> int:
    """The first step at which the trend is past its limit."""
    return int(math.ceil(last_step + left))


def _sorted(rows: list[dict], columns: tuple[str, ...]) -> Any:
    """Soonest first; records projected to reach their limit in the same step in execution
    order (the earlier one gets there first, and what follows it inherits its Inf or zeros)."""
    import pandas as pd

    df = pd.DataFrame(rows, columns=list(columns))
    return df.sort_values(["at_step", "seq", "rank", "name"], kind="stable").reset_index(
        drop=True)
