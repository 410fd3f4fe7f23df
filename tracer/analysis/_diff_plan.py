"""Which (rank, step) pairs `tracer.diff` compares, and what it could not compare.

Every step either side holds is looked at, readable or not: a step that one side lacks, a step
file that is truncated, unreadable or only a `*.partial`, and a step that was interrupted are
each a `Problem` that the diff reports by file and counts, so that "same" is never said about
data that was not fully read (docs/architecture.md, the trust rule). `allow_missing` narrows the comparison to
the steps both sides hold complete and readable, and names what it left out.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracer._errors import DumpFormatError, TracerError

Plan = tuple[int, int, int, int]  # (rank, step, b_rank, b_step)

# Problem.state -> the exit code it forces: 1 the runs' step sets differ, 2 not fully read
EXIT_OF_STATE = {"missing": 1, "interrupted": 2, "partial_only": 2, "truncated": 2,
                 "unreadable": 2, "empty": 2, "damaged": 2, "read_error": 2}


class DiffError(TracerError):
    """The two dumps cannot be compared as asked: the message says what differs."""


@dataclass(frozen=True)
class Problem:
    """A step of one side that was not fully read (or not there): which file, what is wrong."""

    side: str
    """"A" or "B"."""
    rank: int
    step: int | None
    path: str
    """The file (or, for a missing step, the file that would hold it)."""
    state: str
    """missing, interrupted, partial_only, truncated, unreadable, empty, damaged, read_error."""
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"side": self.side, "rank": self.rank, "step": self.step, "path": self.path,
                "state": self.state, "reason": self.reason}

    def line(self) -> str:
        """One line for the terminal report."""
        step = "" if self.step is None else f" step {self.step}"
        return f"{self.side} rank {self.rank}{step}: {self.path}: {self.reason}"


@dataclass
class Side:
    label: str
    dump: Any
    dump_dir: Path | None  # the folder holding rank{R}/ (None for a single step file)
    file: Path | None  # set when the side is one step file

    def step_file(self, rank: int, step: int) -> Path:
        return Path(self.dump.path(rank, step))

    def only(self) -> tuple[int, int] | None:
        ranks = list(self.dump.ranks)
        if len(ranks) == 1 and len(list(self.dump.steps(ranks[0]))) == 1:
            return ranks[0], list(self.dump.steps(ranks[0]))[0]
        return None

    def expected(self, rank: int, step: int) -> str:
        """Where the file of (rank, step) would be: beside the rank's other step files."""
        steps = list(self.dump.steps(rank))
        if steps:
            return str(self.step_file(rank, steps[0]).with_name(f"step{step}.h5"))
        base = self.dump_dir if self.dump_dir is not None else Path(self.dump.root).parent
        return str(base / f"rank{rank}" / f"step{step}.h5")

    def bad_steps(self, rank: int) -> dict[int, Any]:
        """step -> FileState of the steps of `rank` that exist only unreadable or partial."""
        readable = set(self.dump.steps(rank))
        out: dict[int, Any] = {}
        for s in getattr(self.dump, "problems", []):
            if (s.rank in (rank, -1) and s.step is not None and s.step not in readable
                    and s.state != "interrupted"):
                out.setdefault(s.step, s)
        return out

    def interrupted(self, rank: int, step: int) -> Any:
        state = self.dump.state(rank, step) if hasattr(self.dump, "state") else None
        return state if state is not None and state.state == "interrupted" else None

    def problem(self, state: Any) -> Problem:
        return Problem(self.label, state.rank, state.step, state.path, state.state, state.reason)


