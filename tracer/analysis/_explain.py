"""`tracer.explain`: is a divergence a bug or rounding, and which op introduced it.

`diff` names the first record where two runs part. Comparing bf16 with float32, a GPU with a CPU
or two torch versions, every record after the first rounding op differs, so that record alone
does not say whether anything is wrong. With op-level dumps that hold tensors and each call's
spec (/calls), every op on the divergence chain can be re-run (tracer.analysis._replay):

- received: how far the op's inputs in B are from A's (the error it inherited);
- introduced: B's call re-run on A's recorded inputs (cast to B's input dtypes) against A's
  recorded output: the error the op itself adds on identical inputs;
- entitled: the rounding the op may add, measured, not assumed: A's call re-run on A's inputs
  in B's dtypes against the same call in float64, plus A's own recorded output against float64
  (and, where two re-runs of B's call differ, that difference: a non-deterministic op).

An op whose introduced error exceeds `factor` times what it is entitled to (plus two units of
roundoff of its output dtype) changes the result on identical inputs: a bug there (a wrong
constant, a changed formula, an operand swapped). When every op stays within its rounding, the
difference is precision, and the ops that lose the most are named. A first divergence in the
data or the weights means the inputs differ from the start. A first divergence at an op's input
while every record before it agrees is judged by that input: A's value rounded to B's dtype is
precision (a cast only one run makes); one of A's other inputs of that call means operands
swapped; anything else, a bug at that call site.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from tracer._errors import TracerError
from tracer.analysis._compare import Tolerance
from tracer.analysis._diff import _jsonable, diff
from tracer.analysis._origin import call_stem
from tracer.analysis._replay import (CallSpec, NotReplayable, recorded, rel_error, replay,
                                     replay_device)
from tracer.storage import open_dump

Status = Literal["same", "bug", "precision", "inputs", "unexplained", "incomplete"]


@dataclass
class Explanation:
    """What `explain` found."""

    status: Status
    verdict: str
    """One sentence a user can act on."""
    blamed: dict[str, Any] | None = None
    """The chain entry of the op blamed as a bug."""
    chain: list[dict[str, Any]] = field(default_factory=list)
    """One entry per op call on the divergence chain, in execution order: name, b_name, op,
    module, phase, step, source, received, introduced, entitled, amplification, dtype,
    b_dtype, nondeterministic, device (where B ran the call), replayed_on (where it was re-run:
    that device when this process has it, else the CPU, which `why` then says), judged ("bug",
    "rounding", "not replayed"), why."""
    first_divergence: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """As `sleuth diff`: 0 same, 1 the runs differ, 2 not everything could be read."""
        return {"same": 0, "incomplete": 2}.get(self.status, 1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (non-finite errors as "inf" or None, as `DiffResult.to_dict` writes)."""
        return {"status": self.status, "exit_code": self.exit_code, "verdict": self.verdict,
                "blamed": _jsonable(self.blamed) if self.blamed else None,
                "chain": [_jsonable(e) for e in self.chain],
                "first_divergence": self.first_divergence, "notes": self.notes}


def explain(a: str | os.PathLike, b: str | os.PathLike, *, step: int | None = None,
            rank: int = 0, limit: int = 20, factor: float = 4.0,
            tolerance: Tolerance | None = None) -> Explanation:
    """Explain the first divergence between dumps A (the reference) and B (module doc).

    Both must be op-level dumps (level op or mix) in tensor or full mode, which keep each op's
    inputs and /calls. `limit`: op calls followed along the chain; `factor`: how many times
    its measured rounding an op's error on identical inputs may be before it is a bug.
    Raises TracerError (a DiffError) as `diff` does, or when the dumps cannot be replayed.
    """
    res = diff(a, b, step=step, rank=rank, tolerance=tolerance)
    fd = res.first_divergence
    notes = list(res.notes)
    if res.exit_code == 2:
        what = "; ".join(f"{p.side} {p.reason}" for p in res.problems[:3])
        return Explanation("incomplete", f"not everything could be read, so nothing is "
                           f"explained: {what}", first_divergence=fd, notes=notes)
    if fd is None:
        if res.status == "same":
            return Explanation("same", "the runs agree on every record compared", notes=notes)
        return Explanation("unexplained", "no record diverged, but the runs' steps or records "
                           "differ (see `sleuth diff`)", notes=notes)
    if fd["kind"] in ("data", "parameter"):
        what = "the model's input" if fd["kind"] == "data" else "the weights"
        return Explanation("inputs", f"inputs differ from the start: {what} already differ at "
                           f"{fd['name']} (data, seed or weights), before any op ran",
                           first_divergence=fd, notes=notes)
    if not fd["op"]:
        raise TracerError("sleuth explain re-runs ops: dump both runs at level op (or mix) "
                          "with mode tensor or full (the first divergence, "
                          f"{fd['name']}, is a module record)")
    da, db = open_dump(a), open_dump(b)
    try:
        sides = _Sides(da, db, fd)
        sides.factor = factor
        chain = [sides.entry(r, factor) for r in _chain(res.records, fd, limit)]
        lead = sides.judge_input(fd) if fd["direction"] == "input" else None
    finally:
        da.close()
        db.close()
    return _verdict(chain, lead, fd, notes)


