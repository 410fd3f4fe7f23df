"""CollectorConfig (what the collector records and when) and the pure schedule function.

The schedule mirrors `torch.profiler.schedule` (skip_first, then cycles of wait / warmup /
active, `repeat` cycles or forever when 0) but is a plain function of the step number so it is
tested without a profiler, and so a disabled collector never has to build one.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from profiler._errors import ConfigError

Action = Literal["none", "warmup", "record", "record_and_save"]

# Default peaks used for MFU when the config gives none. They are stated, not detected: MFU is
# only as meaningful as this number, so the summary records which peak was used.
DEFAULT_PEAK_TFLOPS_CPU = 1.0
"""A modest multi-core fp32 CPU figure (about 1 TFLOP/s); set `peak_tflops` for your CPU."""
DEFAULT_PEAK_TFLOPS_CUDA = 989.0
"""NVIDIA H100 SXM dense bf16 (989 TFLOP/s); set `peak_tflops` for other GPUs or dtypes."""

_ACTIVITIES = ("cpu", "cuda")

# Allowed range of each numeric key (low, high), both ends included; other numeric keys are
# steps or counts from 0 to _MAX_STEPS. Beyond these a value is a typo or a unit mix-up (a
# window of a billion steps never closes, so its trace is never written).
_MAX_STEPS = 1_000_000
_RANGES: dict[str, tuple[float, float]] = {
    "active": (1, 100_000),
    "peak_tflops": (1e-6, 1e6),
    "tokens_per_step": (1, 1e12),
}


@dataclass(frozen=True, kw_only=True)
class CollectorConfig:
    """What `profiler.Collector` records, and on which steps (see docs/profiler.md)."""

    enabled: bool = True
    """False makes the collector a no-op that creates no torch.profiler object."""
    wait: int = 1
    """Steps of each cycle that are not profiled at all."""
    warmup: int = 1
    """Steps traced and discarded before recording (the profiler's own start-up noise)."""
    active: int = 3
    """Steps recorded per window; one trace file is written per window."""
    repeat: int = 1
    """Number of windows; 0 repeats the cycle until the collector is closed."""
    skip_first: int = 0
    """Steps skipped once before the first cycle (compilation, data loader start-up)."""
    activities: tuple[str, ...] = ("cpu", "cuda")
    """Any of "cpu", "cuda"; "cuda" is dropped silently when no CUDA device is available."""
    record_shapes: bool = True
    """Record op input shapes (shown in the op table)."""
    profile_memory: bool = True
    """Record allocations, for the memory timeline."""
    with_stack: bool = False
    """Record Python stacks (expensive); also exports a `.stacks.txt` flame-graph file."""
    with_modules: bool = True
    """Mark each nn.Module call with a record_function range named after its dotted name."""
    with_flops: bool = False
    """Ask torch.profiler for its per-op FLOP estimate (MFU uses the flop counter instead)."""
    count_flops: bool = True
    """Count FLOPs per step for MFU, after each window, from its recorded shapes (needs
    record_shapes) and torch's flop formulas; nothing runs during the step."""
    peak_tflops: float | None = None
    """Peak of one device in TFLOP/s for MFU; None: 989 (H100 bf16) on CUDA, 1.0 on CPU."""
    tokens_per_step: int | None = None
    """Tokens processed per optimizer step on this rank, for tokens/s; None: not reported."""
    write_tables: bool = False
    """Also build the tables when a window closes and write them next to the trace.
    False (default) keeps training-time work to the trace export; readers build tables."""
    table_format: Literal["parquet", "csv"] = "parquet"
    """Format of the tables written with write_tables (readers reuse parquet only)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_number(f.name, getattr(self, f.name), f.type)
        activities = self.activities
        if isinstance(activities, str):
            activities = (activities,)
        activities = tuple(activities)
        bad = [a for a in activities if a not in _ACTIVITIES]
        if bad or not activities:
            raise ConfigError(f"activities must be a non-empty subset of {_ACTIVITIES}, "
                              f"got {self.activities!r}")
        object.__setattr__(self, "activities", activities)
        if self.table_format not in ("parquet", "csv"):
            raise ConfigError(f"table_format must be 'parquet' or 'csv', got {self.table_format!r}")

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CollectorConfig:
        """Build a config from a dict; unknown keys raise ConfigError naming the closest field."""
        if not isinstance(data, dict):
            raise ConfigError(f"a collector config must be a JSON object, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
                raise ConfigError(f"unknown key {key!r}{hint}")
        values = dict(data)
        if "activities" in values and isinstance(values["activities"], list):
            values["activities"] = tuple(values["activities"])
        try:
            return cls(**values)
        except TypeError as e:
            raise ConfigError(str(e)) from e

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> CollectorConfig:
        """Load a config from a JSON file (see from_dict). Only a regular file of bounded size
        is read: a device (`/dev/zero`) or a FIFO given by mistake is refused, not read forever."""
        from tracer.storage import JsonLimitError, read_text_bounded

        try:
            text = read_text_bounded(path)
        except JsonLimitError as e:
            raise ConfigError(f"cannot read collector config {e}") from e

        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            if len({k for k, _ in items}) < len(items):
                twice = next(k for i, (k, _) in enumerate(items) if k in dict(items[:i]))
                raise ConfigError(f"{path}: key {twice!r} appears twice; keep one of them")
            return dict(items)

        def constant(name: str) -> Any:
            raise ConfigError(f"{path}: {name} is not a number a config accepts")

        try:
            data = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from e
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["activities"] = list(self.activities)
        return out

    # ---- schedule ------------------------------------------------------------------------
    def schedule_action(self, step: int) -> Action:
        """What the collector does during `step` (0-based count of `Collector.step()` calls)."""
        return schedule_action(step, wait=self.wait, warmup=self.warmup, active=self.active,
                               repeat=self.repeat, skip_first=self.skip_first)


def _check_number(name: str, value: Any, annotation: str) -> None:
    """Type and range of one bool/int/float field, read from its annotation string."""
    kind, optional = annotation.split(" | ")[0], annotation.endswith("| None")
    if optional and value is None or kind not in ("bool", "int", "float"):
        return
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, int if kind == "int" else (int, float)):
        raise ConfigError(f"{name} must be {'an integer' if kind == 'int' else 'a number'}, "
                          f"got {value!r}")
    low, high = _RANGES.get(name, (0, _MAX_STEPS))
    if not (math.isfinite(value) and low <= value <= high):
        raise ConfigError(f"{name} must be a finite number from {low:.12g} to {high:.12g}, "
                          f"got {value!r}")


def schedule_action(step: int, *, wait: int, warmup: int, active: int, repeat: int = 0,
                    skip_first: int = 0) -> Action:
    """The action for `step`: same semantics as `torch.profiler.schedule`, as strings.

    "record_and_save" marks the last recorded step of a window: the trace is written when that
    step ends.
    """
    if step < 0:
        raise ConfigError(f"step must be >= 0, got {step}")
    if step < skip_first:
        return "none"
    step -= skip_first
    cycle = wait + warmup + active
    if repeat > 0 and step >= repeat * cycle:
        return "none"
    pos = step % cycle
    if pos < wait:
        return "none"
    if pos < wait + warmup:
        return "warmup"
    return "record" if pos < cycle - 1 else "record_and_save"