def open_side(path: str | os.PathLike, label: str) -> Side:
    import warnings

    from tracer.storage import dump_folder, open_dump

    p = Path(path)
    if not p.exists():
        raise DiffError(f"{label}: {p} does not exist; give a run directory, its dump/ folder or "
                        "a step file (RUN/dump/rank0/step0.h5)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # skipped files are reported as problems instead
            dump = open_dump(p)
    except DumpFormatError as e:
        raise DiffError(f"{label}: {e}") from e
    if p.is_file():
        return Side(label, dump, None, p)
    # the reader's rule, so that the diff and the reader take the same folder for the dump; a
    # folder of loose step files stands for its own
    return Side(label, dump, dump_folder(dump.root) or dump.root, None)


def _no_readable(side: Side, rank: int | None) -> DiffError:
    where = side.dump_dir or side.file
    bad = [s for s in getattr(side.dump, "problems", []) if rank is None or s.rank == rank]
    listed = "".join(f"\n  {s.path}: {s.reason}" for s in bad[:8])
    more = f"\n  ... and {len(bad) - 8} more" if len(bad) > 8 else ""
    return DiffError(f"{side.label}: no readable complete step file in {where}{listed}{more}")


@dataclass
class Selection:
    """What `plan` chose: the pairs to compare, the problems found, what was left out."""

    plans: list[Plan]
    problems: list[Problem]
    left_out: list[Problem]
    notes: list[str]


def plan(sa: Side, sb: Side, step: int | None, rank: int | None, b_step: int | None,
         b_rank: int | None, allow_missing: bool = False) -> Selection:
    """The (rank, step, b_rank, b_step) pairs to compare, and every step of the selected ranks
    that cannot be compared (missing on one side, unreadable, partial-only, interrupted)."""
    oa, ob = sa.only(), sb.only()
    if sa.file is not None and oa is not None:
        rank, step = (oa[0], oa[1])
    if sb.file is not None and ob is not None:
        b_rank, b_step = (ob[0], ob[1])
    ranks_a = list(sa.dump.ranks)
    if not ranks_a:
        raise _no_readable(sa, None)
    if rank is None or (rank not in ranks_a and len(ranks_a) == 1 and rank == 0):
        rank = ranks_a[0]
    b_rank = rank if b_rank is None else b_rank
    ranks_b = list(sb.dump.ranks)
    if not ranks_b:
        raise _no_readable(sb, None)
    if b_rank not in ranks_b and len(ranks_b) == 1 and b_rank == rank:
        b_rank = ranks_b[0]
    for side, r, rs in ((sa, rank, ranks_a), (sb, b_rank, ranks_b)):
        if r not in rs:
            if any(s.rank == r for s in getattr(side.dump, "problems", [])):
                raise _no_readable(side, r)
            raise DiffError(f"{side.label} has no rank {r} (ranks: {', '.join(map(str, rs))}); "
                            f"pick one with --{'b-' if side.label == 'B' else ''}rank")
    sel = Selection([], [], [], [])
    for side, r in ((sa, rank), (sb, b_rank)):
        for s in getattr(side.dump, "file_states", []):
            if s.rank == r and s.state == "partial":
                sel.notes.append(f"{side.label}: ignored {s.path} ({s.reason})")
    steps_a, steps_b = list(sa.dump.steps(rank)), list(sb.dump.steps(b_rank))
    if step is None and b_step is not None:
        raise DiffError("--b-step needs --step (the step of A to compare it with)")
    if step is None and (sa.file is None and sb.file is None or len(steps_a) > 1
                         or len(steps_b) > 1):
        _every_step(sa, sb, rank, b_rank, allow_missing, sel)
        if not sel.plans:
            found = sel.problems + sel.left_out
            listed = "".join(f"\n  {p.line()}" for p in found[:8])
            raise DiffError(f"no step to compare: A rank {rank} has steps {steps_a}, B rank "
                            f"{b_rank} has {steps_b}; none is complete and readable on both "
                            f"sides{listed}")
        return sel
    if step is None:
        step = steps_a[0]
    b_step = step if b_step is None else b_step
    if b_step not in steps_b and len(steps_b) == 1 and sb.file is not None:
        b_step = steps_b[0]
    for side, s, ss, r in ((sa, step, steps_a, rank), (sb, b_step, steps_b, b_rank)):
        if s not in ss:
            bad = side.bad_steps(r).get(s)
            if bad is not None:
                raise DiffError(f"{side.label} rank {r} step {s} cannot be read: {bad.path}: "
                                f"{bad.reason}")
            raise DiffError(f"{side.label} rank {r} has no step {s} (steps: {ss}); pick one with "
                            f"--{'b-' if side.label == 'B' else ''}step")
    for side, r, s in ((sa, rank, step), (sb, b_rank, b_step)):
        state = side.interrupted(r, s)
        if state is not None:
            sel.problems.append(side.problem(state))  # chosen by name: compared, and marked
    sel.plans.append((rank, step, b_rank, b_step))
    return sel


def _every_step(sa: Side, sb: Side, rank: int, b_rank: int, allow_missing: bool,
                sel: Selection) -> None:
    """Every step either side holds for its rank, readable or not (`plan` without --step)."""
    steps_a, steps_b = set(sa.dump.steps(rank)), set(sb.dump.steps(b_rank))
    bad_a, bad_b = sa.bad_steps(rank), sb.bad_steps(b_rank)
    for s in sorted(steps_a | steps_b | set(bad_a) | set(bad_b)):
        found: list[Problem] = []
        for side, r, ok, bad in ((sa, rank, steps_a, bad_a), (sb, b_rank, steps_b, bad_b)):
            if s in bad:
                found.append(side.problem(bad[s]))
            elif s not in ok:
                other = "B" if side.label == "A" else "A"
                found.append(Problem(side.label, r, s, side.expected(r, s), "missing",
                                     f"missing: no step {s} here, while {other} has it"))
            elif (state := side.interrupted(r, s)) is not None:
                found.append(side.problem(state))
        readable = s in steps_a and s in steps_b
        if found and allow_missing:
            sel.left_out.extend(found)
            continue
        sel.problems.extend(found)
        if readable:
            sel.plans.append((rank, s, b_rank, s))
