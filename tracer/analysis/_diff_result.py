"""What `tracer.diff` returns, and how its rows become it: `DiffResult`, the columns of its
records table (`COLUMNS`), the rows put in execution order, the first divergence found and what
lies just before it, the rows a report shows (`_Summary`, gathered step by step when the records
are not kept), each compared step pair's summary, and the notes and status of the whole diff
(`_result`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from tracer.analysis._changed import changes, kind
from tracer.analysis._diff_plan import EXIT_OF_STATE, Plan, Problem
from tracer.analysis._written import param_when

_METRICS = ("error", "cosine", "max_abs_err", "max_rel_err", "mean_abs_err", "rmse", "within",
            "nan_diff", "inf_diff", "min_rdiff", "max_rdiff", "mean_rdiff", "norm_rdiff",
            "checksum_equal")
_COUNTS = ("nan", "posinf", "neginf")  # per side, from the statistics rows
COLUMNS = ("order", "step", "rank", "b_step", "b_rank", "seq", "b_seq", "name", "b_name",
           "module", "op", "phase", "direction", "index", "source", "caller", "dtype", "b_dtype",
           "shape", "b_shape") + _COUNTS + tuple(f"b_{c}" for c in _COUNTS) + (
           "compared", "verdict") + _METRICS + ("reason",)


@dataclass
class DiffResult:
    """What `tracer.diff` found."""

    status: Literal["same", "diverged", "incomplete"]
    """"same" only when every selected step of both sides was read completely and every
    matched record is within tolerance; "incomplete" when a step or record could not be read
    (or was interrupted: see `problems`), whatever the records read say; else "diverged"
    (records out of tolerance, a step one side lacks, or, where every paired record agrees,
    records one run alone makes whose values the other never holds: `computed_alone`)."""
    first_divergence: dict[str, Any] | None
    """The first divergent record in execution order (name, module, op, phase, step, rank,
    source, caller, kind, reason, metrics, and `unpaired_before`: the records without a partner
    right before it, each {side, name, op, source}), or None."""
    records: Any
    """pandas DataFrame, one row per record pair (or unmatched record), in execution order."""
    compared: Literal["tensor", "statistics", "mixed", "none"] = "none"
    """Whether tensors, statistics only, or some of each were compared."""
    notes: list[str] = field(default_factory=list)
    """Things worth knowing that are not divergences (e.g. levels differ, records unmatched)."""
    problems: list[Problem] = field(default_factory=list)
    """Each step (or record) of a side that was not fully read: missing, truncated,
    unreadable, partial-only, interrupted, damaged bytes, a read error while comparing."""
    left_out: list[Problem] = field(default_factory=list)
    """Steps `allow_missing` left out of the comparison, with what was wrong with them."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """One dict per compared step pair: rank, step, b_rank, b_step, status ("complete" or
    "interrupted", the worse of the two sides), reason, and its records' same/diverged counts."""
    record_counts: dict[str, int] | None = None
    """Records per verdict, kept when `records` is not (`diff(keep_records=False)`)."""
    shown: Any = None
    """pandas DataFrame of the rows a report lists, in both modes: the first divergent record,
    the `keep_worst` worst other divergent records (`severity`), then the first `keep_worst`
    records without a partner."""
    computed_alone: dict[str, Any] | None = None
    """Where no paired record differs but the runs computed different things: the first
    record one run alone makes whose values the other never holds (its row: name or b_name,
    verdict only_a or only_b, op, module, phase, step, source); else None."""
    changes: list[dict[str, Any]] = field(default_factory=list)
    """What changed between the runs, where the diff can tell, for a report's first lines:
    {"kind": "dtype", "a", "b" (the dtypes most matched records changed between), "records"
    (how many did), "paired" (matched records in all), "others" ({"a->b": count} of the other
    changes), "name", "source", "step" (the first such record)} when matched records differ in
    dtype; {"kind": "data" or "parameter", "name", "dtype", "shape", "source", "step"} when
    the first divergence is the model's input (or an integer input no recorded op made: token
    ids, labels) or a weight before the step (a parameter with "when": "before", "in_step",
    "unknown" or "unmatched", see tracer.analysis._written.param_when); {"kind": "written",
    "param", "written_by", "op", "module", "source", "caller", "name", "record", "dtype",
    "shape", "step"} when it is a weight an in-place op wrote during the step."""

    @property
    def exit_code(self) -> int:
        """0 same; 1 diverged or the step sets differ; 2 something could not be read."""
        code = max((EXIT_OF_STATE.get(p.state, 2) for p in self.problems), default=0)
        return max(code, 1 if self.first_divergence or self.status == "diverged" else 0)

    def problem_counts(self) -> dict[str, int]:
        """Number of problems per state (missing, truncated, ...)."""
        out: dict[str, int] = {}
        for p in self.problems:
            out[p.state] = out.get(p.state, 0) + 1
        return out

    def counts(self) -> dict[str, int]:
        """Number of records per verdict (same, diverged, only_a, only_b)."""
        if self.record_counts is not None:
            return dict(self.record_counts)
        v = self.records["verdict"].value_counts()
        return {k: int(v.get(k, 0)) for k in ("same", "diverged", "only_a", "only_b")}

    def to_dict(self, records: bool = True) -> dict[str, Any]:
        """A JSON-ready dict: status, exit_code, changes, first_divergence, compared, counts,
        problems, problem_counts, left_out, steps, notes, records."""
        out: dict[str, Any] = {"status": self.status, "exit_code": self.exit_code,
                               "changes": self.changes,
                               "first_divergence": self.first_divergence,
                               "compared": self.compared, "counts": self.counts(),
                               "problems": [p.to_dict() for p in self.problems],
                               "problem_counts": self.problem_counts(),
                               "left_out": [p.to_dict() for p in self.left_out],
                               "steps": self.steps, "notes": self.notes}
        if records:
            out["records"] = [_jsonable(r) for r in self.records.to_dict("records")]
        return out

    @staticmethod
    def frame(rows: list[dict]) -> Any:
        """Rows `on_rows` received as a DataFrame with the columns of `records`."""
        import pandas as pd

        return pd.DataFrame(rows, columns=list(COLUMNS))

    @staticmethod
    def json_rows(rows: list[dict]) -> list[dict[str, Any]]:
        """Rows `on_rows` received as JSON-ready dicts, as `to_dict` writes `records`."""
        return [_jsonable(r) for r in DiffResult.frame(rows).to_dict("records")]


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None if math.isnan(v) else ("inf" if v > 0 else "-inf")
        out[k] = v
    return out


