"""A bug under rounding: where a precision or unexplained verdict would hide one
(tracer.analysis._explain).

When B computes in a lower precision (bf16 autocast), the diff judges every record with that
precision's tolerance, and a small tensor can differ by a third and still be "same" (within the
absolute tolerance). The record where a bug begins is then not a divergence at all, the chain
`explain` follows starts later (or the bug lies past `--limit`), at ops that stay within their
rounding, and the difference they receive looks like rounding too (or, where no dtype differs,
comes from nowhere). So before a verdict says precision, or that the difference was made
upstream, the step is searched for where an error is made that rounding cannot account for:

- a paired op call whose outputs differ far more than its inputs (`factor` times, plus two units
  of roundoff of the lowest precision either run computes in): re-run as the chain's ops are
  (`Sides.entry`), a bug when B's call on A's inputs is off by more than its rounding;
- an op's input whose value differs far more than the values it was made from: the paired
  records upstream of it in either run, through the ops only one run runs (an op added, removed
  or replaced) or none (another value passed). Measured on the tensors: the input's error above
  `factor` times the sum of what it received and the rounding of the ops in between is a bug,
  named by the first divergence's judgement (tracer.analysis._explain_lead);
- a value made by an op only one run runs that is no cast and computes (autocast adds casts
  and nothing else, in forward and backward alike), judged at the record it feeds (an op's
  input, or the gradient the optimizer reads): a bug where that record differs far more than
  what reached the op, named as the op added or removed at its line. This is how a bug only
  the backward has (a gradient hook, a loss changed by label smoothing) is found under
  autocast, where the backward's paired records are not searched.

Candidates come from the diff's own errors (no tensor is read to find them) in execution order;
at most `limit` of them are re-run or measured, the earliest bug wins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

from tracer.analysis._explain_lead import Finding, Lead
from tracer.analysis._explain_sides import Sides, roundoff, stem
from tracer.analysis._explain_step import CASTS as _CASTS
from tracer.analysis._explain_step import Step
from tracer.analysis._origin import call_stem, sig
from tracer.analysis._replay import NotReplayable, rel_error

_LOW = ("float8_e4m3fn", "float8_e5m2", "float16", "bfloat16")


@dataclass
class Hidden:
    """A bug found under rounding: the blamed call and why, and how far its records differ."""

    blamed: dict[str, Any]
    why: str
    record: str
    """The record where the error is made (an op's output or input)."""
    error: float
    """That record's relative error as the diff measured it (within its tolerance or not)."""
    verdict: str
    """"same" or "diverged": what the diff said of that record."""


class Search:
    """The step of the divergence searched for a bug under rounding (module doc)."""

    def __init__(self, step: Step, records: Any, sides: Sides, lead: Lead,
                 fd: dict[str, Any], factor: float, setup_lines: frozenset[str] = frozenset()
                 ) -> None:
        """`setup_lines`: the lines where a setup the runs differ in runs its own ops (a loss
        scaled by a gradient scaler one run alone has): what differs there is that setup's,
        no bug to find."""
        self.step, self.sides, self.lead, self.fd, self.factor = step, sides, lead, fd, factor
        self.setup_lines = setup_lines
        rows = records[(records["step"] == fd["step"]) & (records["rank"] == fd["rank"])]
        self.rows = rows.sort_values("order", kind="stable").to_dict("records")
        self.error: dict[str, dict[str, float]] = {"a": {}, "b": {}}
        self.partner: dict[str, dict[str, str]] = {"a": {}, "b": {}}
        self.verdicts: dict[str, str] = {}
        low = []
        for r in self.rows:
            for d in (r["dtype"], r["b_dtype"]):
                if d in _LOW:
                    low.append(d)
            if r["verdict"] not in ("same", "diverged"):
                continue
            a, b = str(r["name"]), str(r["b_name"] or r["name"])
            err = float(r["error"]) if r["error"] == r["error"] else math.nan
            self.error["a"][a], self.error["b"][b] = err, err
            self.partner["a"][a], self.partner["b"][b] = b, a
            self.verdicts[a] = str(r["verdict"])
        self.lows = sorted(set(low))
        self.slack = 2 * _unit(self.lows)
        # the latest op output holding a value, found without scanning the step each time
        self.made: dict[str, dict[tuple, list[tuple[int, dict]]]] = {}
        for side in ("a", "b"):
            index: dict[tuple, list[tuple[int, dict]]] = {}
            for i, r in enumerate(step.rows[side]):
                if r["op"] and r["direction"] == "output":
                    index.setdefault(sig(r), []).append((i, r))
            self.made[side] = index

    def find(self, skip: set[str], limit: int) -> Hidden | None:
        """The earliest bug under rounding among at most `limit` candidates (calls in `skip`,
        A's stems already re-run on the chain, are only judged by their inputs' values), or
        None."""
        tried = 0
        for kind, row in self._candidates():
            if tried >= limit:
                break
            tried += 1
            found = self._call(row, stem(str(row["name"])) not in skip) if kind == "call" \
                else self._added(row) if kind == "added" else self._input(row)
            if found is not None:
                return found
        return None

    # -- candidates, from the diff's errors --------------------------------------------------------
    def _candidates(self) -> Iterator[tuple[str, dict]]:
        """("call", its first output row) or ("input", the row), in execution order, made as
        they are asked for: the search stops at the first bug."""
        calls: dict[str, dict[str, list[dict]]] = {}
        for r in self.rows:
            if r["op"] and r["verdict"] in ("same", "diverged"):
                calls.setdefault(stem(str(r["name"])), {"input": [], "output": []}) \
                    .setdefault(str(r["direction"]), []).append(r)
        for r in self.rows:
            if r["verdict"] not in ("same", "diverged") or self._at_setup(r):
                continue
            if self.lows and self._after_added(r):
                yield "added", r
                continue
            if not r["op"]:
                continue
            if self.lows and r["phase"] != "forward":
                # B's autocast casts its gradients too: its backward's records pair with A's
                # by call counts that the casts shift, and a gradient's rounded value matches
                # none of A's exactly, so a backward under rounding names calls that are no bug
                continue
            recs = calls[stem(str(r["name"]))]
            if r["direction"] == "input":
                e = _err(r)
                if e > self.slack and e > self.factor * self._received(r) + self.slack:
                    yield "input", r
            elif recs["output"] and r is recs["output"][0]:
                e_in = max((_err(x) for x in recs["input"]), default=0.0)
                e_out = max(_err(x) for x in recs["output"])
                if e_out > self.factor * e_in + self.slack:
                    yield "call", r

    def _at_setup(self, row: dict) -> bool:
        """Whether a paired record is made at a setup's line in either run (the two scripts
        may put the call on other lines)."""
        if not self.setup_lines:
            return False
        return row["source"] in self.setup_lines or self.step.source(
            "b", str(row["b_name"] or row["name"])) in self.setup_lines

    def _after_added(self, row: dict) -> bool:
        """Whether `row` (an op's input, or the gradient the optimizer reads) is made, in
        either run, by an op that run alone runs which is no cast and computes a value of its
        own: under autocast only casts should differ between the runs' ops, in forward and
        backward alike (call counts of other ops do not shift)."""
        if row["direction"] != "input" and not (row["phase"] == "optimizer"
                                                and row["direction"] == "grad"):
            return False
        for side, name in (("a", str(row["name"])), ("b", str(row["b_name"] or row["name"]))):
            rec = self.step.get(side, name)
            p = self._producer(side, rec) if rec is not None else None
            if p is not None and self.step.unpaired(side, p) and p["op"] not in _CASTS and \
                    p["source"] not in self.setup_lines and \
                    all(sig(r) != sig(p) for r in self.step.calls[side][call_stem(p)]
                        if r["direction"] == "input"):
                return True
        return False

    def _added(self, row: dict) -> Hidden | None:
        """An op only one run runs (`_after_added`), judged at the record it feeds: a bug when
        that record differs far more than what reached the op's inputs, and than the
        rounding of the record's own dtypes."""
        e = _err(row)
        unit = _unit([d for d in (row["dtype"], row["b_dtype"]) if d in _LOW])
        if not e > self.factor * self._received(row) + 2 * unit:
            return None
        return self._judged(self._as_fd(row, "input"), str(row["name"]), e)

    def _received(self, row: dict) -> float:
        """The largest diff error of the paired records an input's value was made from, in
        either run (0.0 when none: a value from outside the recorded calls)."""
        got = [self.error[side].get(str(r["name"]), 0.0)
               for side, r in self._sources(row)]
        return max((e for e in got if e == e), default=0.0)

    def _sources(self, row: dict) -> list[tuple[str, dict]]:
        """(side, record) of the paired op outputs an input's value was made from: its maker
        when paired, else the paired makers of the inputs of the unpaired calls between."""
        out = []
        for side, name in (("a", str(row["name"])), ("b", str(row["b_name"] or row["name"]))):
            rec = self.step.get(side, name)
            todo, seen = [rec] if rec is not None else [], set()
            while todo and len(seen) < 32:
                p = self._producer(side, todo.pop())
                if p is None or call_stem(p) in seen:
                    continue
                seen.add(call_stem(p))
                if str(p["name"]) in self.error[side]:
                    out.append((side, p))
                    continue
                todo += [r for r in self.step.calls[side][call_stem(p)]
                         if r["direction"] == "input"]
        return out

    def _producer(self, side: str, rec: dict) -> dict | None:
        """As `Step.producer`, from the index of op outputs by value."""
        at, own = self.step.at[side][str(rec["name"])], call_stem(rec)
        for i, r in reversed(self.made[side].get(sig(rec), [])):
            if i < at and call_stem(r) != own:
                return r
        return None

    # -- confirmed on the tensors ------------------------------------------------------------------
    def _call(self, row: dict, rerun: bool) -> Hidden | None:
        e = self.sides.entry(row, self.step.source("b", str(row["b_name"] or row["name"]))) \
            if rerun else {"judged": "rounding"}
        if e["judged"] != "bug":
            # re-run on A's tensors argument by argument, operands of two shapes swapped look
            # like A's call: an input without a partner is judged by its value
            return self._judged(self._as_fd(row, "output"), str(row["name"]), _err(row))
        e["fault"] = "arguments" if e.get("changes") else "computes"
        how = (f"is called with other arguments in B ({'; '.join(e['changes'])}), which "
               "change the result" if e["changes"] else "changes the result on identical "
               "inputs")
        return Hidden(e, f"op {_where(e)} {how}: {e['why']}", str(row["name"]), _err(row),
                      self.verdicts.get(str(row["name"]), "?"))

    def _input(self, row: dict) -> Hidden | None:
        a, b = str(row["name"]), str(row["b_name"] or row["name"])
        try:
            x_a, x_b = self.sides.record("a", a), self.sides.record("b", b)
            received = 0.0
            for side, p in self._sources(row):
                other = "b" if side == "a" else "a"
                mine = self.sides.record(side, str(p["name"]))
                theirs = self.sides.record(other, self.partner[side][str(p["name"])])
                received = max(received, rel_error(mine, theirs) if side == "b"
                               else rel_error(theirs, mine))
            ops = [(side, call_stem(r)) for side, rec in (("a", self.step.get("a", a)),
                                                          ("b", self.step.get("b", b)))
                   for r in self.step.made_by(side, rec)]
            entitled = sum(self.sides.own_rounding(side, call) for side, call in ops)
        except NotReplayable:
            return None
        err = rel_error(x_b, x_a)
        if not err > self.factor * (received + entitled) + 2 * roundoff(x_b):
            return None
        found = self._judged(self._as_fd(row, "input"), a, _err(row))
        if found is not None and ops:
            found.why += f"; what reaches it differs by {received:.3g} only"
        return found

    def _as_fd(self, row: dict, direction: str) -> dict[str, Any]:
        return {**self.fd, "name": str(row["name"]), "b_name": str(row["b_name"] or row["name"]),
                "op": row["op"], "module": row["module"], "phase": row["phase"],
                "direction": direction, "index": int(row["index"]), "source": row["source"],
                "dtype": row["dtype"], "b_dtype": row["b_dtype"], "seq": row["seq"],
                "unpaired_before": []}

    def _judged(self, fd: dict[str, Any], record: str, error: float) -> Hidden | None:
        """The first divergence's judgement of `fd`, when it is a bug."""
        found: Finding | None = self.lead.judge(fd)
        if found is None or found.judged != "bug" or not found.blamed:
            return None
        makers = found.blamed.get("makers") or {}
        if self.lows and len(makers) == 2 and makers["a"] == makers["b"]:
            # under rounding a value is followed back by its statistics, which B's rounded
            # values match nowhere exactly: where the same op at the same line made both, that
            # names another call of it, no bug
            return None
        if self.lows and self._only_casts(found.blamed):
            # ops only one run runs that are all casts are its autocast's: they round, and
            # shift the call counts that pair the records after them with other calls
            return None
        blamed = self._past_casts(found.blamed)
        return Hidden(blamed, found.why, record, error, self.verdicts.get(record, "?"))

    def _only_casts(self, blamed: dict[str, Any]) -> bool:
        """Whether the ops only one run runs that `blamed` names are all casts."""
        stems = [("b", s) for s in blamed.get("added") or []] + \
            [("a", s) for s in blamed.get("removed") or []]
        return bool(stems) and all(r["op"] in _CASTS for side, key in stems
                                   for r in self.step.calls[side].get(key, []))

    def _past_casts(self, blamed: dict[str, Any]) -> dict[str, Any]:
        """Among the ops only one run runs, the first that is not a cast: B's autocast casts
        its gradients too, so an op added in a backward comes with casts only B makes."""
        side = "b" if blamed.get("side") == "B" else "a"
        stems = blamed.get("added" if side == "b" else "removed") or []
        if blamed.get("op") not in _CASTS or len(stems) < 2:
            return blamed
        for key in stems:
            recs = self.step.calls[side].get(key, [])
            rec = next((r for r in recs if r["direction"] == "output"), recs[0] if recs else None)
            if rec is not None and rec["op"] not in _CASTS:
                return {**blamed, "name": key, "b_name": key if side == "b" else "",
                        "op": rec["op"], "module": rec["module"], "source": rec["source"],
                        "caller": rec.get("caller") or "", "phase": rec["phase"]}
        return blamed


def lower_dtypes(records: Any, fd: dict[str, Any]) -> list[str]:
    """The floating dtypes below float32 that B computes in where A does not (in records
    both runs make), at the divergence's step: where rounding is present on top of anything
    else."""
    rows = records[(records["step"] == fd["step"]) & (records["rank"] == fd["rank"])
                   & records["verdict"].isin(("same", "diverged"))]
    low = rows["b_dtype"].isin(_LOW) & (rows["b_dtype"] != rows["dtype"])
    return sorted(set(rows.loc[low, "b_dtype"]))


def _unit(lows: list[str]) -> float:
    """The unit roundoff of the lowest of `lows` (dtype names below float32), float32's when
    there are none."""
    import torch

    return max((float(torch.finfo(getattr(torch, d)).eps) / 2 for d in lows),
               default=float(torch.finfo(torch.float32).eps) / 2)


def _err(row: dict) -> float:
    e = row["error"]
    return float(e) if e == e else 0.0


def _where(e: dict[str, Any]) -> str:
    return f"{e['op']} at {e['source'] or 'an unknown line'} ({e['name']})"
