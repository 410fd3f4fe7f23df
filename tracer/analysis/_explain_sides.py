"""Both dumps of an `explain` at the divergence's rank and step: each op call's spec and
tensors, read as asked, and one call of the divergence chain re-run (tracer.analysis._explain
says what received, introduced and entitled mean).

The two runs' calls are matched argument by argument, not by input index: a call that lost an
argument (a layer norm without its bias, an add without its second tensor) has fewer tensor
inputs in B, and B's call is re-run on A's tensors where both pass one, on B's own where only B
does. How the two calls' arguments differ (`arg_changes`) is part of the reason given for a bug.
"""
from __future__ import annotations

import json
import math
from typing import Any

from tracer._errors import TracerError
from tracer.analysis._origin import call_stem
from tracer.analysis._replay import (CallSpec, NotReplayable, overload, recorded, rel_error,
                                     replay, replay_device)


def stem(name: str) -> str:
    """"m::aten.mm.forward.0.output.0" -> "m::aten.mm.forward.0": the call's records' stem."""
    return call_stem({"name": name})


def roundoff(t: Any) -> float:
    """The unit roundoff of a tensor's dtype (0 for integers and booleans)."""
    import torch

    if not t.is_floating_point():
        return 0.0
    return float(torch.finfo(t.dtype).eps) / 2