def severity(row: dict) -> tuple:
    """Sort key of divergent records, worst first: by `error` (NaN/Inf patterns that differ
    are infinite, and the more positions the worse), then records without a measured error
    (shapes that differ through a module map)."""
    e = row.get("error")
    measured = e is not None and not (isinstance(e, float) and math.isnan(e))
    n, i = row.get("nan_diff"), row.get("inf_diff")
    nonfinite = 0 if n is None or (isinstance(n, float) and math.isnan(n)) else int(n) + int(i)
    return (not measured, -(float(e) if measured else 0.0), -nonfinite)


def _priority(row: dict) -> int:
    # a parameter's value before the optimizer step was in force during forward and backward:
    # if weights differ, that is where the divergence starts, not at the first op that used them;
    # unless the step wrote it in place (tracer.analysis._written), where its record holds the
    # value written, which was not in force before the write
    return 0 if (row["phase"] == "optimizer" and row["direction"] == "param"
                 and not row.get("written")) else 1


def _ordered(rows: list[dict]) -> list[dict]:
    """Execution order: by seq of A; records only B has are placed after the matched record that
    precedes them in B."""
    # a step's seq counts from its start: each step's records are placed among its own
    by_b = sorted((r for r in rows if r["b_seq"] >= 0), key=lambda r: (r["step"], r["b_seq"]))
    last, step = -1.0, None
    for r in by_b:
        if r["step"] != step:
            last, step = -1.0, r["step"]
        if r["seq"] >= 0:
            last = float(r["seq"])
            r["_pos"] = last
        else:
            last += 1e-6
            r["_pos"] = last
    for r in rows:
        if r["seq"] >= 0:
            r["_pos"] = float(r["seq"])
    rows.sort(key=lambda r: (r["step"], _priority(r), r["_pos"]))
    for i, r in enumerate(rows):
        r["order"] = i
        del r["_pos"]
    return rows


