"""The dump config: what to dump, where, and how; loaded from a dict, a JSON file or the env.

`DumpConfig` is validated when it is built, so a typo fails before the run starts, with a message
that names the key, the bad value and the closest valid choice. The selection predicates
(`wants_step`, `wants_module`, ...) are called from hot hooks, so they parse nothing and cache
their answers per name.
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from sleuth.common import strict, warn
from tracer._errors import ConfigError
from tracer._validate import check_scalar

ENV_VAR = "SLEUTH_DUMP_CONFIG"
_DEFAULT_RUN_DIR = "./sleuth_run"
STOPPED_BY = 'SLEUTH_STRICT=1 or "on_error": "raise"'
"""What makes a failure of the dump stop the run (`DumpConfig.raises`), as its errors say."""

_CHOICES: dict[str, tuple[str, ...]] = {
    "level": ("module", "op", "mix"),
    "mode": ("statistics", "tensor", "full"),
    "io": ("input", "output", "both"),
    "phases": ("forward", "backward", "both"),
    "writer": ("sync", "async"),
    "on_error": ("raise", "warn"),
    "compiled": ("compiled", "interpret", "eager"),
}
_FILTER_KEYS = ("modules", "exclude_modules", "ops", "exclude_ops")
# Allowed range of each numeric key, (low, high, unit), both ends included. A number outside it is
# a typo or a unit mix-up (1e12 MiB is not a queue bound, it is no bound), so it is refused.
# Numeric keys without an entry must be >= 0; every number must be finite.
_RANGES: dict[str, tuple[float, float, str]] = {
    "async_max_queued_mb": (1, 1 << 20, "MiB"),
}


@dataclass(frozen=True, kw_only=True)
class DumpConfig:
    """What the tracer dumps and how it writes it. See docs/dump-config.md for every key."""

    path: str = ""
    """Run directory; "" means $SLEUTH_RUN_DIR or ./sleuth_run. Files go to {path}/dump/rank{R}/."""
    steps: str = "all"
    """Optimizer steps to dump: "all" or ranges like "0|5-8|100-120" (0-based, ends included)."""
    ranks: str = "all"
    """Ranks that dump: "all" or ranges like "0|1|4-7"."""
    level: Literal["module", "op", "mix"] = "module"
    """module: nn.Module hooks; op: every aten op through a dispatch mode; mix: both."""
    mode: Literal["statistics", "tensor", "full"] = "statistics"
    """statistics: no tensor bytes; tensor: exact data too (statistics are kept); full: both."""
    modules: tuple[str, ...] = ()
    """Dotted module names to include: globs ("layers.*.attn") or "re:<regex>"; empty = all."""
    exclude_modules: tuple[str, ...] = ()
    """Dotted module names to leave out, same syntax; applied after `modules`."""
    ops: tuple[str, ...] = ()
    """Aten op names to include ("aten.mm", "aten.*softmax*", "re:..."); empty = all."""
    exclude_ops: tuple[str, ...] = ()
    """Aten op names to leave out, same syntax; applied after `ops`."""
    io: Literal["input", "output", "both"] = "both"
    """Which tensors of a call to dump."""
    phases: Literal["forward", "backward", "both"] = "both"
    """Which passes to dump."""
    params: bool = True
    """Dump parameters, gradients and updates at the end of each dumped step."""
    sketch: bool = True
    """Statistics mode: keep a sketch of each record, 128 of its elements at positions every run
    picks alike (512 bytes a record), so that a diff sees elements that moved (docs/diff.md)."""
    writer: Literal["sync", "async"] = "async"
    """sync: a record is on disk when the hook returns; async: a writer thread persists it."""
    async_max_queued_mb: int = 1024
    """Async back-pressure: the training thread waits while this many MiB are queued."""
    file_process: bool = True
    """Async writer: write the HDF5 part of each step file in one helper process per training
    process (h5py holds the GIL while it writes); false keeps it in the writer's threads."""
    on_error: Literal["raise", "warn"] = "warn"
    """warn: a failure of the dump warns once and switches dumping off, and the run goes on;
    raise: it stops the run. $SLEUTH_STRICT=1 raises whatever this says (`raises`)."""
    watch: tuple[dict, ...] = ()
    """Watchpoints checked as records are made (see docs/dump-config.md)."""
    nan_allow: tuple[str, ...] = ()
    """Record names whose NaN/Inf are intended (globs or "re:<regex>"): `sleuth check` passes
    over them in the first-NaN search and counts no nan_inf hit on them."""
    compiled: Literal["compiled", "interpret", "eager"] = "compiled"
    """How a dumped step runs what torch.compile compiled: "compiled", as an undumped step runs
    it, recording each compiled region's inputs, outputs and gradients and the ops it
    dispatches; "interpret", each region's graphs after AOTAutograd run node by node, every
    aten node an op record with its module and line; "eager", the model's Python run eagerly,
    recording every module and op as an eager run would (docs/frameworks.md,
    "torch.compile")."""
    overwrite: bool = False
    """Replace the dump of another run found in the run directory (its step files only) instead
    of refusing to write; the same run continuing (a resume) needs no overwrite."""

    _step_ranges: tuple[tuple[int, int], ...] | None = field(default=None, init=False, repr=False,
                                                             compare=False)
    _rank_ranges: tuple[tuple[int, int], ...] | None = field(default=None, init=False, repr=False,
                                                             compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once, at construction
        for key in ("path", "steps", "ranks"):
            value = getattr(self, key)
            if key != "path" and isinstance(value, int) and not isinstance(value, bool):
                value = str(value)
                set_(self, key, value)
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
                set_(self, key, value)
            if not isinstance(value, str):
                raise ConfigError(f"{key}: expected a string, got {value!r}")
        for key, choices in _CHOICES.items():
            _check_choice(key, getattr(self, key), choices)
        set_(self, "_step_ranges", parse_ranges("steps", self.steps))
        set_(self, "_rank_ranges", parse_ranges("ranks", self.ranks))
        for key in _FILTER_KEYS:
            patterns = _as_str_tuple(key, getattr(self, key))
            set_(self, key, patterns)
        for f in dataclasses.fields(self):
            if f.init:
                check_scalar(f.name, getattr(self, f.name), f.type, _RANGES.get(f.name))
        set_(self, "watch", _check_watch(self.watch))
        set_(self, "nan_allow", _as_str_tuple("nan_allow", self.nan_allow))
        set_(self, "_module_match", _compile(self.modules, self.exclude_modules, "modules"))
        set_(self, "_op_match", _compile(self.ops, self.exclude_ops, "ops"))
        set_(self, "_module_cache", {})
        set_(self, "_op_cache", {})
        if self.compiled == "interpret" and self.level == "module":
            warn('"compiled": "interpret" records each graph node as an op record, and level '
                 '"module" records no ops: the dumped steps run compiled, as with "compiled"; '
                 'set "level": "op" or "mix" to see inside the compiled regions', stacklevel=4)

    # -- selection (hot path) -------------------------------------------------------------------
    def wants_step(self, step: int) -> bool:
        """True when optimizer step `step` (0-based) is dumped."""
        ranges = self._step_ranges
        return ranges is None or any(lo <= step <= hi for lo, hi in ranges)

    def steps_from(self, first: int) -> list[str]:
        """The asked-for steps at `first` or later, as ranges ("9", "12-15"); [] for "all"."""
        if self._step_ranges is None:
            return []
        return [f"{max(lo, first)}" + (f"-{hi}" if hi > max(lo, first) else "")
                for lo, hi in self._step_ranges if hi >= first]

    def wants_rank(self, rank: int) -> bool:
        """True when rank `rank` dumps."""
        ranges = self._rank_ranges
        return ranges is None or any(lo <= rank <= hi for lo, hi in ranges)

    def wants_module(self, name: str) -> bool:
        """True when the module with dotted name `name` passes modules/exclude_modules."""
        cache: dict[str, bool] = self._module_cache  # type: ignore[attr-defined]
        hit = cache.get(name)
        if hit is None:
            hit = cache[name] = self._module_match(name)  # type: ignore[attr-defined]
        return hit

    def wants_op(self, op: str) -> bool:
        """True when the aten op `op` (e.g. "aten.mm") passes ops/exclude_ops."""
        cache: dict[str, bool] = self._op_cache  # type: ignore[attr-defined]
        hit = cache.get(op)
        if hit is None:
            hit = cache[op] = self._op_match(op)  # type: ignore[attr-defined]
        return hit

    def raises(self) -> bool:
        """True when a failure of the dump stops the run: ``on_error`` "raise", or
        $SLEUTH_STRICT=1 (CI, tests). Read when a failure happens, never on the hot path."""
        return self.on_error == "raise" or strict()

    def run_dir(self) -> Path:
        """The run directory: `path`, else $SLEUTH_RUN_DIR, else ./sleuth_run."""
        return Path(self.path or os.environ.get("SLEUTH_RUN_DIR") or _DEFAULT_RUN_DIR)

    # -- loading and saving ---------------------------------------------------------------------
    @classmethod
    def keys(cls) -> list[str]:
        """The valid config keys, in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if f.init]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that `from_dict` turns back into an equal config."""
        out: dict[str, Any] = {}
        for key in self.keys():
            value = getattr(self, key)
            if key == "watch":
                value = [dict(w) for w in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[key] = value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DumpConfig:
        """Build a config from a dict; unknown keys raise ConfigError with the closest key."""
        if not isinstance(d, dict):
            raise ConfigError(f"a dump config must be a JSON object, got {type(d).__name__}")
        valid = cls.keys()
        if "op_capture" in d:
            _check_op_capture(d["op_capture"])
            d = {k: v for k, v in d.items() if k != "op_capture"}
        for key in d:
            if key not in valid:
                raise ConfigError(f"unknown key {key!r}{_suggest(str(key), valid)} "
                                  f"(valid keys: {', '.join(valid)})")
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> DumpConfig:
        """Load a config from a JSON file; syntax errors name the file, line and column.

        Only a regular file of bounded size is read: a device (`/dev/zero`) or a FIFO given by
        mistake is refused instead of read forever."""
        from tracer.storage import JsonLimitError, read_text_bounded

        p = Path(path)
        try:
            text = read_text_bounded(p)
        except JsonLimitError as e:  # its message starts with the path
            missing = isinstance(e.__cause__, OSError)
            raise ConfigError(f"cannot read dump config {e}" if missing else str(e)) from e
        return cls.from_text(text, str(p))

    @classmethod
    def from_text(cls, text: str, source: str) -> DumpConfig:
        """Load a config from JSON text (inline JSON, as $SLEUTH_DUMP_CONFIG may hold);
        errors name `source`, the line and the column."""
        data = load_json(text, source)
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e

    @classmethod
    def from_env(cls, value: str | None = None) -> DumpConfig | None:
        """The config $SLEUTH_DUMP_CONFIG (or `value`, read by the same rule) names; the one
        parser of that variable: unset, empty or "0" is None, "1" the defaults, text that
        starts with "{" inline JSON, anything else the path of a JSON file. ConfigError names
        the variable and what is wrong."""
        if value is None:
            value = os.environ.get(ENV_VAR, "")
        value = value.strip()
        if not value or value == "0":
            return None
        if value == "1":
            return cls()
        if value.startswith("{"):
            return cls.from_text(value, f"{ENV_VAR} (inline JSON)")
        return cls.from_json(value)


# -- helpers ------------------------------------------------------------------------------------


_RETIRED_SWITCHES = {
    "SLEUTH_FILE_PROCESS": 'set "file_process": false in the dump config instead',
    "SLEUTH_FUSED_STATS": "the C kernel is used wherever it is built",
    "SLEUTH_STATS_THREADS": "statistics take one thread",
    "SLEUTH_DEFER_STATS": "every statistic is taken in its hook",
}
_retired_warned = False


def warn_retired_switches() -> None:
    """Warn once per process about tuning variables the tracer no longer reads, so a user who
    sets one learns it does nothing (and what replaces it) instead of trusting it."""
    global _retired_warned
    if _retired_warned:
        return
    _retired_warned = True
    found = [f"{name} ({why})" for name, why in _RETIRED_SWITCHES.items()
             if os.environ.get(name, "").strip()]
    if found:
        warn("no longer read, so ignored: " + "; ".join(found), stacklevel=3)


def load_json(text: str, source: str) -> Any:
    """Parse a JSON config strictly: a key given twice (json keeps the last one silently) and the
    NaN/Infinity extensions are errors naming `source` and the line, not values used unseen."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ConfigError(f"{source}: key {key!r} appears twice; keep one of them")
            out[key] = value
        return out

    def constant(name: str) -> Any:
        raise ConfigError(f"{source}: {name} is not a number a config accepts; write a finite "
                          f"number")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from e


def _suggest(value: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_op_capture(value: Any) -> None:
    """The retired key "op_capture": ops are recorded through one path, the dispatch mode, so
    the values that meant it ("auto", "dispatch") are accepted and ignored, and configs that
    name them keep working; "observer" named a compiled capture that sleuth does not have, and a
    run asking for it by name is told so before it starts rather than given another capture."""
    if value in ("auto", "dispatch"):
        return
    if value == "observer":
        raise ConfigError('op_capture: "observer" (the compiled op observer) was removed from '
                          'sleuth; ops are recorded through the dispatch mode, which also '
                          'records tensor subclasses such as FSDP2\'s DTensor. Remove '
                          '"op_capture" from the config')
    raise ConfigError(f'op_capture: {value!r} is not a capture; the key is retired (ops are '
                      f'recorded through the dispatch mode): remove it from the config')


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}"
                          f"{_suggest(str(value), choices)}")


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_ranges(key: str, spec: str) -> tuple[tuple[int, int], ...] | None:
    """Parse "all" (-> None) or "0|5-8|100-120" into inclusive (lo, hi) ranges."""
    if spec.strip().lower() == "all":
        return None
    example = "'0|5-8|100-120'" if key == "steps" else "'0|1|4-7'"
    ranges = []
    for part in spec.split("|"):
        m = _RANGE.match(part)
        if not m:
            raise ConfigError(f"{key}: {spec!r} has a bad part {part!r}; write ranges like "
                              f"{example} (ends included) or 'all'")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ConfigError(f"{key}: range {part.strip()!r} in {spec!r} ends before it starts; "
                              f"write ranges like {example}")
        ranges.append((lo, hi))
    return tuple(ranges)


def _as_str_tuple(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of name patterns (globs or 're:<regex>'), "
                          f"got {value!r}")
    for pattern in value:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as e:
                raise ConfigError(f"{key}: bad regular expression {pattern!r}: {e}") from e
        elif not pattern:
            raise ConfigError(f"{key}: empty pattern; use '*' to match every name")
    return tuple(value)


def _pattern_matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    regexes = [re.compile(p[3:]) for p in patterns if p.startswith("re:")]
    globs = [p for p in patterns if not p.startswith("re:")]

    def match(name: str) -> bool:
        return (any(fnmatch.fnmatchcase(name, g) for g in globs)
                or any(r.search(name) for r in regexes))

    return match


def _compile(include: tuple[str, ...], exclude: tuple[str, ...],
             what: str) -> Callable[[str], bool]:
    inc = _pattern_matcher(include) if include else None
    exc = _pattern_matcher(exclude) if exclude else None

    def wants(name: str) -> bool:
        if inc is not None and not inc(name):
            return False
        return exc is None or not exc(name)

    return wants


def _check_watch(watch: Any) -> tuple[dict, ...]:
    if isinstance(watch, dict):
        watch = (watch,)
    if not isinstance(watch, (list, tuple)) or not all(isinstance(w, dict) for w in watch):
        raise ConfigError(f"watch: expected a list of watchpoint objects, got {watch!r}")
    watch = tuple(dict(w) for w in watch)
    if watch:
        # here, not at the top: the watch conditions load only for a config that has some
        from tracer._watch_config import validate_watch

        for i, w in enumerate(watch):
            try:
                validate_watch(w)
            except ConfigError as e:
                raise ConfigError(f"watch[{i}]: {e}") from e
    return watch
