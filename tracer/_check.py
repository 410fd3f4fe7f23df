"""`tracer.check`: watchpoints evaluated offline on a dump, and the origin of the first NaN.

Both read only the statistics tables (no tensor bytes), step by step, so they run on dumps of
any size and in either dump mode.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

from tracer._diff import _rows
from tracer._watch import Watcher, WatchConfig, parse_watch

HIT_COLUMNS = ("rank", "step", "seq", "name", "module", "op", "phase", "direction", "source",
               "condition", "value", "origin")


def _selected(dump: Any, rank: int | None, step: int | None) -> list[tuple[int, int]]:
    from tracer._errors import DumpFormatError

    ranks = dump.ranks if rank is None else [rank]
    out = []
    for r in ranks:
        if r not in dump.ranks:
            raise DumpFormatError(f"no rank {r} in the dump; ranks: {dump.ranks}")
        steps = dump.steps(r) if step is None else [step]
        for s in steps:
            dump.path(r, s)  # raises, naming what exists, when the step is missing
            out.append((r, s))
    return out


def _configured_watch(dump: Any, rank: int, step: int) -> list[WatchConfig]:
    try:
        config = json.loads(dump.attrs(rank, step).get("config") or "{}")
    except (ValueError, TypeError):
        return []
    return parse_watch(config.get("watch") or [])


def check(path: str | os.PathLike, *, watch: Iterable[WatchConfig | dict] | None = None,
          rank: int | None = None, step: int | None = None, first_nan: bool = True) -> Any:
    """Evaluate watchpoints on every record of a dump (statistics only).

    Args:
        path: run directory, dump directory or step file.
        watch: watchpoints (WatchConfig or dicts like {"condition": "nan_inf"}); None uses the
            dump config's `watch` list plus nan_inf.
        rank, step: restrict to one rank / step (default: all).
        first_nan: also locate the origin of the first NaN/Inf (`df.attrs["first_nan"]`).

    Returns:
        DataFrame of hits (columns HIT_COLUMNS), in rank, step, execution order. Hits recorded
        live in the dump's /hits are included (origin "live") unless the same hit was found
        offline. `df.attrs["first_nan"]` holds `first_nan()`'s answer (or None).

    Raises:
        DumpFormatError for a missing dump, rank or step; ConfigError for a bad watchpoint.
    """
    import pandas as pd

    from tracer._reader import open_dump

    dump = open_dump(path)
    explicit = parse_watch(list(watch)) if watch is not None else None
    rows: list[dict] = []
    watchers: dict[int, Watcher] = {}  # one per rank: weight conditions look across steps
    for r, s in _selected(dump, rank, step):
        points = explicit
        if points is None:
            points = _configured_watch(dump, r, s)
            if not any(w.condition == "nan_inf" for w in points):
                points.append(WatchConfig(condition="nan_inf"))
        watcher = watchers.setdefault(r, Watcher(points))
        watcher.watch = points
        df = dump.stats(r, s)
        seen = set()
        for rec in _rows(df):
            rec["step"] = s
            for _, hit in watcher.check(rec):
                seen.add((int(rec["seq"]), hit["condition"]))
                rows.append({"rank": r, "step": s, "seq": int(rec["seq"]), "name": rec["name"],
                             "module": rec["module"], "op": rec["op"], "phase": rec["phase"],
                             "direction": rec["direction"], "source": rec["source"],
                             "condition": hit["condition"], "value": hit["value"],
                             "origin": "offline"})
        live = dump.hits(r, s)
        if len(live):
            by_seq = df.set_index("seq")
            for h in live.to_dict("records"):
                if (int(h["seq"]), h["condition"]) in seen:
                    continue
                rec = by_seq.loc[int(h["seq"])] if int(h["seq"]) in by_seq.index else {}
                rows.append({"rank": r, "step": s, "seq": int(h["seq"]), "name": h["name"],
                             "module": rec.get("module", ""), "op": rec.get("op", ""),
                             "phase": rec.get("phase", ""),
                             "direction": rec.get("direction", ""), "source": h["source"],
                             "condition": h["condition"], "value": float(h["value"]),
                             "origin": "live"})
    out = pd.DataFrame(rows, columns=list(HIT_COLUMNS))
    out = out.sort_values(["rank", "step", "seq"], kind="stable").reset_index(drop=True)
    out.attrs["first_nan"] = first_nan_origin(dump, rank=rank, step=step) if first_nan else None
    return out


# -- first NaN ------------------------------------------------------------------------------------
def _nonfinite(rec: dict) -> bool:
    return int(rec["nan"]) + int(rec["posinf"]) + int(rec["neginf"]) > 0


def _roles(rec: dict) -> str:
    """'consumed' or 'produced': which tensors of a call went in and which came out."""
    d, phase = rec["direction"], rec["phase"]
    if rec["op"]:
        return "consumed" if d == "input" else "produced"
    if phase == "optimizer":
        return "produced" if d == "update" else "consumed"
    if phase == "backward":  # a module's backward takes grad_output and makes grad_input
        return "consumed" if d == "output" else "produced"
    return "consumed" if d == "input" else "produced"


def origin_in_step(df: Any) -> dict[str, Any] | None:
    """The first record of one step's statistics table whose call made non-finite values from
    finite inputs, or None when the step holds no NaN/Inf."""
    recs = sorted(_rows(df), key=lambda r: int(r["seq"]))
    bad = [r for r in recs if _nonfinite(r)]
    if not bad:
        return None
    calls: dict[str, dict[str, list[dict]]] = {}
    for r in recs:
        call = str(r["name"]).rsplit(".", 2)[0]  # {scope}.{phase}.{call}
        calls.setdefault(call, {"consumed": [], "produced": []})[_roles(r)].append(r)
    first_bad_seq = int(bad[0]["seq"])
    for r in bad:
        if r["phase"] == "optimizer" and r["direction"] == "param":
            # the weight was already non-finite when the step began: an earlier step did it
            return _origin(r, calls, "weights were non-finite when this step began")
        group = calls[str(r["name"]).rsplit(".", 2)[0]]
        if _roles(r) != "produced":
            continue
        consumed = group["consumed"]
        if consumed and not any(_nonfinite(c) for c in consumed):
            return _origin(r, calls, "its inputs are finite, its output is not")
        if not consumed and int(r["seq"]) == first_bad_seq:
            return _origin(r, calls, "first non-finite record (its inputs were not dumped)")
    r = bad[0]  # only non-finite inputs were dumped (e.g. io="input"): the earliest one
    return _origin(r, calls, "first non-finite record; no call with finite inputs produced it")


def _origin(r: dict, calls: dict, why: str) -> dict[str, Any]:
    group = calls.get(str(r["name"]).rsplit(".", 2)[0], {"consumed": []})
    return {"name": r["name"], "module": r["module"], "op": r["op"], "phase": r["phase"],
            "direction": r["direction"], "seq": int(r["seq"]), "source": r["source"],
            "nan": int(r["nan"]), "posinf": int(r["posinf"]), "neginf": int(r["neginf"]),
            "numel": int(r["numel"]), "inputs": [c["name"] for c in group["consumed"]],
            "why": why}


def first_nan_origin(dump_or_path: Any, *, rank: int | None = None,
                     step: int | None = None) -> dict[str, Any] | None:
    """Where the first NaN/Inf of a dump came from: the first record, in execution order (steps
    ascending, then forward, backward, optimizer), whose outputs are non-finite while its inputs
    are finite. Returns a dict (name, module, op, phase, step, rank, source, seq, counts, inputs,
    why) or None when the dump holds no NaN/Inf. With several ranks, the earliest step wins."""
    from tracer._reader import open_dump

    dump = dump_or_path if hasattr(dump_or_path, "stats") else open_dump(dump_or_path)
    best: dict[str, Any] | None = None
    for r, s in _selected(dump, rank, step):
        if best is not None and s >= best["step"]:
            continue
        df = dump.stats(r, s)
        if not len(df):
            continue
        if not ((df["nan"] > 0) | (df["posinf"] > 0) | (df["neginf"] > 0)).any():
            continue
        found = origin_in_step(df)
        if found is not None:
            best = {**found, "step": s, "rank": r}
    return best


def describe_origin(o: dict[str, Any]) -> str:
    """A sentence for the terminal."""
    op = f"op {o['op']} in " if o["op"] else ""
    counts = ", ".join(f"{o[k]} {k}" for k in ("nan", "posinf", "neginf") if o[k])
    return (f"first NaN/Inf: {o['name']} ({op}module {o['module']}, {o['phase']}, step "
            f"{o['step']}, rank {o['rank']}) at {o['source'] or 'unknown source'}: {counts} of "
            f"{o['numel']} elements; {o['why']}")