def _first_divergence(rows: list[dict]) -> dict[str, Any] | None:
    for i, r in enumerate(rows):
        if r["verdict"] == "diverged":
            keys = ("name", "module", "op", "phase", "step", "rank", "source", "caller",
                    "b_name", "b_step", "b_rank", "seq", "direction", "index", "dtype", "b_dtype",
                    "shape", "b_shape", "compared", "reason") + _METRICS
            fd = _jsonable({k: r[k] for k in keys})
            fd["kind"] = kind(r)
            if r.get("written"):
                fd["written"] = dict(r["written"])
            elif fd["kind"] == "parameter":
                fd.update(param_when(rows, i))
            fd["unpaired_before"] = _unpaired_before(rows, i)
            return fd
    return None


def _unpaired_before(rows: list[dict], i: int) -> list[dict[str, str]]:
    """The records without a partner right before row `i` in execution order (same step):
    where the two runs computed something differently, which is where a divergence that
    shows first in the next paired record was made (a reshape done with other ops, say).
    Each as {side, name, op, source}, in order."""
    out = []
    j = i - 1
    while j >= 0 and rows[j]["verdict"] in ("only_a", "only_b") \
            and rows[j]["step"] == rows[i]["step"]:
        r = rows[j]
        side = "A" if r["verdict"] == "only_a" else "B"
        out.append({"side": side, "name": str(r["name"] if side == "A" else r["b_name"]),
                    "op": str(r["op"]), "source": str(r["source"])})
        j -= 1
    return out[::-1]


class _Summary:
    """What `_result` needs of the rows, gathered one step at a time, and the rows a report
    shows (`DiffResult.shown`): the first divergent, the `keep` worst others, the first `keep`
    without a partner."""

    def __init__(self, keep: int = 10) -> None:
        self.counts = {k: 0 for k in ("same", "diverged", "only_a", "only_b")}
        self.first: dict[str, Any] | None = None
        self.mixed = 0
        self.first_mixed: dict[str, Any] | None = None
        self.dtype_pairs: dict[tuple[str, str], int] = {}
        self.keep = keep
        self.first_row: dict | None = None
        self.worst: list[dict] = []
        self.unpaired: list[dict] = []
        self.first_novel: dict | None = None
        """The first of the records one run alone makes whose values the other never holds."""
        self.novel_count = 0

    def shown(self) -> list[dict]:
        return ([self.first_row] if self.first_row else []) + self.worst + self.unpaired

    def add(self, rows: list[dict]) -> None:
        divergent = []
        for r in rows:
            if r["verdict"] in self.counts:
                self.counts[r["verdict"]] += 1
            if r["verdict"] == "diverged":
                divergent.append(r)
            elif r["verdict"] in ("only_a", "only_b"):
                if len(self.unpaired) < self.keep:
                    self.unpaired.append(r)
                if r.get("novel"):
                    self.novel_count += 1
                    self.first_novel = self.first_novel or r
        if divergent and self.first_row is None:
            self.first_row, divergent = divergent[0], divergent[1:]
        if divergent:
            self.worst = sorted(self.worst + divergent, key=severity)[:self.keep]
        fd = _first_divergence(rows)
        if fd is not None and (self.first is None or fd["step"] < self.first["step"]):
            self.first = fd
        mixed = [r for r in rows if r["dtype"] and r["b_dtype"] and r["dtype"] != r["b_dtype"]]
        self.mixed += len(mixed)
        for r in mixed:
            pair = (str(r["dtype"]), str(r["b_dtype"]))
            self.dtype_pairs[pair] = self.dtype_pairs.get(pair, 0) + 1
        if mixed and (self.first_mixed is None or mixed[0]["step"] < self.first_mixed["step"]):
            self.first_mixed = {k: mixed[0][k] for k in ("name", "dtype", "b_dtype", "source",
                                                         "step")}