def _chain(records: Any, fd: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """The op calls whose records diverged from the first divergence on, in execution order:
    one row (the first divergent record) per call, at most `limit`."""
    rows = records[(records["verdict"] == "diverged") & (records["op"] != "")
                   & (records["step"] == fd["step"])]
    rows = rows.sort_values("order", kind="stable")
    start = records.index[(records["name"] == fd["name"]) & (records["step"] == fd["step"])]
    if len(start):
        rows = rows[rows["order"] >= records.loc[start[0], "order"]]
    out, seen = [], set()
    for r in rows.to_dict("records"):
        stem = _stem(r["name"])
        if stem in seen:
            continue
        seen.add(stem)
        out.append(r)
        if len(out) >= limit:
            break
    return out


def _stem(name: str) -> str:
    """"m::aten.mm.forward.0.output.0" -> "m::aten.mm.forward.0": the call's records' stem."""
    return call_stem({"name": name})


class _Sides:
    """Both dumps at the divergence's rank and step: call specs and tensors, read as asked."""

    def __init__(self, da: Any, db: Any, fd: dict[str, Any]) -> None:
        self.da, self.db = da, db
        self.factor = 4.0
        self.ka, self.kb = (fd["rank"], fd["step"]), (fd["b_rank"], fd["b_step"])
        self.specs: dict[str, dict[str, str]] = {}
        for side, d, (r, s) in (("a", da, self.ka), ("b", db, self.kb)):
            calls = d.calls(r, s)
            self.specs[side] = dict(zip(calls["name"], calls["spec"]))
            if not self.specs[side]:
                raise TracerError(f"dump {'A' if side == 'a' else 'B'} holds no op calls for "
                                  f"rank {r} step {s} (/calls): re-running ops needs dumps at "
                                  'level op (or mix) with {"mode": "tensor"} (or "full"), made '
                                  "by this version of sleuth")

    def spec(self, side: str, stem: str) -> CallSpec:
        text = self.specs[side].get(stem)
        if text is None:
            raise NotReplayable(f"no /calls record for {stem} in {side.upper()}")
        return CallSpec.parse(text)

    def tensor(self, side: str, stem: str, direction: str, i: int) -> Any:
        d, (r, s) = (self.da, self.ka) if side == "a" else (self.db, self.kb)
        return recorded(d, r, s, f"{stem}.{direction}.{i}")

    def tensors(self, side: str, stem: str, direction: str, n: int) -> list[Any]:
        return [self.tensor(side, stem, direction, i) for i in range(n)]

    def outputs(self, side: str, stem: str, n: int) -> list[Any | None]:
        """The recorded outputs of a call, None where one has no record (a left-out one)."""
        out = []
        for i in range(n):
            try:
                out.append(self.tensor(side, stem, "output", i))
            except NotReplayable:
                out.append(None)
        return out

    def entry(self, row: dict[str, Any], factor: float) -> dict[str, Any]:
        stem_a, stem_b = _stem(row["name"]), _stem(row["b_name"] or row["name"])
        e: dict[str, Any] = {"name": stem_a, "b_name": stem_b, "op": row["op"],
                             "module": row["module"], "phase": row["phase"],
                             "step": row["step"], "source": row["source"],
                             "dtype": row["dtype"], "b_dtype": row["b_dtype"],
                             "received": None, "introduced": None, "entitled": None,
                             "amplification": None, "nondeterministic": False,
                             "judged": "not replayed", "why": ""}
        try:
            spec_a, spec_b = self.spec("a", stem_a), self.spec("b", stem_b)
            ins_a = self.tensors("a", stem_a, "input", spec_a.inputs)
            ins_b = self.tensors("b", stem_b, "input", spec_b.inputs)
            if len(ins_a) != len(ins_b):
                raise NotReplayable(f"the calls take {len(ins_a)} and {len(ins_b)} inputs")
            received = max((rel_error(x, y) for x, y in zip(ins_b, ins_a)), default=0.0)
            dtypes = [t.dtype for t in ins_b]
            e["b_dtypes"] = sorted({str(t).removeprefix("torch.") for t in dtypes
                                    if t.is_floating_point})
            rep_b = replay(spec_b, ins_a, dtypes)
            again = replay(spec_b, ins_a, dtypes)
            rep_lo = replay(spec_a, ins_a, dtypes)
            rep_64 = replay(spec_a, ins_a, float64=True)
            out_a = self.outputs("a", stem_a, len(rep_b))
            out_b = self.outputs("b", stem_b, len(rep_b))
        except NotReplayable as err:
            e["why"] = str(err)
            return e
        introduced = entitled = out_err = 0.0
        noise = 0.0
        unit = 0.0
        for j, (rb, ra) in enumerate(zip(rep_b, out_a)):
            if ra is None:
                continue
            introduced = max(introduced, rel_error(rb, ra))
            drift = rel_error(again[j], rb)
            noise = max(noise, drift)
            own = rel_error(ra, rep_64[j]) if j < len(rep_64) else 0.0
            low = rel_error(rep_lo[j], rep_64[j]) if j < min(len(rep_lo), len(rep_64)) else 0.0
            entitled = max(entitled, own + low + drift)
            if out_b[j] is not None:
                out_err = max(out_err, rel_error(out_b[j], ra))
            unit = max(unit, _roundoff(rb))
        e.update(received=received, introduced=introduced, entitled=entitled,
                 nondeterministic=noise > 0,
                 amplification=(out_err / received if received and math.isfinite(received)
                                and received > 0 else None))
        bound = factor * entitled + 2 * unit
        where = replay_device(spec_b)
        e.update(device=spec_b.device, replayed_on=where)
        moved = (f" (re-run on {where}: B ran on {spec_b.device}, whose kernels may round "
                 f"differently)" if where != spec_b.device else "")
        if math.isnan(introduced):
            e.update(judged="not replayed", why="the re-run's output has another shape")
        elif introduced > bound:
            e.update(judged="bug", why=f"on A's inputs B's call is off by {introduced:.3g} "
                     f"(relative); its rounding explains at most {entitled:.3g}{moved}")
        else:
            e.update(judged="rounding", why=f"on A's inputs B's call is off by {introduced:.3g}"
                     f", within its rounding ({entitled:.3g}){moved}")
        return e

    def judge_input(self, fd: dict[str, Any]) -> dict[str, Any] | None:
        """A first divergence at an op's input, every record before it the same: what that
        input is (see the module doc)."""
        stem_a, stem_b = _stem(fd["name"]), _stem(fd["b_name"] or fd["name"])
        index = int(fd["index"])
        try:
            spec_a = self.spec("a", stem_a)
            ins_a = self.tensors("a", stem_a, "input", spec_a.inputs)
            x_b = self.tensor("b", stem_b, "input", index)
        except NotReplayable as err:
            return {"judged": "not replayed", "why": str(err)}
        x_a = ins_a[index]
        if x_a.is_floating_point() and x_b.is_floating_point() and \
                tuple(x_a.shape) == tuple(x_b.shape):
            rounded = self._rounded(x_a, x_b, fd)
            if rounded is not None:
                return {"judged": "rounding", "why": f"B's input {index} is A's {rounded}"}
        for k, other in enumerate(ins_a):
            if k != index and tuple(other.shape) == tuple(x_b.shape) and \
                    rel_error(x_b, other.to(x_b.dtype)) == 0.0:
                return {"judged": "bug", "why": f"B passes A's input {k} as input {index}: "
                        "operands swapped"}
        return {"judged": "bug", "why": f"B's input {index} differs while every record before "
                "it agrees: the value passed at this call is not the one A passes"}


    def _rounded(self, x_a: Any, x_b: Any, fd: dict[str, Any]) -> str | None:
        """How B's value `x_b` is A's `x_a` rounded, or None: cast to B's dtype, or through a
        lower precision and back (a float16 island: casts only B makes, the records right
        before the divergence that have no partner), exactly or within that precision's
        rounding of the ops in between."""
        import torch

        if x_a.dtype != x_b.dtype and rel_error(x_b, x_a.to(x_b.dtype)) == 0.0:
            return f"rounded to {_name(x_b.dtype)} (a cast only B makes)"
        casts = [u for u in fd.get("unpaired_before") or [] if u["side"] == "B"]
        lows = self._cast_dtypes(casts) or [torch.float16, torch.bfloat16]
        made = ", ".join(dict.fromkeys(f"{u['op']} at {u['source'] or '?'}" for u in casts))
        by = f" by ops only B runs ({made})" if made else ""
        for low in lows:
            if rel_error(x_b, x_a.to(low).to(x_b.dtype)) == 0.0:
                return f"rounded through {_name(low)} and back{by}"
        if casts:
            low = max(lows, key=lambda d: torch.finfo(d).eps)
            err = rel_error(x_b, x_a)
            if err <= self.factor * float(torch.finfo(low).eps):
                return (f"within {_name(low)} rounding of it (relative error {err:.3g}), "
                        f"computed{by}")
        return None

    def _cast_dtypes(self, casts: list[dict[str, Any]]) -> list[Any]:
        """The floating dtypes below float32 that B's unpaired calls name (their specs)."""
        import torch

        out = []
        for u in casts:
            text = self.specs["b"].get(_stem(u["name"]), "")
            for name in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"):
                dtype = getattr(torch, name, None)
                if f'"dtype":"{name}"' in text and dtype is not None and dtype not in out:
                    out.append(dtype)
        return out


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _roundoff(t: Any) -> float:
    """The unit roundoff of a tensor's dtype (0 for integers and booleans)."""
    import torch

    if not t.is_floating_point():
        return 0.0
    return float(torch.finfo(t.dtype).eps) / 2


def _verdict(chain: list[dict[str, Any]], lead: dict[str, Any] | None,
             fd: dict[str, Any], notes: list[str]) -> Explanation:
    def where(e: dict[str, Any]) -> str:
        return f"{e['op']} at {e['source'] or 'an unknown line'} ({e['name']})"

    if lead is not None and lead["judged"] == "bug":
        blamed = {"name": _stem(fd["name"]), "b_name": _stem(fd["b_name"] or fd["name"]),
                  "op": fd["op"], "module": fd["module"], "source": fd["source"],
                  "phase": fd["phase"], "step": fd["step"], "judged": "bug",
                  "why": lead["why"]}
        return Explanation("bug", f"bug: op {where(blamed)} receives a different input on "
                           f"otherwise identical records: {lead['why']}", blamed, chain, fd,
                           notes)
    bug = next((e for e in chain if e["judged"] == "bug"), None)
    if bug is not None:
        return Explanation("bug", f"bug: op {where(bug)} changes the result on identical "
                           f"inputs: {bug['why']}", bug, chain, fd, notes)
    replayed = [e for e in chain if e["judged"] == "rounding"]
    if not replayed:
        why = "; ".join(f"{e['name']}: {e['why']}" for e in chain[:3]) or "no op to re-run"
        return Explanation("unexplained", f"no op on the chain could be re-run: {why}",
                           None, chain, fd, notes)
    skipped = [e for e in chain if e["judged"] == "not replayed"]
    if lead is None and chain[0]["judged"] == "not replayed":
        # where the runs first part is where an error would be made: not judged, not known
        first = chain[0]
        return Explanation("unexplained", f"the op where the runs first part, {where(first)}, "
                           f"could not be re-run ({first['why']}); the ops after it stay within "
                           "their rounding, so whether it made the difference is not known",
                           None, chain, fd, notes)
    worst = [e for e in sorted(replayed, key=lambda e: -(e["introduced"] or 0.0))[:3]
             if e["introduced"]]
    dtypes = sorted({d for e in worst for d in e.get("b_dtypes") or [e["b_dtype"]] if d})
    lose = ("those that lose the most on identical inputs: "
            + ", ".join(f"{e['op']} ({e['name']}, {e['introduced']:.3g})" for e in worst)
            + f" (B computes in {', '.join(dtypes) or '?'})") if worst else \
        "none of them adds error on identical inputs"
    mixed = next((n for n in notes if "differ in dtype" in n), "")
    cast = (f". B's precision first differs at {mixed.split(', the first at ', 1)[1]}"
            if ", the first at " in mixed else "")
    if lead is not None and lead["judged"] == "rounding":
        start = (f"precision: it starts at {fd['op']} ({_stem(fd['name'])}, "
                 f"{fd['source'] or 'unknown line'}), whose {lead['why']}; every op re-run "
                 "after it on the chain stays within its own rounding")
    else:
        start = ("precision: the difference comes from rounding; every op re-run on the chain "
                 "stays within what its dtype accounts for")
    unjudged = (f"; {len(skipped)} op(s) on the chain could not be re-run and are not judged: "
                + ", ".join(f"{e['op']} ({e['why']})" for e in skipped[:3])) if skipped else ""
    return Explanation("precision", f"{start}, {lose}{unjudged}{cast}", None, chain, fd,
                       notes)