class Sides:
    """Both dumps at one rank and step each: call specs and tensors, read as asked."""

    def __init__(self, da: Any, db: Any, fd: dict[str, Any], factor: float = 4.0) -> None:
        self.da, self.db = da, db
        self.factor = factor
        self.ka, self.kb = (fd["rank"], fd["step"]), (fd["b_rank"], fd["b_step"])
        self.specs: dict[str, dict[str, str]] = {}
        for side, d, (r, s) in (("a", da, self.ka), ("b", db, self.kb)):
            calls = d.calls(r, s)
            self.specs[side] = dict(zip(calls["name"], calls["spec"]))

    def require_calls(self) -> None:
        """TracerError, saying what each dump is, when one holds no op calls to re-run."""
        for side, d, (r, s) in (("a", self.da, self.ka), ("b", self.db, self.kb)):
            if self.specs[side]:
                continue
            attrs = d.attrs(r, s)
            level, mode = attrs.get("level", "?"), attrs.get("mode", "?")
            fix = ('dump both runs again with {"mode": "tensor"} (or "full")'
                   if mode == "statistics" else "dump it again with this version of sleuth")
            raise TracerError(f"this divergence is judged by re-running its ops (the records "
                              f"alone cannot tell B's rounding from a bug there), and dump "
                              f"{side.upper()} (level {level}, mode {mode}) holds no op calls "
                              f"for rank {r} step {s} (/calls) to re-run: {fix}")

    def spec(self, side: str, call: str) -> CallSpec:
        text = self.specs[side].get(call)
        if text is None:
            raise NotReplayable(f"no /calls record for {call} in {side.upper()}")
        return CallSpec.parse(text)

    def tensor(self, side: str, call: str, direction: str, i: int) -> Any:
        return self.record(side, f"{call}.{direction}.{i}")

    def record(self, side: str, name: str) -> Any:
        """Record `name`'s tensor on one side; NotReplayable when it holds no bytes."""
        d, (r, s) = (self.da, self.ka) if side == "a" else (self.db, self.kb)
        return recorded(d, r, s, name)

    def tensors(self, side: str, call: str, direction: str, n: int) -> list[Any]:
        return [self.tensor(side, call, direction, i) for i in range(n)]

    def outputs(self, side: str, call: str, n: int) -> list[Any | None]:
        """The recorded outputs of a call, None where one has no record (a left-out one)."""
        out = []
        for i in range(n):
            try:
                out.append(self.tensor(side, call, "output", i))
            except NotReplayable:
                out.append(None)
        return out

    def own_rounding(self, side: str, call: str) -> float:
        """How far one call's recorded outputs are from the same call in float64 on its
        recorded inputs: the rounding it added. NotReplayable when it cannot be re-run."""
        spec = self.spec(side, call)
        ins = self.tensors(side, call, "input", spec.inputs)
        exact = replay(spec, ins, float64=True)
        err = 0.0
        for out, ref in zip(self.outputs(side, call, len(exact)), exact):
            if out is not None and out.is_floating_point():
                err = max(err, rel_error(out, ref))
        return err

    def entry(self, row: dict[str, Any], b_source: str) -> dict[str, Any]:
        """One chain entry: the call of diff row `row` re-run (module doc of _explain)."""
        stem_a, stem_b = stem(row["name"]), stem(row["b_name"] or row["name"])
        e: dict[str, Any] = {"name": stem_a, "b_name": stem_b, "op": row["op"],
                             "module": row["module"], "phase": row["phase"],
                             "step": row["step"], "source": b_source or row["source"],
                             "a_source": row["source"],
                             "dtype": row["dtype"], "b_dtype": row["b_dtype"],
                             "received": None, "introduced": None, "entitled": None,
                             "amplification": None, "nondeterministic": False,
                             "judged": "not replayed", "why": "", "changes": []}
        try:
            spec_a, spec_b = self.spec("a", stem_a), self.spec("b", stem_b)
            e["changes"] = arg_changes(spec_a, spec_b)
            ins_a = self.tensors("a", stem_a, "input", spec_a.inputs)
            ins_b = self.tensors("b", stem_b, "input", spec_b.inputs)
            on_a, shared = _on_a(spec_a, spec_b, ins_a, ins_b)
            received = max((rel_error(ins_b[j], ins_a[k]) for j, k in shared), default=0.0)
            dtypes = [t.dtype for t in ins_b]
            e["b_dtypes"] = sorted({str(t).removeprefix("torch.") for t in dtypes
                                    if t.is_floating_point})
            rep_b = replay(spec_b, on_a, dtypes)
            again = replay(spec_b, on_a, dtypes)
            in_b = {k: dtypes[j] for j, k in shared}  # A's inputs in B's dtypes
            rep_lo = replay(spec_a, ins_a, [in_b.get(k, t.dtype) for k, t in enumerate(ins_a)])
            rep_64 = replay(spec_a, ins_a, float64=True)
            out_a = self.outputs("a", stem_a, len(rep_b))
            out_b = self.outputs("b", stem_b, len(rep_b))
        except NotReplayable as err:
            e["why"] = str(err)
            return e
        introduced = entitled = out_err = noise = unit = 0.0
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
            unit = max(unit, roundoff(rb))
        e.update(received=received, introduced=introduced, entitled=entitled,
                 nondeterministic=noise > 0,
                 amplification=(out_err / received if received and math.isfinite(received)
                                and received > 0 else None))
        bound = self.factor * entitled + 2 * unit
        where = replay_device(spec_b)
        e.update(device=spec_b.device, replayed_on=where)
        moved = (f" (re-run on {where}: B ran on {spec_b.device}, whose kernels may round "
                 f"differently)" if where != spec_b.device else "")
        on = "A's inputs" if len(shared) == len(ins_b) else \
            "A's inputs (B's own where only B passes a tensor)"
        if math.isnan(introduced):
            e.update(judged="not replayed", why="the re-run's output has another shape")
        elif introduced > bound:
            e.update(judged="bug", why=f"on {on} B's call is off by {introduced:.3g} "
                     f"(relative); its rounding explains at most {entitled:.3g}{moved}")
        else:
            e.update(judged="rounding", why=f"on {on} B's call is off by {introduced:.3g}"
                     f", within its rounding ({entitled:.3g}){moved}")
        return e


def _slots(spec: CallSpec) -> dict[tuple, int]:
    """Where each tensor input sits among a call's arguments: (position path) -> input index."""
    out: dict[tuple, int] = {}

    def walk(v: Any, path: tuple) -> None:
        if isinstance(v, dict) and "input" in v:
            out[path] = int(v["input"])
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, (*path, i))

    for i, v in enumerate(spec.args):
        walk(v, (i,))
    for k, v in spec.kwargs.items():
        walk(v, (k,))
    return out