def unpaired_most(counts: dict[str, int]) -> str | None:
    """In words, when most records of each side have no partner (the runs recorded different
    modules), or None: the one rule diff and explain judge it by."""
    paired = counts["same"] + counts["diverged"]
    if paired >= min(counts["only_a"], counts["only_b"]):
        return None
    return (f"most records of each side have no partner ({paired} paired, "
            f"{counts['only_a']} only in A, {counts['only_b']} only in B)")


def unpaired_words(summary: "_Summary") -> str:
    """The records without a partner in words: how many on each side, how many of them hold
    values the other run never holds, and the first of those."""
    c, first = summary.counts, summary.first_novel
    text = (f"{c['only_a']} records only in A, {c['only_b']} only in B, {summary.novel_count} "
            f"of them values the other run never holds")
    if first is None:
        return text
    side = "A" if first["verdict"] == "only_a" else "B"
    name = first["name"] if side == "A" else first["b_name"]
    return text + f" (the first: {name}, made by {side} alone in step {first['step']})"


def compiled_apart(setup: dict[str, Any] | None) -> str | None:
    """In words, how the earliest differing setups (tracer.analysis._setup.first_setup, or a
    diff's setup change) ran compiled code apart (one side ran as compiled regions what the
    other ran as modules), or None: records that then do not pair are no two codebases."""
    for d in (setup or {}).get("differences") or []:
        if d["kind"] == "compile" and d["key"] in ("compiled", "mode", "regions"):
            return d["text"]
    return None


def _step_summary(pl: Plan, rows: list[dict], problems: list[Problem]) -> dict[str, Any]:
    """One compared step pair: its status (interrupted on either side wins) and its counts
    (by verdict, and of op records)."""
    mine = [p for p in problems if p.state == "interrupted"
            and (p.side, p.rank, p.step) in (("A", pl[0], pl[1]), ("B", pl[2], pl[3]))]
    verdicts = [r["verdict"] for r in rows]
    return {"rank": pl[0], "step": pl[1], "b_rank": pl[2], "b_step": pl[3],
            "status": "interrupted" if mine else "complete",
            "reason": "; ".join(f"{p.side} {p.reason}" for p in mine),
            **{v: verdicts.count(v) for v in ("same", "diverged", "only_a", "only_b")},
            # records of ops (level op or mix): what explain re-runs
            "op_records": sum(1 for r in rows if r["op"])}


