"""`tracer.diff_ranks`: diff every rank of two dumps, each rank a task, and name the earliest
divergence across ranks.

A run of many ranks is one dump folder per rank; comparing them one pair per call leaves the
user to find which rank went first. Here each rank pair is one task of `tracer.diff` (which
already streams tensors in bounded chunks), run in this process, on a local process pool, or on
a Dask distributed cluster that the user names, each task reading its rank's files where they
lie (shared storage: the paths are made absolute before they are sent). A task returns only
its summary (status, first divergence, counts, per-step rows, problems), never its record
table, so memory in this process grows with the number of ranks, not with the dump's size;
and a task compares one step at a time (`diff(keep_records=False)`), so its own memory holds
one step's tables whatever the number of steps.

The earliest divergence across ranks is the one with the lowest (step, parameter-before-compute,
execution order) key: in data-parallel runs every rank runs the same program, so the seq
of a record is comparable across ranks. A rank that only one side has, or whose diff could
not run, is named; neither ever reads as "same".
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from tracer.analysis._compare import Tolerance
from tracer.analysis._diff_plan import DiffError
from tracer.analysis._rank_tasks import rank_path, run_per_rank


@dataclass
class RankDiffResult:
    """What `diff_ranks` found, rank by rank."""

    status: Literal["same", "diverged", "incomplete"]
    """"same" only when every rank of both sides was diffed and each is "same"."""
    earliest: dict[str, Any] | None
    """The first divergent record of the rank that diverged first (step, then execution order;
    see the module doc), with its `rank`; None when no rank diverged."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """One summary per rank pair: rank, status, exit_code, first_divergence, counts, problems,
    steps, notes, changes (`DiffResult.changes`), error (when its diff could not run)."""
    only_a: list[int] = field(default_factory=list)
    only_b: list[int] = field(default_factory=list)
    engine: str = "local"
    """Where the per-rank tasks ran: "in-process", "local" (a process pool) or "dask ADDRESS"."""

    @property
    def exit_code(self) -> int:
        """0 every rank same; 1 a rank diverged or exists on one side only; 2 a rank could not
        be read completely."""
        code = max((r["exit_code"] for r in self.ranks), default=0)
        return max(code, 1 if (self.only_a or self.only_b) else 0)

    def table(self) -> dict[int, dict[int, str]]:
        """rank -> step -> status: same, diverged, interrupted, or a problem's state (missing,
        truncated, unreadable, ...); the rank x step grid a user scans for the first red cell."""
        grid: dict[int, dict[int, str]] = {}
        for r in self.ranks:
            row = grid.setdefault(r["rank"], {})
            for s in r["steps"]:
                state = "diverged" if s["diverged"] or s["only_a"] or s["only_b"] else "same"
                row[s["step"]] = "interrupted" if s["status"] == "interrupted" else state
            for p in r["problems"]:
                if p["side"] == "A" and p["step"] is not None and p["state"] != "interrupted":
                    row[p["step"]] = p["state"]
                elif p["side"] == "B" and p["step"] is not None and p["state"] != "interrupted":
                    row.setdefault(p["step"], p["state"])
        return {k: dict(sorted(v.items())) for k, v in sorted(grid.items())}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: status, exit_code, earliest, only_a, only_b, engine, table, ranks."""
        return {"status": self.status, "exit_code": self.exit_code, "earliest": self.earliest,
                "only_a": self.only_a, "only_b": self.only_b, "engine": self.engine,
                "table": {str(k): {str(s): v for s, v in row.items()}
                          for k, row in self.table().items()},
                "ranks": self.ranks}


def dump_ranks(path: str | os.PathLike) -> list[int]:
    """Every rank a dump has a folder or a step file for, readable or not (a rank whose files
    are all damaged is still a rank the user ran)."""
    import warnings

    from tracer.storage import open_dump

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # damaged files are the per-rank diff's to report
        d = open_dump(path)
    try:
        seen = set(d.ranks) | {s.rank for s in d.file_states
                               if isinstance(s.rank, int) and s.rank >= 0}
        return sorted(seen)
    finally:
        d.close()


