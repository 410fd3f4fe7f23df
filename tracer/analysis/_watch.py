"""Watchpoints (after MindInsight's debugger): conditions on a record's statistics, checked live
while dumping and offline on a dump by `tracer.check`.

A condition looks only at one statistics row (min, max, mean, norm, counts), plus, for weight
conditions, the parameter's value before the update, so checking never reads tensor bytes.
Live checking plugs into the writer as an observer (a callable that receives each record's
statistics row) and records hits with `writer.add_hit`; `"on_hit": "raise"` stops the run at the
first hit with `WatchpointHit`.
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

from tracer._errors import ConfigError, WatchpointHit, warn
from tracer._validate import check_scalar
from tracer.analysis._headroom import FLOAT_RANGES, log2_range, overflow_bits

Condition = Literal["nan_inf", "all_zero", "max_abs_gt", "max_abs_lt", "mean_gt", "mean_lt",
                    "out_of_range", "weight_change_gt", "weight_change_lt", "unchanged_weight",
                    "grad_explode", "grad_vanish", "overflow_headroom_lt", "zero_share_gt"]
CONDITIONS: dict[str, str] = {
    "nan_inf": "a NaN or an infinity (overflow) in the tensor",
    "all_zero": "every element is zero",
    "max_abs_gt": "max |x| above `threshold` (too large)",
    "max_abs_lt": "max |x| below `threshold` (too small)",
    "mean_gt": "mean above `threshold`",
    "mean_lt": "mean below `threshold`",
    "out_of_range": "an element below `low` or above `high`",
    "weight_change_gt": "|update| / |weight| above `threshold` (optimizer update records)",
    "weight_change_lt": "|update| / |weight| below `threshold` (optimizer update records)",
    "unchanged_weight": "the optimizer step left the weight exactly as it was",
    "grad_explode": "gradient L2 norm above `threshold` (default 1e3)",
    "grad_vanish": "gradient L2 norm below `threshold` (default 1e-7)",
    "overflow_headroom_lt": "fewer than `threshold` bits (powers of two) between max |x| and the "
                            "dtype's largest value (default: half the dtype's range, 8 bits for "
                            "float16, 64 for float32 and bfloat16, below which x*x overflows)",
    "zero_share_gt": "more than `threshold` (a share from 0 to 1) of a float tensor's elements "
                     "are exactly zero",
}
_NEEDS_THRESHOLD = {"max_abs_gt", "max_abs_lt", "mean_gt", "mean_lt", "weight_change_gt",
                    "weight_change_lt", "zero_share_gt"}
# Conditions on a magnitude (|x|, a norm, a ratio of norms): a negative threshold fires on every
# record (or never), which is a sign error, not a watchpoint.
_MAGNITUDE = {"max_abs_gt", "max_abs_lt", "weight_change_gt", "weight_change_lt", "grad_explode",
              "grad_vanish"}
_DEFAULT_THRESHOLD = {"grad_explode": 1e3, "grad_vanish": 1e-7}
# what a missing threshold's message suggests, where 1e4 would be wrong
_EXAMPLE_THRESHOLD = {"zero_share_gt": 0.9}


def _suggest(value: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(value, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True, kw_only=True)
class WatchConfig:
    """One watchpoint: a condition, the records it applies to, and what a hit does."""

    condition: Condition
    """What to watch for; one of CONDITIONS (nan_inf, all_zero, max_abs_gt, ...)."""
    threshold: float | None = None
    """The limit of *_gt / *_lt / grad_* conditions."""
    low: float | None = None
    """Lower bound of out_of_range."""
    high: float | None = None
    """Upper bound of out_of_range."""
    names: tuple[str, ...] = ()
    """Record-name globs the watchpoint applies to ("layers.*.forward.*"); empty = all."""
    on_hit: Literal["record", "raise"] = "record"
    """record: store the hit in the dump's /hits and go on; raise: stop the run (WatchpointHit)."""

    def __post_init__(self) -> None:
        if self.condition not in CONDITIONS:
            raise ConfigError(f"condition: unknown {self.condition!r}"
                              f"{_suggest(str(self.condition), CONDITIONS)} "
                              f"(choices: {', '.join(CONDITIONS)})")
        if self.on_hit not in ("record", "raise"):
            raise ConfigError(f"on_hit: expected 'record' or 'raise', got {self.on_hit!r}"
                              f"{_suggest(str(self.on_hit), ('record', 'raise'))}")
        for key in ("threshold", "low", "high"):
            # A NaN limit compares false with everything, so the watchpoint would never fire.
            bounds = ((0, math.inf, "") if key == "threshold" and self.condition in _MAGNITUDE
                      else (-math.inf, math.inf, ""))
            check_scalar(key, getattr(self, key), "float | None", bounds)
        self._check_share_or_bits()
        if self.low is not None and self.high is not None and not self.low < self.high:
            raise ConfigError(f"out_of_range: low={self.low!r} must be below high={self.high!r}")
        if self.condition in _NEEDS_THRESHOLD and self.threshold is None:
            example = _EXAMPLE_THRESHOLD.get(self.condition, 1e4)
            raise ConfigError(f"condition {self.condition} needs a threshold, e.g. "
                              f'{{"condition": "{self.condition}", "threshold": {example:g}}}')
        if self.condition == "out_of_range" and self.low is None and self.high is None:
            raise ConfigError('condition out_of_range needs "low" and/or "high"')
        names = self.names
        if isinstance(names, str):
            names = (names,)
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"names: expected a list of globs, got {self.names!r}")
        object.__setattr__(self, "names", tuple(names))

    def _check_share_or_bits(self) -> None:
        """The headroom conditions' thresholds have units of their own; a value outside them
        would fire on every float record or on none, so it is refused with the fix."""
        t, c = self.threshold, self.condition
        if t is None:
            return
        if c == "overflow_headroom_lt" and not t > 0:
            raise ConfigError(f"threshold: {t!r} is out of range for overflow_headroom_lt: it is "
                              "the room left below the dtype's largest value in bits (powers of "
                              "two), above 0, e.g. 8 (float16's largest value is about 2^16)")
        if c == "zero_share_gt" and not 0 <= t < 1:
            if 1 < t <= 100:
                fix = f"for {t:g}% use {t / 100:g}"
            elif t >= 1:
                fix = "a tensor whose every element is zero is the all_zero condition"
            else:
                fix = "e.g. 0.9 for more than 90% zeros"
            raise ConfigError(f"threshold: {t!r} is out of range for zero_share_gt: it is a "
                              f"share of the elements, from 0 to below 1; {fix}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WatchConfig:
        """Build from a JSON object, rejecting unknown keys with the closest valid name."""
        if not isinstance(d, dict):
            raise ConfigError(f"a watchpoint is an object like {{\"condition\": \"nan_inf\"}}, "
                              f"got {d!r}")
        keys = [f.name for f in dataclasses.fields(cls)]
        for k in d:
            if k not in keys:
                raise ConfigError(f"unknown key {k!r}{_suggest(k, keys)} (keys: "
                                  f"{', '.join(keys)})")
        if "condition" not in d:
            raise ConfigError('a watchpoint needs "condition" (e.g. "nan_inf")')
        return cls(**d)

    @property
    def limit(self) -> float | None:
        return self.threshold if self.threshold is not None else _DEFAULT_THRESHOLD.get(
            self.condition)

    def applies_to(self, row: dict[str, Any]) -> bool:
        name = str(row.get("name", ""))
        if self.names and not any(fnmatch.fnmatchcase(name, p) for p in self.names):
            return False
        c = self.condition
        if c.startswith("grad_"):
            return row.get("direction") == "grad"
        if c.startswith("weight_change") or c == "unchanged_weight":
            return row.get("phase") == "optimizer" and row.get("direction") == "update"
        return True

    def evaluate(self, row: dict[str, Any], param_norm: float | None = None) -> float | None:
        """The measured value when `row` hits this watchpoint, else None. `param_norm` is the
        norm of the weight before its update (for weight_change_*)."""
        if not self.applies_to(row):
            return None
        numel = int(row.get("numel", 0))
        c, t = self.condition, self.limit
        if c == "nan_inf":
            bad = int(row.get("nan", 0)) + int(row.get("posinf", 0)) + int(row.get("neginf", 0))
            return float(bad) if bad else None
        if numel == 0:
            return None
        lo, hi, mean, norm = (float(row.get(k, math.nan)) for k in ("min", "max", "mean", "norm"))
        if c == "all_zero":
            return float(numel) if int(row.get("zeros", 0)) == numel else None
        if c in ("max_abs_gt", "max_abs_lt"):
            m = max(abs(lo), abs(hi))
            if math.isnan(m):
                return None
            return m if (m > t if c.endswith("gt") else m < t) else None
        if c in ("mean_gt", "mean_lt"):
            return mean if (mean > t if c.endswith("gt") else mean < t) else None
        if c == "out_of_range":
            if self.low is not None and lo < self.low:
                return lo
            if self.high is not None and hi > self.high:
                return hi
            return None
        if c in ("grad_explode", "grad_vanish"):
            return norm if (norm > t if c == "grad_explode" else norm < t) else None
        if c == "overflow_headroom_lt":
            # -inf for a record holding an infinity (it overflowed); a NaN row has no max |x|
            bits = overflow_bits(row)
            if bits is None:
                return None
            if t is None:
                # half the dtype's range: below it the value's square overflows (a variance, an
                # L2 norm, q.k in attention), the usual first Inf of a run that blows up; a
                # fixed number of bits would be 8 of float16's 16 but 8 of float32's 128
                t = log2_range(str(row.get("dtype")))[0] / 2
            return bits if bits < t else None
        if c == "zero_share_gt":
            if str(row.get("dtype")) not in FLOAT_RANGES:
                return None  # integer and bool zeros are ids and masks, not lost values
            share = int(row.get("zeros", 0)) / numel
            return share if share > t else None
        if c == "unchanged_weight":
            return 0.0 if int(row.get("zeros", 0)) == numel else None
        if c in ("weight_change_gt", "weight_change_lt"):
            if param_norm is None or not param_norm > 0:
                return None
            ratio = norm / param_norm
            return ratio if (ratio > t if c.endswith("gt") else ratio < t) else None
        raise AssertionError(c)


def validate_watch(d: dict[str, Any]) -> WatchConfig:
    """Validate one watchpoint object of a dump config's `watch` list (called by DumpConfig)."""
    return WatchConfig.from_dict(d)


def parse_watch(watch: Any) -> list[WatchConfig]:
    """A list of WatchConfig from WatchConfig objects, dicts, or a DumpConfig's `watch`."""
    if watch is None:
        return []
    if isinstance(watch, (WatchConfig, dict)):
        watch = [watch]
    out = []
    for i, w in enumerate(watch):
        try:
            out.append(w if isinstance(w, WatchConfig) else WatchConfig.from_dict(w))
        except ConfigError as e:
            raise ConfigError(f"watch[{i}]: {e}") from e
    return out


def _owner_scope(name: str) -> str:
    return name.split(".optimizer.", 1)[0]


def describe_hit(hit: dict[str, Any]) -> str:
    """One line naming the record, op, module, phase, step, rank and source of a hit."""
    op = f"op {hit['op']} in " if hit.get("op") else ""
    where = ", ".join(f"{k} {hit[k]}" for k in ("step", "rank") if hit.get(k) is not None)
    return (f"watchpoint {hit['condition']} hit by {hit['name']} ({op}module "
            f"{hit.get('module', '?')}, {hit.get('phase', '?')}{', ' + where if where else ''})"
            f" at {hit.get('source') or 'unknown source'}: value {hit['value']:.6g}")


class Watcher:
    """Evaluates watchpoints row by row; remembers weight norms for the weight conditions.

    Weight conditions read the `update` records (value after minus value before the optimizer
    step). A dump without them (`"params"` records but no optimizer step seen) falls back to
    comparing a weight with its value at the previous dumped step: `unchanged_weight` by
    checksum, `weight_change_*` by the relative change of the norm (a lower bound of the true
    change).
    """

    def __init__(self, watch: Iterable[WatchConfig]) -> None:
        self.watch = list(watch)
        self._param_norm: dict[str, float] = {}
        self._has_update: set[str] = set()
        self._prev: dict[str, tuple[Any, float, int, str]] = {}  # scope -> step, norm, sum, dtype

    def check(self, row: dict[str, Any]) -> list[tuple[WatchConfig, dict[str, Any]]]:
        """The hits of one row, each as (watchpoint, hit dict)."""
        hits = []
        if row.get("phase") == "optimizer":
            scope = _owner_scope(str(row.get("name", "")))
            if row.get("direction") == "param":
                self._param_norm[scope] = float(row.get("norm", 0))
                hits += self._between_steps(scope, row)
            elif row.get("direction") == "update":
                self._has_update.add(scope)
        for w in self.watch:
            pn = None
            if w.condition.startswith("weight_change"):
                pn = self._param_norm.get(_owner_scope(str(row.get("name", ""))))
            value = w.evaluate(row, pn)
            if value is not None:
                hits.append((w, _hit(row, w, value)))
        return hits

    def _between_steps(self, scope: str, row: dict[str, Any]) -> list:
        step, norm = row.get("step"), float(row.get("norm", 0))
        prev = self._prev.get(scope)
        self._prev[scope] = (step, norm, int(row.get("checksum", 0)), str(row.get("dtype")))
        if prev is None or scope in self._has_update or prev[0] == step:
            return []
        hits = []
        for w in self.watch:
            if w.names and not any(fnmatch.fnmatchcase(str(row.get("name")), p) for p in w.names):
                continue
            if w.condition == "unchanged_weight":
                if prev[2] == int(row.get("checksum", 0)) and prev[3] == str(row.get("dtype")):
                    hits.append((w, _hit(row, w, 0.0)))
            elif w.condition.startswith("weight_change") and prev[1] > 0:
                ratio = abs(norm - prev[1]) / prev[1]
                limit = w.limit
                assert limit is not None
                if ratio > limit if w.condition.endswith("gt") else ratio < limit:
                    hits.append((w, _hit(row, w, ratio)))
        return hits


def _hit(row: dict[str, Any], w: WatchConfig, value: float) -> dict[str, Any]:
    hit = {k: row.get(k) for k in ("seq", "name", "module", "op", "phase", "source", "step",
                                   "rank")}
    hit.update(condition=w.condition, value=float(value), on_hit=w.on_hit)
    return hit


class _WatchHandle:
    """Removes the watch observer from its writer; idempotent, usable as a context manager."""

    def __init__(self, writer: Any, observer: Callable) -> None:
        self._writer, self._observer = writer, observer

    def remove(self) -> None:
        obs = getattr(self._writer, "observers", None)
        if obs is not None and self._observer in obs:
            obs.remove(self._observer)
        self._writer = None

    def __enter__(self) -> _WatchHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def install_watch(writer: Any, config: Any) -> _WatchHandle | None:
    """Check the watchpoints of `config` (a DumpConfig, or a list of watchpoints) on every record
    `writer` makes: hits go to `writer.add_hit`, and `on_hit: raise` raises WatchpointHit.

    Also keeps a flight recorder (the last steps' statistics) that is written next to the dump
    when a watchpoint raises, on an uncaught exception, or on SIGTERM, with or without
    watchpoints ($SLEUTH_FLIGHT_STEPS=0 turns it off). Returns None when there is no watchpoint.
    """
    recorder = None
    try:
        from tracer.analysis._flight import install_flight_recorder

        recorder = install_flight_recorder(writer, config)
    except Exception as e:  # noqa: BLE001 - the flight recorder is a best-effort extra
        warn(f"no flight recorder for this run ({e})", stacklevel=2)
    watch = parse_watch(getattr(config, "watch", config))
    if not watch:
        return None
    watcher = Watcher(watch)

    def observer(row: dict[str, Any]) -> None:
        for w, hit in watcher.check(row):
            if hit.get("step") is None:
                hit["step"] = getattr(writer, "step", None)
            if hit.get("rank") is None:
                hit["rank"] = getattr(writer, "rank", None)
            writer.add_hit(hit)
            if w.on_hit == "raise":
                message = describe_hit(hit)
                if recorder is not None and recorder.keeps:
                    path = recorder.save(reason=message)
                    message += f"; the last steps' statistics are in {path}"
                raise WatchpointHit(message, hit)

    writer.observers.append(observer)
    return _WatchHandle(writer, observer)
