"""`tracer.check_ranks`: `check` on every rank of a dump, each rank a task, with the same
answer as one `check` over the whole dump.

Each task checks one rank (its watchpoints, which look across that rank's steps, and that
rank's first NaN/Inf) in this process, on a local process pool, or on a Dask cluster
(`tracer.analysis._rank_tasks`), and returns its hits, its origin and what it read. The origins are
then ordered as `find_first_nan` orders them: the earliest step wins, and within that step the
rank whose record came first by the collectives begun before it, then by execution order, so a
NaN that arrives through an all-reduce is still blamed on the rank that sent it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

from tracer._errors import TracerError
from tracer.analysis._check import (HIT_COLUMNS, Coverage, _order, check, find_first_nan,
                                    ranks_ordered_by)
from tracer.analysis._rank_tasks import rank_path, run_per_rank
from tracer._config import _as_str_tuple
from tracer._watch_config import WatchConfig, parse_watch


def check_ranks(path: str | os.PathLike, *, watch: Iterable[WatchConfig | dict] | None = None,
                step: int | None = None, first_nan: bool = True, nan_allow: Iterable[str] = (),
                only_first_nan: bool = False, ranks: list[int] | None = None,
                workers: int | None = None, scheduler: str | None = None,
                progress: Callable[[int, int], None] | None = None) -> Any:
    """`check` every rank of a dump as a separate task; the same DataFrame `check` returns
    (hits in rank, step, execution order; attrs `first_nan` and `coverage`), plus
    `attrs["engine"]` (where the tasks ran) and `attrs["ranks"]` (the ranks checked).

    Args:
        path: run or dump directory (holding rank{R}/ folders).
        watch, step, first_nan, nan_allow: as for `check`, applied to every rank.
        only_first_nan: locate the first NaN/Inf only, no watchpoint (`find_first_nan`); the
            DataFrame of hits is then empty.
        ranks: only these ranks (default: every rank the dump has a folder or file for).
        workers, scheduler, progress: as for `diff_ranks`.
    """
    import pandas as pd

    from tracer.analysis._ranks import dump_ranks

    root = str(Path(path).resolve())
    have = dump_ranks(root)
    chosen = have if ranks is None else sorted(set(ranks))
    missing = [r for r in chosen if r not in have]
    if missing:
        raise TracerError(f"no rank {missing[0]} in the dump {path} (ranks: "
                          f"{', '.join(map(str, have)) or 'none'})")
    points = None if watch is None else parse_watch(list(watch))  # bad ones raise here, once
    _as_str_tuple("nan_allow", list(nan_allow))
    args = dict(path=root, watch=points, step=step, first_nan=first_nan or only_first_nan,
                nan_allow=list(nan_allow), only_first_nan=only_first_nan)
    results, engine = run_per_rank(check_one_rank, chosen, args, workers=workers,
                                   scheduler=scheduler, progress=progress)
    results.sort(key=lambda r: r["rank"])
    errors = [r for r in results if r["error"]]
    if errors and len(errors) == len(results):
        raise TracerError(errors[0]["error"])
    coverage = Coverage()
    seen: set[str] = set()
    for r in results:
        for u in r["coverage"]["unread"]:
            if u["path"] not in seen:  # a file no rank folder names is seen by every task
                seen.add(u["path"])
                coverage.unread.append(u)
        coverage.read += r["coverage"]["read"]
        coverage.interrupted += r["coverage"]["interrupted"]
    for r in errors:  # a rank whose check could not run is an unread rank, never a clean one
        coverage.unread.append({"path": rank_path(root, r["rank"]), "rank": r["rank"],
                                "step": None, "state": "unreadable", "reason": r["error"]})
    hits = pd.DataFrame([h for r in results for h in r["hits"]], columns=list(HIT_COLUMNS))
    hits = hits.sort_values(["rank", "step", "seq"], kind="stable").reset_index(drop=True)
    hits.attrs["first_nan"] = (earliest_origin([r["first_nan"] for r in results], coverage)
                               if first_nan else None)
    hits.attrs["coverage"] = coverage.to_dict()
    hits.attrs["engine"] = engine
    hits.attrs["ranks"] = chosen
    return hits


def earliest_origin(origins: list[dict[str, Any] | None],
                    coverage: Coverage) -> dict[str, Any] | None:
    """The first NaN/Inf across ranks from each rank's own origin: the earliest step, then
    `_check._order` (collectives begun before, seq, rank); the other ranks' origins in that
    step become `other_ranks`, each marked `received` when it came after a collective the
    answer's record preceded."""
    found = [o for o in origins if o is not None]
    if not found:
        return None
    step = min(o["step"] for o in found)
    same = sorted((o for o in found if o["step"] == step), key=_order)
    first = dict(same[0])
    first["unread_before"] = coverage.unread_before(step)
    first["other_ranks"] = [
        {**{k: o.get(k) for k in ("rank", "name", "kind", "seq", "source", "collective")},
         "received": first["collective"] < o["collective"]} for o in same[1:]]
    first["ranks_ordered_by"] = ranks_ordered_by(first, same[1:])
    return first


def check_one_rank(rank: int, path: str, watch: list[WatchConfig] | None, step: int | None,
                   first_nan: bool, nan_allow: list[str],
                   only_first_nan: bool = False) -> dict[str, Any]:
    """One rank's check reduced to plain data (a task a pool or a Dask worker can run):
    rank, hits (rows), first_nan, coverage, error (when the check could not run)."""
    import warnings

    from tracer.storage import open_dump

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what could not be read comes back in coverage
        try:
            dump = open_dump(rank_path(path, rank))
        except TracerError:
            try:  # e.g. a rank folder without a step file: the whole dump's reader names it
                dump = open_dump(path)
            except TracerError as e:
                return _failed(rank, e)
        try:
            if only_first_nan:
                coverage = Coverage()
                origin = find_first_nan(dump, coverage, rank=rank, step=step,
                                        nan_allow=nan_allow)
                return {"rank": rank, "hits": [], "first_nan": origin,
                        "coverage": coverage.to_dict(), "error": ""}
            hits = check(dump, watch=watch, rank=rank, step=step, first_nan=first_nan,
                         nan_allow=nan_allow)
        except TracerError as e:
            return _failed(rank, e)
        finally:
            dump.close()
    return {"rank": rank, "hits": [_plain(h) for h in hits.to_dict("records")],
            "first_nan": hits.attrs["first_nan"], "coverage": hits.attrs["coverage"],
            "error": ""}


def _failed(rank: int, e: Exception) -> dict[str, Any]:
    return {"rank": rank, "hits": [], "first_nan": None,
            "coverage": Coverage().to_dict(), "error": f"rank {rank}: {e}"}


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v.item() if hasattr(v, "item") else v for k, v in d.items()}
