"""Watch conditions (after MindInsight's debugger): what a watchpoint of a dump config may ask
for, validated when the config is built, and how one statistics row is judged against it.

Beside the config because both sides use it: `DumpConfig` validates its `watch` list here, the
live watch observer (tracer.storage._watch_observer) evaluates each row the writer makes, and
`tracer.check` evaluates a dump's rows offline. A condition looks only at one statistics row
(min, max, mean, norm, counts), plus, for weight conditions, the parameter's value before the
update, so checking never reads tensor bytes.
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from tracer._errors import ConfigError
from tracer._validate import check_scalar
from tracer._dtype_ranges import FLOAT_RANGES, log2_range, overflow_bits

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
