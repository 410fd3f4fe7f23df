"""The live watch observer: the watchpoints of a dump config checked on every row the writer
makes while recording. Hits go to the step file's /hits (`writer.add_hit`); `"on_hit": "raise"`
stops the run at the first hit with `WatchpointHit`, after saving the flight recorder (if any)
with the hit as its reason. `Watcher`, the row-by-row evaluation with its memory of weight
norms, is also what `tracer.check` runs over a dump offline.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Callable, Iterable

from tracer._errors import WatchpointHit
from tracer._watch_config import WatchConfig, parse_watch


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


def install_watch(writer: Any, config: Any, recorder: Any = None) -> _WatchHandle | None:
    """Check the watchpoints of `config` (a DumpConfig, or a list of watchpoints) on every record
    `writer` makes: hits go to `writer.add_hit`, and `on_hit: raise` raises WatchpointHit, after
    saving `recorder` (the run's flight recorder, if any) with the hit as its reason. Returns
    None when there is no watchpoint.
    """
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