def _on_a(spec_a: CallSpec, spec_b: CallSpec, ins_a: list[Any], ins_b: list[Any]
          ) -> tuple[list[Any], list[tuple[int, int]]]:
    """B's inputs with A's tensor put wherever A passes one at the same argument (B's own
    where only B passes a tensor), and the (B input, A input) pairs so matched."""
    slots_a = _slots(spec_a)
    out, shared = list(ins_b), []
    for path, j in _slots(spec_b).items():
        k = slots_a.get(path)
        if k is not None and k < len(ins_a):
            out[j] = ins_a[k]
            shared.append((j, k))
    return out, shared


def b_over_a(spec_a: CallSpec, spec_b: CallSpec) -> tuple[CallSpec, dict[int, int]] | None:
    """B's call with its tensor arguments renumbered as A's inputs at the same argument, and
    {A input: B input} for those; None when B passes a tensor where A passes none."""
    slots_a, slots_b = _slots(spec_a), _slots(spec_b)
    if any(path not in slots_a for path in slots_b):
        return None
    to_a = {j: slots_a[path] for path, j in slots_b.items()}

    def renumber(v: Any) -> Any:
        if isinstance(v, dict) and "input" in v:
            return {**v, "input": to_a[int(v["input"])]}
        if isinstance(v, list):
            return [renumber(x) for x in v]
        return v

    spec = CallSpec(spec_b.op, [renumber(v) for v in spec_b.args],
                    {k: renumber(v) for k, v in spec_b.kwargs.items()})
    return spec, {k: j for j, k in to_a.items()}


_MISSING = object()


def arg_changes(a: CallSpec, b: CallSpec) -> list[str]:
    """How B's call's arguments differ from A's, one phrase each ("argument 3 (bias): a tensor
    in A, None in B", "alpha: not passed in A, 2 in B", a loss's reduction with its name);
    tensors count as equal arguments (their values are compared elsewhere), and so do the
    devices they are on."""
    out = [f"the overload: {a.op} in A, {b.op} in B"] if a.op != b.op else []
    names = _arg_names(b.op)
    for i in range(max(len(a.args), len(b.args))):
        va = a.args[i] if i < len(a.args) else _MISSING
        vb = b.args[i] if i < len(b.args) else _MISSING
        if _plain(va) != _plain(vb):
            name = names[i] if i < len(names) else ""
            out.append(f"argument {i}{f' ({name})' if name else ''}: {_show(va, name)} in A, "
                       f"{_show(vb, name)} in B")
    for k in sorted(set(a.kwargs) | set(b.kwargs)):
        va, vb = a.kwargs.get(k, _MISSING), b.kwargs.get(k, _MISSING)
        if _plain(va) != _plain(vb):
            out.append(f"{k}: {_show(va, k)} in A, {_show(vb, k)} in B")
    return out


def _arg_names(op: str) -> list[str]:
    """The names of the overload's positional arguments, from its schema; [] where this torch
    has no such overload."""
    try:
        return [arg.name for arg in overload(op)._schema.arguments]
    except (NotReplayable, AttributeError):
        return []


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
"""A loss's `reduction` as aten takes it (torch.nn._reduction.get_enum)."""


def _plain(v: Any) -> Any:
    if v is _MISSING:
        return "<missing>"
    if isinstance(v, dict) and "input" in v:
        return "<tensor>"
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return json.dumps(v, sort_keys=True)


def _show(v: Any, name: str = "") -> str:
    if name == "reduction" and isinstance(v, int) and v in _REDUCTIONS:
        return f"{v} ({_REDUCTIONS[v]})"
    if v is _MISSING:
        return "not passed"
    if v is None:
        return "None"
    if isinstance(v, dict) and "input" in v:
        return "a tensor"
    if isinstance(v, dict) and len(v) == 1:
        return str(next(iter(v.values())))
    if isinstance(v, list):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return json.dumps(v)