def _result(rows: list[dict], kinds: set[str], notes: list[str], problems: list[Problem],
            left_out: list[Problem], steps: list[dict[str, Any]], pd: Any,
            summary: _Summary, keep_records: bool = False,
            setup: dict[str, Any] | None = None,
            inputs: dict[tuple[int, int], dict[str, Any]] | None = None,
            mapped: bool = False) -> DiffResult:
    """The result from every row (`keep_records`) or from a summary gathered step by step;
    `setup`: the earliest step pair whose setups differ (tracer.analysis._setup); `inputs`:
    by A's (rank, step), which of the batch and buffers differ as the step began; `mapped`:
    the records were paired through a module map."""
    rows = _ordered(rows)
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    if keep_records:
        summary.add(rows)
        counts = None
    else:
        counts = summary.counts
    only = summary.counts["only_a"] + summary.counts["only_b"]
    if only:
        notes.append(f"{int(only)} records have no partner on the other side (see verdict "
                     "only_a/only_b)")
    if "sketch" in kinds:
        notes.append("sketches compared beside the statistics: up to 128 elements a record, at "
                     "positions both runs sample alike (compared 'sketch'; its cosine and errors "
                     "are those of the sampled elements)")
    kinds = {"statistics" if k == "sketch" else k for k in kinds}
    if "statistics" in kinds:
        notes.append("statistics compared (no tensor bytes on at least one side): min, max, "
                     "mean, norm, NaN/Inf counts and checksum")
    if summary.first_mixed is not None:
        r = summary.first_mixed
        notes.append(f"{summary.mixed} matched records differ in dtype, the first at {r['name']} "
                     f"({r['dtype']} vs {r['b_dtype']}, {r['source'] or 'unknown source'}); "
                     "they are judged with the looser dtype's tolerance")
    if left_out:
        notes.append(f"--allow-missing: {len({(p.rank, p.step) for p in left_out})} step(s) "
                     f"left out of the comparison, only steps both sides hold complete were "
                     f"compared")
    first = summary.first
    compared = ("mixed" if len(kinds) == 2 else next(iter(kinds))) if kinds else "none"
    worst = max((EXIT_OF_STATE.get(p.state, 2) for p in problems), default=0)
    status = "incomplete" if worst == 2 else ("diverged" if first or worst == 1 else "same")
    if worst == 1 and status == "diverged":
        notes.append("the runs' step sets differ: a step one side has is missing on the other")
    paired = summary.counts["same"] + summary.counts["diverged"]
    unpaired = unpaired_most(summary.counts)
    compiled = compiled_apart(setup)
    if unpaired and compiled:
        # the modules a compiled region runs have no records of their own: what pairs is
        # the regions' boundaries (the model's input and output, its gradients), the weights
        # and the optimizer's records, which is the step's whole effect
        notes.insert(0, f"{unpaired}: {compiled}, and the modules a region runs have no "
                        f"records of their own in that run; what pairs is the model's inputs "
                        f"and outputs, its gradients, the weights and the optimizer's records. "
                        f"To compare inside the regions, dump the compiled run with "
                        f"\"compiled\": \"interpret\" at level op or mix: its graphs' ops "
                        f"pair with an eager run's (docs/frameworks.md, torch.compile)")
    elif unpaired:
        # most of each side's records found no partner: the runs recorded different modules,
        # and a "same" over the few that paired would speak for what was never compared
        if status == "same":
            status = "diverged"
        why = ("the module map pairs few of these runs' modules: it was made for other runs, "
               "or with A and B swapped; write one for these two, `sleuth map A B > map.yaml`"
               if mapped else
               "the two dumps record different modules. Two codebases? `sleuth map A B > "
               "map.yaml` pairs their modules for `--map map.yaml`; else compare dumps of the "
               "same level and module filter")
        notes.insert(0, f"{unpaired}: {why}")
    alone = None
    if not unpaired and summary.novel_count and status == "same":
        # every record both runs made agrees, but one run computed what the other did not (a
        # frozen weight's gradient, an op one run skips): the runs differ, and "same" would
        # send the user away from it
        status, alone = "diverged", summary.first_novel
        notes.insert(0, f"no record both runs made differs, but the runs computed different "
                        f"things: {unpaired_words(summary)}; `sleuth explain` says why")
    return DiffResult(status=status, first_divergence=first, records=df, compared=compared,
                      notes=notes, problems=problems, left_out=left_out, steps=steps,
                      record_counts=counts, computed_alone=alone,
                      shown=pd.DataFrame(summary.shown(), columns=list(COLUMNS)),
                      changes=changes(summary.dtype_pairs, summary.first_mixed, first, paired,
                                      setup, inputs))