def diff_ranks(a: str | os.PathLike, b: str | os.PathLike, *, step: int | None = None,
               tolerance: Tolerance | None = None, allow_missing: bool = False,
               ranks: list[int] | None = None, workers: int | None = None,
               scheduler: str | None = None,
               progress: Callable[[int, int], None] | None = None) -> RankDiffResult:
    """Diff every rank of A with the same rank of B.

    Args:
        a, b: run or dump directories (holding rank{R}/ folders).
        step, tolerance, allow_missing: as for `tracer.diff`, applied to every rank.
        ranks: only these ranks (default: every rank either side has).
        workers: local processes; None or 1 (the default) runs the ranks in this process,
            0 one process per core (at most one per rank). A pool imports the main script
            again: call it under `if __name__ == "__main__":` in a script.
        scheduler: a Dask distributed scheduler address ("tcp://host:8786"); default the
            environment variable SLEUTH_DASK_SCHEDULER, else `workers`. Every worker must
            see the dumps at the same absolute paths.
        progress: called with (ranks done, ranks in all).

    Raises DiffError when no chosen rank is on both sides (nothing would be compared).
    """
    a, b = str(Path(a).resolve()), str(Path(b).resolve())
    ra, rb = dump_ranks(a), dump_ranks(b)
    chosen = sorted(set(ra) | set(rb)) if ranks is None else sorted(set(ranks))
    unknown = [r for r in chosen if r not in ra and r not in rb]
    if unknown:
        raise DiffError(f"no rank {unknown[0]} in either dump (A ranks {_span(ra)}, B ranks "
                        f"{_span(rb)})")
    both = [r for r in chosen if r in ra and r in rb]
    only_a = [r for r in chosen if r in ra and r not in rb]
    only_b = [r for r in chosen if r in rb and r not in ra]
    if not both:
        # every rank on one side only: nothing would be read, and no verdict stands on that
        pick = (f"--rank {ra[0]} --b-rank {rb[0]}" if ra and rb else "another dump")
        raise DiffError(f"no rank is on both sides (A ranks {_span(ra)}, B ranks {_span(rb)}"
                        f"{'' if ranks is None else f', chosen {_span(chosen)}'}), so nothing "
                        f"was compared; compare one pair with {pick}")
    tol = tolerance or Tolerance()
    args = dict(a=a, b=b, step=step, tol=tol, allow_missing=allow_missing)
    summaries, engine = run_per_rank(diff_one_rank, both, args, workers=workers,
                                     scheduler=scheduler, progress=progress)
    summaries.sort(key=lambda s: s["rank"])
    earliest = min((s["first_divergence"] for s in summaries if s["first_divergence"]),
                   key=_order, default=None)
    worst = max((s["exit_code"] for s in summaries), default=0)
    status = "incomplete" if worst == 2 else (
        "diverged" if worst == 1 or only_a or only_b else "same")
    return RankDiffResult(status=status, earliest=earliest, ranks=summaries, only_a=only_a,
                          only_b=only_b, engine=engine)


def _order(fd: dict[str, Any]) -> tuple:
    return (fd["step"], 0 if fd.get("kind") == "parameter" else 1, fd["seq"], fd["rank"])


def _span(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    return ", ".join(map(str, ranks)) if len(ranks) <= 6 else f"{ranks[0]}-{ranks[-1]} " \
        f"({len(ranks)})"


def diff_one_rank(rank: int, a: str, b: str, step: int | None, tol: Tolerance,
                  allow_missing: bool) -> dict[str, Any]:
    """One rank pair's diff, reduced to what the report needs (a task: module-level, its
    arguments and result plain data, so a process pool or a Dask worker can run it)."""
    import warnings

    from tracer.analysis._diff import diff

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what could not be read comes back as problems
        try:
            res = diff(rank_path(a, rank), rank_path(b, rank), step=step, rank=rank,
                       b_rank=rank, tolerance=tol, allow_missing=allow_missing,
                       keep_records=False)
        except DiffError as e:  # e.g. a rank whose files are all damaged on one side
            return dict(rank=rank, status="incomplete", exit_code=2, first_divergence=None,
                        counts={}, problems=[], steps=[], notes=[], changes=[], error=str(e))
    fd = res.first_divergence
    return dict(rank=rank, status=res.status, exit_code=res.exit_code, first_divergence=fd,
                counts=res.counts(), problems=[p.to_dict() for p in res.problems],
                steps=res.steps, notes=res.notes, changes=res.changes, error="")
