"""Where the first differing value of two runs came from: the first divergence judged by its
value, before the ops after it are re-run (tracer.analysis._explain).

Values are followed by their statistics, as the first-NaN search follows them
(tracer.analysis._origin): a record with the dtype, element count, NaN/Inf counts, checksum,
minimum and maximum of an earlier op's output holds that output. The first divergent record's
value in each run is then made by

- ops the other run does not run (records without a partner): an op **added** (only B runs
  it), **removed** (only A does) or **replaced** (both make the value with ops the other
  lacks). Those ops are re-run on their recorded inputs in float64, which measures the rounding
  they may add; B's value further from A's than `factor` times that is a bug there, named with
  the op's line, and within it another way of computing the same thing (precision). Ops that
  pass a value on unchanged (a detach, a view) make nothing and are not named;
- no recorded op in either run: the value came from outside the recorded calls (token ids, a
  batch, a buffer or weight set before the step), so the **inputs differ**; unless a dump's
  filters leave calls out, when one of those may have made it and nothing is concluded;
- recorded ops of both runs, A's value not being B's at this call: the call is passed another
  value. **Operands swapped** when B's inputs of the call are exactly A's in another order; an
  **argument lost or replaced** when B passes one of A's inputs in place of another; else
  another value, with what made each. A module record holding another value while no op
  differs is a module that passes on another value (a block that returns its input).

A value that is A's rounded to B's dtype (or through float16/bfloat16 and back by casts only B
makes) is rounding, whatever made it. A module record as first divergence (a mix dump) is judged
by its value the same way, then by the unpaired op records inside that module's call; when
neither settles it, `descend`: the judgement goes on at the first op record that differs after
it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from tracer.analysis._explain_sides import Sides, roundoff, stem
from tracer.analysis._explain_kernel import fused_change, fused_words
from tracer.analysis._explain_step import CASTS, Step, region_op
from tracer.analysis._origin import _in_place, call_stem
from tracer.analysis._replay import NotReplayable, rel_error

_OUTSIDE = "the batch, token ids, a buffer or a weight set before the step"


@dataclass
class Finding:
    """What the first divergence's value says."""

    judged: str
    """"rounding", "inputs", "bug", "unknown" (not settled: ops differ whose rounding could
    not be measured, or a value the dumps' filters may have hidden) or "descend" (a module
    record its value does not settle: judge the first op record that differs after it)."""
    why: str
    blamed: dict[str, Any] | None = None


