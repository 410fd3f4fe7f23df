"""`tracer.check`: watchpoints evaluated offline on a dump, the origin of the first NaN, and an
account of what was read.

Both read only the statistics tables (no tensor bytes), step by step, so they run on dumps of
any size and in either dump mode. Nothing here is called clean unless every selected step file
was read: files that are partial, unreadable, truncated or damaged are collected in a `Coverage`
with the reason, and interrupted steps (root attribute `status`) are searched and named.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from tracer._config import _as_str_tuple, _pattern_matcher
from tracer._errors import DumpFormatError
from tracer._watch_config import WatchConfig, parse_watch
from tracer.analysis._diff import _rows
from tracer.analysis._origin import StepOrigin, finite_params, nonfinite, sig
from tracer.analysis._patterns import stored_matches
# read_flight_recorder: a crashed run's last steps, offered by tracer.analysis beside check
# (docs/diff.md names it there); the file is storage's to write and read
from tracer.storage import Watcher, read_flight_recorder  # noqa: F401
from tracer.storage import READ_ERRORS, UNREAD_STATES, step_status

HIT_COLUMNS = ("rank", "step", "seq", "name", "module", "op", "phase", "direction", "source",
               "condition", "value", "origin")
TABLE_READ_ERRORS = READ_ERRORS
"""What a damaged HDF5 file raises while its tables are read (storage's `READ_ERRORS`)."""


@dataclass
class Coverage:
    """What a check read: step files read, files it could not read, interrupted steps."""

    read: int = 0
    """Step files whose /records table was read completely."""
    unread: list[dict] = field(default_factory=list)
    """{path, rank, step, reason} of each selected file that could not be read (rank/step None
    when the file name does not say)."""
    interrupted: list[dict] = field(default_factory=list)
    """{path, rank, step, reason} of each step file written with a status other than complete."""

    def unread_before(self, step: int) -> list[dict]:
        """Unread files that may hold a step up to `step` (unknown steps included)."""
        return [u for u in self.unread if u["step"] is None or u["step"] <= step]

    def to_dict(self) -> dict[str, Any]:
        return {"read": self.read, "unread": list(self.unread),
                "interrupted": list(self.interrupted)}

    @staticmethod
    def verdict(cov: dict[str, Any], found: bool, where: str | None = None,
                unfound: str | None = None) -> tuple[int, str]:
        """(exit code, why) of an answer over `cov` (`to_dict()`): 2 when not everything was
        read, 1 when something was `found`, else 2 with `unfound` when given (the answer could
        not be made) or when a step was interrupted, else 0. Nothing is called clean on data
        not all read. `where`: the path searched, named when no step file was there."""
        unread, read = cov["unread"], cov["read"]
        files = [u for u in unread if u.get("state") != "empty"]
        if not read:
            what = (f"{len(files)} file(s) could not be read" if files
                    else f"no step file under {where}" if where else "no step file")
            return 2, f"nothing was read: {what}; nothing was checked"
        if files:
            return 2, (f"{len(files)} of {read + len(files)} step file(s) could not be read; "
                       "the answer covers only the rest")
        if unread:  # rank folders without a step file: those ranks dumped nothing
            return 2, (f"{len(unread)} rank folder(s) hold no step file ("
                       + ", ".join(u["path"] for u in unread[:4])
                       + "): those ranks dumped nothing, so the answer covers only the others")
        if found:
            return 1, "found"
        if unfound:
            return 2, unfound
        if cov["interrupted"]:
            return 2, (f"nothing found, but {len(cov['interrupted'])} step(s) were interrupted: "
                       "their records stop early, so the dump is not called clean")
        return 0, "clean"


def _unread(dump: Any, rank: int | None, step: int | None) -> list[dict]:
    """{path, rank, step, state, reason} of each file (or empty rank folder) of the selection
    that could not be read; rank None where no rank folder names it, step None where no file
    does (an empty rank folder)."""
    out = []
    for st in getattr(dump, "file_states", []):
        if st.state not in UNREAD_STATES:
            continue
        r = None if st.rank is None or st.rank < 0 else st.rank
        if (rank is None or r in (rank, None)) and (step is None or st.step in (step, None)):
            out.append({"path": st.path, "rank": r, "step": st.step, "state": st.state,
                        "reason": st.reason})
    return out


def _selected(dump: Any, rank: int | None, step: int | None,
              unread: list[dict] = ()) -> list[tuple[int, int]]:
    ranks = dump.ranks if rank is None else [rank]
    out = []
    for r in ranks:
        if r not in dump.ranks:
            if any(u["rank"] in (r, None) for u in unread):
                continue  # its files are all unread: reported as such, not as a wrong rank
            raise DumpFormatError(f"no rank {r} in the dump; ranks: {dump.ranks}")
        steps = dump.steps(r) if step is None else [step]
        for s in steps:
            if s not in dump.steps(r) and any(u["step"] in (s, None) for u in unread):
                continue
            dump.path(r, s)  # raises, naming what exists, when the step is missing
            out.append((r, s))
    return out


def read_steps(dump: Any, coverage: Coverage, *, rank: int | None = None,
               step: int | None = None, by_step: bool = False
               ) -> Iterator[tuple[int, int, Any, dict[str, Any]]]:
    """(rank, step, statistics DataFrame, root attributes) of each selected, readable step file,
    rank by rank (or step by step with `by_step`). Files that cannot be read, and interrupted
    steps, are added to `coverage`."""
    coverage.unread += _unread(dump, rank, step)
    selected = _selected(dump, rank, step, coverage.unread)
    if by_step:
        selected.sort(key=lambda rs: (rs[1], rs[0]))
    for r, s in selected:
        path = str(dump.path(r, s))
        try:
            attrs = dump.attrs(r, s)
            df = dump.stats(r, s)
        except TABLE_READ_ERRORS as e:
            coverage.unread.append({"path": path, "rank": r, "step": s,
                                    "reason": f"damaged: {type(e).__name__}: {e}"})
            continue
        status, reason = step_status(attrs)
        if status != "complete":
            coverage.interrupted.append({"path": path, "rank": r, "step": s, "status": status,
                                         "reason": reason})
        coverage.read += 1
        yield r, s, df, attrs


def _configured_watch(attrs: dict[str, Any], source: str) -> list[WatchConfig]:
    from tracer.storage import config_of  # read within size and depth limits

    return parse_watch(config_of(attrs, source).get("watch") or [])


def check(path: str | os.PathLike, *, watch: Iterable[WatchConfig | dict] | None = None,
          rank: int | None = None, step: int | None = None, first_nan: bool = True,
          nan_allow: Iterable[str] = ()) -> Any:
    """Evaluate watchpoints on every record of a dump (statistics only).

    Args:
        path: run directory, dump directory or step file (or an open Dump).
        watch: watchpoints (WatchConfig or dicts like {"condition": "nan_inf"}); None uses the
            dump config's `watch` list plus nan_inf.
        rank, step: restrict to one rank / step (default: all).
        first_nan: also locate the origin of the first NaN/Inf (`df.attrs["first_nan"]`).
        nan_allow: record-name patterns (globs, "re:REGEX") whose non-finite values are
            intended, added to the dump config's `nan_allow`: no nan_inf hit, no origin.

    Returns:
        DataFrame of hits (columns HIT_COLUMNS), in rank, step, execution order. Hits recorded
        live in the dump's /hits are included (origin "live") unless the same hit was found
        offline. `df.attrs["first_nan"]` holds `first_nan_origin()`'s answer (or None) and
        `df.attrs["coverage"]` the `Coverage.to_dict()` of what was read and what was not.

    Raises:
        DumpFormatError for a missing dump, rank or step; ConfigError for a bad watchpoint or
        pattern.
    """
    import pandas as pd

    from tracer.storage import open_dump

    dump = path if hasattr(path, "stats") else open_dump(path)
    explicit = parse_watch(list(watch)) if watch is not None else None
    rows: list[dict] = []
    watchers: dict[int, Watcher] = {}  # one per rank: weight conditions look across steps
    coverage = Coverage()
    patterns = _as_str_tuple("nan_allow", list(nan_allow))
    for r, s, df, attrs in read_steps(dump, coverage, rank=rank, step=step):
        points = explicit
        if points is None:
            points = _configured_watch(attrs, str(dump.path(r, s)))
            if not any(w.condition == "nan_inf" for w in points):
                points.append(WatchConfig(condition="nan_inf"))
        watcher = watchers.setdefault(r, Watcher(points))
        watcher.watch = points
        recs = _rows(df)
        allowed = _allowed_names(recs, _allow(patterns, attrs, recs, str(dump.path(r, s))))
        seen = set()
        for rec in recs:
            rec["step"] = s
            for _, hit in watcher.check(rec):
                seen.add((int(rec["seq"]), hit["condition"]))
                if hit["condition"] == "nan_inf" and rec["name"] in allowed:
                    continue  # intended non-finite values (nan_allow)
                rows.append({"rank": r, "step": s, "seq": int(rec["seq"]), "name": rec["name"],
                             "module": rec["module"], "op": rec["op"], "phase": rec["phase"],
                             "direction": rec["direction"], "source": rec["source"],
                             "condition": hit["condition"], "value": hit["value"],
                             "origin": "offline"})
        try:
            live = dump.hits(r, s)
        except TABLE_READ_ERRORS as e:
            coverage.unread.append({"path": str(dump.path(r, s)), "rank": r, "step": s,
                                    "reason": f"damaged /hits table: {type(e).__name__}: {e}"})
            continue
        if len(live):
            by_seq = df.set_index("seq")
            for h in live.to_dict("records"):
                if (int(h["seq"]), h["condition"]) in seen or (
                        h["condition"] == "nan_inf" and h["name"] in allowed):
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
    out.attrs["first_nan"] = (find_first_nan(dump, Coverage(), rank=rank, step=step,
                                             nan_allow=nan_allow) if first_nan else None)
    out.attrs["coverage"] = coverage.to_dict()
    return out


# -- first NaN ------------------------------------------------------------------------------------
def _allow(patterns: Iterable[str], attrs: dict[str, Any], recs: list[dict], source: str):
    """`allow(name)` for the records of one step that hold NaN/Inf (the only ones it is asked
    about): `patterns` (the user's own) match here; the dump config's `nan_allow`, which the
    file brought, match with a time bound (`_patterns`)."""
    from tracer.storage import config_of

    configured = config_of(attrs, source).get("nan_allow") or ()
    try:
        configured = _as_str_tuple("nan_allow", configured)
    except ValueError:
        configured = ()  # a file's own bad config never stops a check; the CLI's patterns do
    names = [str(r["name"]) for r in recs if nonfinite(r)]
    if not names:
        return lambda name: False
    mine = _pattern_matcher(tuple(patterns))
    allowed = {n for n in names if mine(n)}
    if configured:
        allowed |= stored_matches(configured, [n for n in names if n not in allowed], source)
    return allowed.__contains__


def _allowed_names(recs: list[dict], allow: Any) -> set[str]:
    """Names of the records `allow` matches that hold NaN/Inf, and of every record holding the
    same values (the softmax that reads an allowed mask)."""
    sigs = {sig(r) for r in recs if nonfinite(r) and allow(str(r["name"]))}
    return {str(r["name"]) for r in recs if sigs and nonfinite(r) and sig(r) in sigs}


def find_first_nan(dump: Any, coverage: Coverage, *, rank: int | None = None,
                   step: int | None = None, nan_allow: Iterable[str] = ()
                   ) -> dict[str, Any] | None:
    """`first_nan_origin` on an open Dump, filling `coverage` with what it read and could not.
    The answer carries `unread_before`: unread files whose step may come before it.

    Across ranks, the earliest step wins; within that step every rank's origin is found and
    the earliest is the answer: by the collectives each rank had begun before its record (the
    c10d calls an op-level dump records: a collective is the one point where the ranks'
    orders meet, `collective_calls`), then in execution order (seq: data-parallel ranks run
    the same program). So a NaN one rank makes and the others receive through a collective is
    blamed on the rank that made it, not on the lowest rank number nor on a rank that merely
    ran fewer ops before the collective. The others are listed under `other_ranks` (rank,
    name, kind, seq, source, collective, received: whether it came after a collective the
    answer's record preceded)."""
    patterns = _as_str_tuple("nan_allow", list(nan_allow))
    found: dict[str, Any] | None = None
    others: list[dict[str, Any]] = []
    for r, s, df, attrs in read_steps(dump, coverage, rank=rank, step=step, by_step=True):
        if found is not None and s > found["step"]:
            break  # an earlier step already holds the origin
        if not len(df):
            continue
        if not ((df["nan"] > 0) | (df["posinf"] > 0) | (df["neginf"] > 0)).any():
            continue

        def before(r: int = r, s: int = s) -> set[str] | None:
            if s - 1 not in dump.steps(r):
                return None
            try:
                return finite_params(_rows(dump.stats(r, s - 1)))
            except TABLE_READ_ERRORS:
                return None

        recs = _rows(df)
        origin = StepOrigin(recs, _allow(patterns, attrs, recs, str(dump.path(r, s))),
                            before).find()
        if origin is not None:
            status, reason = step_status(attrs)
            calls = collective_calls(df)
            here = {**origin, "step": s, "rank": r, "status": status, "status_reason": reason,
                    "collective": int((calls < int(origin["seq"])).sum()),
                    "collectives_recorded": bool(len(calls))}
            if found is None or _order(here) < _order(found):
                if found is not None:
                    others.append(found)
                found = here
            else:
                others.append(here)
    if found is not None:
        found["unread_before"] = coverage.unread_before(found["step"])
        found["other_ranks"] = [
            {**{k: o.get(k) for k in ("rank", "name", "kind", "seq", "source", "collective")},
             "received": found["collective"] < o["collective"]}
            for o in sorted(others, key=_order)]
        found["ranks_ordered_by"] = ranks_ordered_by(found, others)
    return found


def ranks_ordered_by(found: dict[str, Any], others: list[dict[str, Any]]) -> str | None:
    """How the ranks holding a NaN origin in the same step were put in order: "collectives"
    when their dumps record collective calls (level op or mix), else "execution order" (a
    module-level dump: which rank sent a NaN through an all-reduce cannot be told, only which
    made one earliest in its own program); None with one rank."""
    if not others:
        return None
    recorded = all(o.get("collectives_recorded") for o in (found, *others))
    return "collectives" if recorded else "execution order"


def _order(origin: dict[str, Any]) -> tuple[int, int, int]:
    """Cross-rank order of two ranks' origins in one step: collectives begun before them,
    then seq, then rank."""
    return origin["collective"], int(origin["seq"]), int(origin["rank"])


_COLLECTIVE_OPS = ("c10d.", "_c10d_functional.")


def collective_calls(df: Any) -> Any:
    """The seq where each collective call (c10d ops: dist.all_reduce & co., recorded at op
    level) of a step's records begins: its first record (its input, before it runs), so its
    output records come after it. Empty in a dump without op records (module level): the order
    across ranks is then seq's."""
    calls = df[df["op"].astype(str).str.startswith(_COLLECTIVE_OPS)]
    # one call's records share their name up to ".{direction}.{index}"
    return calls.groupby(calls["name"].astype(str).str.rsplit(".", n=2).str[0])["seq"].min()


def first_nan_origin(dump_or_path: Any, *, rank: int | None = None, step: int | None = None,
                     nan_allow: Iterable[str] = ()) -> dict[str, Any] | None:
    """Where the first NaN/Inf of a dump came from, in execution order (steps ascending, then
    forward, backward, optimizer): the op or module that made it from finite inputs, the
    in-place op that wrote it into a finite tensor, or the value no dumped call made
    (tracer.analysis._origin says how). Values that a later op absorbs (a causal mask's -inf before
    softmax) and records matching `nan_allow` (or the dump config's) are passed over.

    Returns a dict (name, module, op, phase, step, rank, source, seq, counts, values, kind,
    inputs, why, status, unread_before, ...) or None when the readable steps hold no NaN/Inf
    that counts. With several ranks, the earliest step wins. Unread files are only listed in
    `unread_before`; `check()` and `sleuth check` report them."""
    from tracer.storage import open_dump

    dump = dump_or_path if hasattr(dump_or_path, "stats") else open_dump(dump_or_path)
    return find_first_nan(dump, Coverage(), rank=rank, step=step, nan_allow=nan_allow)


def describe_origin(o: dict[str, Any]) -> str:
    """A sentence for the terminal."""
    module = "outside any module" if o["module"] in ("<none>", "") else f"module {o['module']}"
    op = f"op {o['op']}, " if o["op"] else ""
    counts = ", ".join(f"{o[k]} {label}" for k, label in
                       (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf")) if o[k])
    status = "" if o.get("status", "complete") == "complete" else \
        f" (step {o['status']}: {o.get('status_reason') or 'no reason recorded'})"
    # a parameter record has no line of its own: the records after it name where it was read
    where = o["source"] or ("no source line (a parameter record)" if o["phase"] == "optimizer"
                            else "unknown source")
    text = (f"first {o.get('values', 'NaN/Inf')}: {o['name']} ({op}{module}, {o['phase']}, "
            f"step {o['step']}{status}, rank {o['rank']}) at {where}: {counts} of {o['numel']} "
            f"elements; {o['why']}")
    later = o.get("other_ranks") or []
    if later:
        def one(x: dict[str, Any]) -> str:
            if not x.get("received"):
                return f"rank {x['rank']} at {x['name']}"
            return (f"rank {x['rank']} at {x['name']} (after {x['collective']} collective(s) of "
                    f"the step, rank {o['rank']}'s after {o['collective']}): received from rank "
                    f"{o['rank']} through a collective")
        shown = "; ".join(one(x) for x in later[:4])
        more = f" and {len(later) - 4} more" if len(later) > 4 else ""
        text += (f". Later in that step (in execution order) {len(later)} other rank(s) hold "
                 f"non-finite values, received or made after it: {shown}{more}")
        if o.get("ranks_ordered_by") == "execution order":
            text += (". These dumps hold no collective call in that step (a module-level dump "
                     "records none, and the all-reduces DDP and FSDP run themselves are not "
                     "recorded at any level), so the ranks are ordered by execution order "
                     "alone: which rank sent the NaN through an all-reduce cannot be told "
                     "from them; at level op or mix, the collectives the model's own code "
                     "calls (dist.all_reduce) are recorded and order the ranks")
    return text