class Lead:
    """The first divergence judged by its value (module doc)."""

    def __init__(self, step: Step, sides: Sides, factor: float = 4.0, inputs: str = "",
                 buffers: tuple[dict, dict] = ({}, {}),
                 kernels: tuple[dict, dict] = ({}, {})) -> None:
        """`inputs`: which of the batch and the buffers differ as the step began, in words
        (tracer.analysis._setup.inputs_words), where the runs' setups say; `buffers`: each
        run's buffers' fingerprints as the step began (its setup), which name a buffer an
        in-place op writes; `kernels`: what each run's Inductor kernels fused (its setup,
        tracer.analysis._explain_kernel.kernels_of)."""
        self.step, self.sides, self.factor = step, sides, factor
        self.inputs = inputs
        self.buffers = {"a": buffers[0] or {}, "b": buffers[1] or {}}
        self.kernels = {"a": kernels[0] or {}, "b": kernels[1] or {}}

    def judge(self, fd: dict[str, Any]) -> Finding | None:
        """What `fd`'s value says, or None for an op's output whose inputs pair (the re-run
        of its call says more)."""
        # a compiled region's record is judged as a module's: its value was made by the
        # ops run inside it (recorded in interpret mode), and a region's call is never re-run
        op = bool(fd["op"]) and not region_op(fd["op"])
        if op and fd["direction"] != "input":
            fd = self._unpaired_input(fd)
            if fd is None:
                return None
        ra = self.step.get("a", fd["name"])
        rb = self.step.get("b", fd["b_name"] or fd["name"])
        if ra is None or rb is None:
            return None
        gone, new = self.step.made_by("a", ra), self.step.made_by("b", rb)
        # casts only B makes that made this value (autocast's promotion of a lower-precision
        # operand, as `torch.cat` of a bfloat16 and a float32 tensor does)
        rounded = self._rounded(fd, [r for r in new if r["op"] in CASTS] if new and all(
            r["op"] in CASTS for r in new) and not gone else [])
        if rounded is not None:
            return Finding("rounding", f"{self._value(fd)} is A's {rounded}")
        if not gone and not new and not op:
            gone, new = self.step.inside("a", ra), self.step.inside("b", rb)
        if not gone and not new:
            gone, new = self.step.written("a", ra), self.step.written("b", rb)
        if gone or new:
            return self._changed(fd, gone, new)
        pa, pb = self.step.maker("a", ra), self.step.maker("b", rb)
        if pa is None and pb is None:
            made = f"{self._record(fd)} differs, and no recorded op made it in either run"
            region = self.step.region("b", rb) or self.step.region("a", ra)
            if region is not None:
                stem = call_stem(region)
                return Finding("unknown", f"{made}: it was made inside the compiled region "
                               f"{stem} (at {region['source'] or 'an unknown line'}), whose "
                               "fused kernels the dump does not record one by one; dump both "
                               "runs with \"compiled\": \"interpret\" to name the op inside "
                               "it (docs/frameworks.md, \"torch.compile\")")
            if self.step.filters:
                return Finding("unknown", f"{made}; the dumps leave calls out ("
                               f"{'; '.join(self.step.filters)}), so one of those may have "
                               "made it: dump both runs without those filters to tell a bug "
                               "from inputs that differ")
            outside = _OUTSIDE
            if self.inputs:
                outside = self.inputs + (": a weight set before the step, or a value made "
                                         "outside the recorded calls" if "differ" not in
                                         self.inputs else "")
            return Finding("inputs", f"{made}: it comes from outside the recorded calls "
                           f"({outside})")
        if op:
            return self._call_site(fd, pa, pb)
        if pa is not None and pb is not None:
            why = (f"module {fd['module']} passes on another value: its {self._record(fd)} "
                   f"is, in B, {self._made('b', pb)}, and in A {self._made('a', pa)}")
            return Finding("bug", why, self._blamed(fd, "passed", why))
        return Finding("descend", f"the first divergence, {fd['name']}, is a module record "
                       f"whose value {'A' if pa is None else 'B'}'s recorded ops did not make")

    def _unpaired_input(self, fd: dict[str, Any]) -> dict[str, Any] | None:
        """For an op output that diverges first: the call's first input that has no partner
        in the other run, as a divergence of its own to judge (operands of different shapes
        swapped pair with nothing), or None when every input pairs."""
        call_a, call_b = stem(fd["name"]), stem(fd["b_name"] or fd["name"])
        ins_b = {int(r["index"]): r for r in self.step.calls["b"].get(call_b, ())
                 if r["direction"] == "input"}
        for ra in self.step.calls["a"].get(call_a, ()):
            rb = ins_b.get(int(ra["index"]))
            if ra["direction"] != "input" or rb is None or not (
                    self.step.unpaired("a", ra) or self.step.unpaired("b", rb)):
                continue
            return {**fd, "name": str(ra["name"]), "b_name": str(rb["name"]),
                    "direction": "input", "index": int(ra["index"]),
                    "source": rb["source"] or fd["source"]}
        return None

    def _value(self, fd: dict[str, Any]) -> str:
        return f"B's input {int(fd['index'])}" if _at_input(fd) else "B's value"

    def _record(self, fd: dict[str, Any]) -> str:
        b_name = fd["b_name"] or fd["name"]
        where = self.step.source("b", b_name) or fd["source"] or "an unknown line"
        if _at_input(fd):
            return f"input {int(fd['index'])} of {fd['op']} ({stem(b_name)}, at {where})"
        return f"{fd['direction']} record {b_name} (at {where})"

    def _blamed(self, fd: dict[str, Any], fault: str, why: str) -> dict[str, Any]:
        b_name = fd["b_name"] or fd["name"]
        return {"name": stem(fd["name"]), "b_name": stem(b_name), "op": fd["op"],
                "module": fd["module"], "source": self.step.source("b", b_name) or fd["source"],
                "a_source": fd["source"], "phase": fd["phase"], "step": fd["step"],
                "judged": "bug", "fault": fault, "why": why}

    def _made(self, side: str, rec: dict | None) -> str:
        if rec is None:
            return "a value no recorded op made"
        return f"the output of {rec['op']} at {rec['source'] or 'an unknown line'} " \
               f"({call_stem(rec)})"

    # -- a value passed at the call -------------------------------------------------------------
    def _call_site(self, fd: dict[str, Any], pa: dict | None, pb: dict | None) -> Finding:
        call_a, call_b = stem(fd["name"]), stem(fd["b_name"] or fd["name"])
        index = int(fd["index"])
        origins = f"B passes {self._made('b', pb)}, A {self._made('a', pa)}"
        try:
            spec_a, spec_b = self.sides.spec("a", call_a), self.sides.spec("b", call_b)
            ins_a = self.sides.tensors("a", call_a, "input", spec_a.inputs)
            ins_b = self.sides.tensors("b", call_b, "input", spec_b.inputs)
        except NotReplayable:
            why = f"B's input {index} is not the value A passes: {origins}"
            return Finding("bug", why, self._blamed(fd, "passed", why))
        match = [[k for k, x in enumerate(ins_a) if _equal(y, x)] for y in ins_b]
        order = _permutation(match) if len(ins_a) == len(ins_b) else None
        if order is not None and order != list(range(len(order))):
            moved = ", ".join(f"A's input {k} as input {j}" for j, k in enumerate(order)
                              if j != k)
            why = f"B passes {moved}: operands swapped"
            return Finding("bug", why, self._blamed(fd, "swapped", why))
        others = [k for k in match[index] if k != index]
        if others:
            k = others[0]
            twice = " (so B passes it twice)" if any(k in m for j, m in enumerate(match)
                                                    if j != index) else ""
            why = (f"B passes A's input {k} as input {index}{twice}, and A's input {index} "
                   f"({self._made('a', pa)}) not at all: an argument lost or replaced")
            return Finding("bug", why, self._blamed(fd, "argument", why))
        why = (f"B's input {index} is none of A's inputs of this call: {origins}; the value "
               "passed at this call is not the one A passes")
        blamed = self._blamed(fd, "passed", why)
        # which op made each run's value: the same op at the same module and line on both
        # sides is one call seen twice, which only exact values tell apart
        blamed["makers"] = {side: [rec["op"], rec["module"], rec["source"]]
                            for side, rec in (("a", pa), ("b", pb)) if rec is not None}
        return Finding("bug", why, blamed)

    # -- ops only one run runs ------------------------------------------------------------------
    def _changed(self, fd: dict[str, Any], gone: list[dict], new: list[dict]) -> Finding:
        fault = "replaced" if gone and new else ("removed" if gone else "added")

        def ops(recs: list[dict]) -> str:
            if len(recs) <= 3:
                return ", ".join(f"{r['op']} at {r['source'] or 'an unknown line'}"
                                 f"{_called_from(r)} ({call_stem(r)})" for r in recs)
            names = ", ".join(dict.fromkeys(str(r["op"]) for r in recs))
            lines = ", ".join(dict.fromkeys(str(r["source"] or "?") for r in recs))
            return f"{len(recs)} ops ({names}) at {lines}, from {call_stem(recs[0])} on"

        what = {"removed": f"op removed: A runs {ops(gone)} and B does not",
                "added": f"op added: B runs {ops(new)} and A does not",
                "replaced": f"ops replaced: A runs {ops(gone)}, B runs {ops(new)} in their "
                            "place"}[fault]
        cut = self._cut(gone, new)
        if cut is not None:
            # a backward one run lacks: where that run's forward cut the graph (a detach
            # only it makes), which is where to look, not the backward call's line
            what += (f"; B cuts the graph in its forward there: {cut['op']} at "
                     f"{cut['source'] or 'an unknown line'} ({call_stem(cut)}), which only B "
                     f"runs, leaves what comes before it without gradients")
        first = new[0] if new else gone[0]
        blamed = {"name": call_stem(first), "b_name": call_stem(first) if new else "",
                  "op": first["op"], "module": first["module"], "source": first["source"],
                  "caller": first.get("caller") or "",
                  "phase": first["phase"], "step": fd["step"], "judged": "bug",
                  "fault": fault, "side": "B" if new else "A",
                  "removed": [call_stem(r) for r in gone], "added": [call_stem(r) for r in new]}
        where = self._record(fd)
        fused = fused_change(gone, new, self.kernels["a"], self.kernels["b"])
        if fused is not None:
            return self._fused(fd, what, blamed, *fused)
        try:
            x_a = self.sides.record("a", fd["name"])
            x_b = self.sides.record("b", fd["b_name"] or fd["name"])
            err = rel_error(x_b, x_a)
            entitled = sum(self.sides.own_rounding(side, call_stem(r))
                           for side, recs in (("a", gone), ("b", new)) for r in recs)
        except NotReplayable as e:
            cause = ("the dumps hold no tensors (mode statistics): dump both runs with mode "
                     "tensor or full to measure it" if "statistics" in self.step.modes
                     else str(e))
            why = (f"{what}; that is where the runs part ({where} differs), but the rounding of "
                   f"those ops could not be measured ({cause}), so whether it is a bug is not "
                   "known")
            return Finding("unknown", why, blamed)
        if err <= self.factor * entitled + 2 * roundoff(x_b):
            return Finding("rounding", f"B makes {where} with other ops than A ({what}), "
                           f"within their rounding: off by {err:.3g}, their rounding "
                           f"{entitled:.3g}")
        how = (f"differs by {err:.3g} (relative), more than the rounding of the ops that "
               f"differ ({entitled:.3g})" if err == err else
               f"holds another shape ({list(getattr(x_a, 'shape', []))} in A, "
               f"{list(getattr(x_b, 'shape', []))} in B)")
        written = self._writes(fd, gone, new)
        if written is not None:
            # ops one run alone runs that only write a tensor in place: a write, named with
            # what it writes (a buffer, by its fingerprint as the step began)
            side, target = written
            what = (f"written in place: {'B' if side == 'b' else 'A'} runs {ops(new or gone)} "
                    f"and {'A' if side == 'b' else 'B'} does not, writing {target} during step "
                    f"{fd['step']}")
            adds = all(r["op"] == "aten.add_" and r["phase"] == "backward" for r in new or gone)
            if adds and side == "a":
                # autograd adds a backward's gradient into one already there (an earlier
                # micro-batch's), and sets it where there is none: B's was cleared
                what += (" (A adds this backward's gradient into the one an earlier backward "
                         "left, as accumulating micro-batches does, and B sets it afresh: B "
                         "clears gradients between backward passes where A does not, a "
                         "zero_grad or gradients set to None between micro-batches)")
            elif adds and target.startswith("the gradient of "):
                # the backward adds into a gradient it would otherwise set: the one left from
                # the step before, which no zero_grad cleared
                what += (f" (its backward adds to the gradient left from the step before: "
                         f"{'B' if side == 'b' else 'A'} does not clear gradients between "
                         f"steps, a zero_grad missing, or accumulates on purpose)")
            blamed.update(fault="written", written_by="B" if side == "b" else "A",
                          **({"buffer": target.removeprefix("buffer ").split(" or ")[0]}
                             if target.startswith("buffer ") else {}))
        why = f"{what}; {where} {how}{self._skipped(gone, x_b)}"
        blamed["why"] = why
        return Finding("bug", why, blamed)

    def _fused(self, fd: dict[str, Any], what: str, blamed: dict[str, Any],
               added: list[list[str]], removed: list[list[str]]) -> Finding:
        """Inductor's kernels that replace each other: the graph nodes one run's kernels fuse
        and the other's do not are the graphs' difference, named at the first such node;
        where they fuse the same nodes, the runs' Inductor split the same ops otherwise (no
        kernel call is re-run, so its rounding is not measured)."""
        where = self._record(fd)
        if not added and not removed:
            return Finding("unknown", f"{what}; they fuse the same graph nodes, split into "
                           f"kernels otherwise (another torch, Inductor config or machine): "
                           f"that is where the runs part ({where} differs), and a kernel's "
                           "call is not re-run to measure its rounding", blamed)
        node = added[0] if added else removed[0]
        side, other = ("B", "A") if added else ("A", "B")
        why = (f"{what}; {side}'s kernels fuse {fused_words(added or removed)}, which "
               f"{other}'s do not: the compiled graphs differ there ({where} differs)")
        blamed.update(op=node[0], module=node[1], source=node[2], side=side,
                      fault="added" if added else "removed", why=why)
        return Finding("bug", why, blamed)

    def _cut(self, gone: list[dict], new: list[dict]) -> dict | None:
        """Where the ops only A runs are all backward ops and B's forward detaches more often
        than A's: B's extra `aten.detach`, or None."""
        if new or not gone or any(r["phase"] != "backward" for r in gone):
            return None

        def detaches(side: str) -> list[dict]:
            return [r for r in self.step.rows[side] if r["op"] == "aten.detach"
                    and r["phase"] == "forward" and r["direction"] == "output"]

        mine = detaches("b")
        if len(mine) <= len(detaches("a")):
            return None
        # autograd detaches what an op saves for its backward (tanh's output), alike in both
        # runs and of the same value as the user's detach, so the pairing of the two is
        # arbitrary: the user's is the one at a line where A detaches nothing
        lines = {r["source"] for r in detaches("a")}
        return next((r for r in mine if r["source"] not in lines),
                    next((r for r in mine if self.step.unpaired("b", r)), None))

    def _writes(self, fd: dict[str, Any], gone: list[dict], new: list[dict]
                ) -> tuple[str, str] | None:
        """(side, what it writes) when the ops only one run runs are all in-place writes
        ("buffer NAME" where the tensor before the first write is a buffer as the step began,
        by its fingerprint; a gradient or weight where first divergence `fd` is the
        optimizer's record of one; else "a tensor the step reads"), or None."""
        if bool(gone) == bool(new):
            return None
        side, recs = ("b", new) if new else ("a", gone)
        if not all(_in_place(str(r["op"])) for r in recs):
            return None
        from tracer.capture import fingerprint

        param = str(fd["name"]).rpartition(".optimizer.")[0]
        other = {"grad": f"the gradient of {param}", "param": f"weight {param}"}.get(
            str(fd.get("direction")), "a tensor the step reads") \
            if fd["phase"] == "optimizer" and param else "a tensor the step reads"
        try:
            before = fingerprint(self.sides.tensor(side, call_stem(recs[0]), "input", 0))
        except NotReplayable:
            return side, other
        names = [n for n, f in self.buffers[side].items() if list(f) == before]
        if len(names) > 1:  # buffers alike as the step began (a copy kept of another)
            return side, (f"buffer {' or '.join(names[:3])} (alike as the step began)")
        return side, (f"buffer {names[0]}" if names else other)

    def _skipped(self, gone: list[dict], x_b: Any) -> str:
        """"; B's value there is aten.mul's input 1 unchanged: B skips the op" when B's value
        is an input of the first op only A runs; else ""."""
        if not gone:
            return ""
        call = call_stem(gone[0])
        try:
            ins = self.sides.tensors("a", call, "input", self.sides.spec("a", call).inputs)
        except NotReplayable:
            return ""
        k = next((k for k, x in enumerate(ins) if _equal(x_b, x)), None)
        return "" if k is None else \
            f"; B's value there is {gone[0]['op']}'s input {k} unchanged: B skips the op"

    # -- rounding -------------------------------------------------------------------------------
    def _rounded(self, fd: dict[str, Any], made: list[dict] = ()) -> str | None:
        """How B's value is A's rounded, or None: cast to B's dtype, or through a lower
        precision and back (a float16 island: casts only B makes, the records right before
        the divergence that have no partner, or `made`, the casts only B makes that made the
        value), exactly or within that precision's rounding of the ops in between."""
        import torch

        try:
            x_a = self.sides.record("a", fd["name"])
            x_b = self.sides.record("b", fd["b_name"] or fd["name"])
        except NotReplayable:
            return None
        if not (x_a.is_floating_point() and x_b.is_floating_point()
                and tuple(x_a.shape) == tuple(x_b.shape)):
            return None
        if x_a.dtype != x_b.dtype and rel_error(x_b, x_a.to(x_b.dtype)) == 0.0:
            return f"rounded to {_name(x_b.dtype)} (a cast only B makes)"
        casts = [u for u in fd.get("unpaired_before") or [] if u["side"] == "B"]
        seen = {stem(str(u["name"])) for u in casts}
        casts += [{"name": str(r["name"]), "op": r["op"], "source": r["source"], "side": "B"}
                  for r in made if stem(str(r["name"])) not in seen]
        named = self._cast_dtypes(casts)
        lows = named or [torch.float16, torch.bfloat16]
        made = ", ".join(dict.fromkeys(f"{u['op']} at {u['source'] or '?'}" for u in casts))
        by = f" by ops only B runs ({made})" if made else ""
        for low in lows:
            if rel_error(x_b, x_a.to(low).to(x_b.dtype)) == 0.0:
                return f"rounded through {_name(low)} and back{by}"
        if named:
            # only where B's own calls name a lower dtype: an extra op that scales by 1% in a
            # float32 run is within bfloat16's rounding too, and is no rounding at all
            low = max(lows, key=lambda d: torch.finfo(d).eps)
            err = rel_error(x_b, x_a)
            if err <= self.factor * float(torch.finfo(low).eps):
                return (f"within {_name(low)} rounding of it (relative error {err:.3g}), "
                        f"computed{by}")
        return None

    def _cast_dtypes(self, casts: list[dict[str, Any]]) -> list[Any]:
        """The floating dtypes below float32 that B's unpaired calls name (their specs) or
        take as input (a cast back up, `.float()` on what autocast made in bfloat16)."""
        import torch

        out = []
        for u in casts:
            text = self.sides.specs["b"].get(stem(u["name"]), "")
            inputs = {str(r["dtype"]) for r in self.step.calls["b"].get(stem(u["name"]), ())
                      if r["direction"] == "input"}
            for name in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"):
                dtype = getattr(torch, name, None)
                if dtype is not None and dtype not in out and (
                        f'"dtype":"{name}"' in text or name in inputs):
                    out.append(dtype)
        return out


def _called_from(rec: dict) -> str:
    """", called from train.py:40" for a record made inside an installed library (its source
    is the library's line; `caller` the user's line that led there), else ""."""
    caller = rec.get("caller") or ""
    return f", called from {caller}" if caller else ""


def _at_input(fd: dict[str, Any]) -> bool:
    """Whether `fd` is an op call's input (a module's or a compiled region's record is not)."""
    return bool(fd["op"]) and fd["direction"] == "input" and not region_op(fd["op"])


def _equal(x: Any, y: Any) -> bool:
    """The same values (B's tensor `x` against A's `y`, in `x`'s dtype)."""
    return tuple(x.shape) == tuple(y.shape) and rel_error(x, y.to(x.dtype)) == 0.0


def _permutation(match: list[list[int]]) -> list[int] | None:
    """An order of A's inputs that gives B's (`match[j]`: the A inputs equal to B's input
    j), the identity when it is one; None when there is none."""
    n = len(match)
    if all(j in m for j, m in enumerate(match)):
        return list(range(n))
    if any(not m for m in match) or n > 8:  # a long list of inputs is not searched
        return None
    return next((list(o) for o in itertools.product(*match) if len(set(o)) == n), None)


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
