"""Where the first NaN/Inf of one step came from, read from its statistics table alone.

A dump keeps no tensor identities, so values are followed by their statistics: a record whose
dtype, element count, NaN/+Inf/-Inf counts and checksum equal an earlier record's holds the same
values (the checksum ignores layout, so views and transposes match). On that basis, in execution
order, the first non-finite value that

- a call made from finite inputs (an op, or a module forward at module level),
- an in-place op wrote into a finite tensor (`w[0, 0] = nan` is `aten.copy_`, `fill_`, ...), or
- a call consumed without any dumped call of the step having made it (a batch, a Python number,
  a weight written between steps or by something the dump does not see)

is the origin, unless it is absorbed: every later call that reads it makes only finite floating
outputs (a causal mask's -inf read by softmax) or only integer and boolean ones (a cast, a
comparison), or its record matches the `nan_allow` patterns.
At module level, where in-place writes leave no record, a module forward whose own parameter is
already non-finite when the optimizer reads it is not blamed: the parameter is named instead,
with what the dump can tell about when it changed.
"""
from __future__ import annotations

from typing import Any, Callable

_SHAPE_ONLY = ("aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like",
               "aten.rand_like", "aten.randn_like", "aten.randint_like", "aten.new_empty",
               "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.new_empty_strided")
"""Ops that read only a tensor's shape and dtype: their finite outputs absorb nothing."""
_FLOAT = ("float", "bfloat", "complex")
_KIND_WHY = {
    "computed": "its inputs are finite, its output is not",
    "no_inputs": "first non-finite output of a call whose inputs were not dumped (or that has "
                 "none)",
    "in_place_write": "an in-place write put non-finite values into a finite tensor",
    "from_outside": "a non-finite value that no dumped call of this step made: it came from "
                    "outside the dumped calls (the batch, a Python number, a tensor made before "
                    "the step, or an op the dump config filtered out)",
}


def nonfinite(rec: dict) -> bool:
    return int(rec["nan"]) + int(rec["posinf"]) + int(rec["neginf"]) > 0


def role(rec: dict) -> str:
    """'consumed' or 'produced': which tensors of a call went in and which came out."""
    d, phase = rec["direction"], rec["phase"]
    if rec["op"]:
        return "consumed" if d == "input" else "produced"
    if phase == "optimizer":
        return "produced" if d == "update" else "consumed"
    if phase == "backward":  # a module's backward takes grad_output and makes grad_input
        return "consumed" if d == "output" else "produced"
    return "consumed" if d == "input" else "produced"


def values(rec: dict) -> str:
    """Which non-finite values a record holds: 'NaN', '+Inf', '-Inf' or a mix ('NaN/+Inf')."""
    kinds = [k for k, c in (("NaN", "nan"), ("+Inf", "posinf"), ("-Inf", "neginf"))
             if int(rec[c])]
    return "/".join(kinds) or "none"


def sig(rec: dict) -> tuple:
    """What identifies a record's values: dtype, element count, NaN/Inf counts, checksum, and
    the minimum and maximum. The checksum adds the elements' bits, which some changes leave
    unchanged (every float32 element of a tensor of 512 times k scaled by a power of two, a
    negation of an even number of float16 elements); the extremes do not depend on the
    elements' order either, and move with those."""
    return (str(rec["dtype"]), int(rec["numel"]), int(rec["nan"]), int(rec["posinf"]),
            int(rec["neginf"]), int(rec["checksum"]), repr(float(rec["min"])),
            repr(float(rec["max"])))


def call_stem(rec: dict) -> str:
    """The stem all records of one op call share: "{scope}.{phase}.{call}" (the name without
    ".{direction}.{index}")."""
    return str(rec["name"]).rsplit(".", 2)[0]


def param_name(rec: dict) -> str:
    """The parameter a param, grad or update record belongs to (its name before
    `.optimizer.`)."""
    return str(rec["name"]).split(".optimizer.", 1)[0]


def _in_place(op: str) -> bool:
    return op.endswith("_") and not op.endswith("__") and op.startswith("aten.")


class StepOrigin:
    """The origin search over one step's records (dicts with the /records columns).

    `allow(name)` is True for records whose non-finite values are intended; `finite_before`
    gives the parameter scopes known finite when the step began (None: not known).
    """

    def __init__(self, recs: list[dict], allow: Callable[[str], bool] | None = None,
                 finite_before: Callable[[], set[str] | None] | None = None) -> None:
        self.recs = sorted(recs, key=lambda r: int(r["seq"]))
        self.allow = allow or (lambda name: False)
        self.finite_before = finite_before or (lambda: None)
        self.calls: dict[str, dict[str, list[dict]]] = {}
        self.readers: dict[tuple, list[dict]] = {}  # signature -> consumed non-finite records
        for r in self.recs:
            self.calls.setdefault(call_stem(r), {"consumed": [], "produced": []})[role(r)].append(r)
            if role(r) == "consumed" and nonfinite(r):
                self.readers.setdefault(sig(r), []).append(r)
        self.skipped: list[dict] = []  # non-finite values passed over: absorbed or allowed
        self._absorbs: dict[str, bool] = {}

    # -- absorption ----------------------------------------------------------------------------
    def absorbed(self, rec: dict) -> bool:
        """True when every later call that reads `rec`'s values makes only finite (or again
        absorbed) floating outputs; False when nothing dumped reads them."""
        later = self._later_readers(rec)
        return bool(later) and all(self._call_absorbs(call_stem(c)) for c in later)

    def _later_readers(self, rec: dict) -> list[dict]:
        return [c for c in self.readers.get(sig(rec), ())
                if int(c["seq"]) > int(rec["seq"]) and call_stem(c) != call_stem(rec)]

    def _needs(self, key: str) -> list[str] | None:
        """The reader calls whose absorbing decides whether call `key` absorbs what it read;
        [] when it absorbs them itself (integer or boolean outputs only: a cast or comparison
        ends non-finite values, as T5's relative-position buckets cast the -inf of log(0)
        before `where` drops it); None when it cannot (a shape-only op, an output nothing
        reads)."""
        produced = self.calls[key]["produced"]
        if not produced or produced[0]["op"] in _SHAPE_ONLY:
            return None
        if not any(str(p["dtype"]).startswith(_FLOAT) for p in produced):
            return []
        needs: list[str] = []
        for p in produced:
            if nonfinite(p):
                later = self._later_readers(p)
                if not later:
                    return None
                needs += [call_stem(c) for c in later]
        return needs

    def _call_absorbs(self, key: str) -> bool:
        """Whether call `key` absorbs the non-finite values it read, by a depth-first walk over
        the calls that read its outputs (iterative: chains run through hundreds of ops)."""
        stack, open_ = [key], set()
        while stack:
            k = stack[-1]
            if k in self._absorbs:
                stack.pop()
                continue
            needs = self._needs(k)
            if needs is None or any(self._absorbs.get(n) is False for n in needs):
                self._absorbs[k] = False
                stack.pop()
                continue
            todo = [n for n in needs if n not in self._absorbs and n not in open_]
            if todo and k not in open_:
                open_.add(k)
                stack += todo
                continue
            self._absorbs[k] = all(self._absorbs.get(n, False) for n in needs)
            open_.discard(k)
            stack.pop()
        return self._absorbs[key]

    # -- search --------------------------------------------------------------------------------
    def find(self) -> dict[str, Any] | None:
        """The origin as a dict (see `_origin`), or None when every non-finite value of the step
        is absorbed or allowed (or there is none)."""
        harmless: set[tuple] = set()  # values known absorbed or allowed
        seen: set[tuple] = set()  # non-finite values some dumped call made
        for r in self.recs:
            if not nonfinite(r):
                continue
            value = sig(r)
            if self.allow(str(r["name"])):
                harmless.add(value)
                seen.add(value)
                self._skip(r, "allowed by nan_allow")
                continue
            if role(r) == "consumed":
                if value in seen:
                    continue  # made earlier in this step
                seen.add(value)
                if self._call_absorbs(call_stem(r)):
                    harmless.add(value)
                    self._skip(r, f"absorbed by {call_stem(r)}")
                    continue
                return self._entry(r)
            seen.add(value)
            inputs = [c for c in self.calls[call_stem(r)]["consumed"] if nonfinite(c)]
            if any(sig(c) not in harmless for c in inputs):
                continue  # carries a non-finite value made earlier
            if self.absorbed(r):
                harmless.add(value)
                self._skip(r, "absorbed by " + ", ".join(sorted(
                    {call_stem(c) for c in self.readers[value] if int(c["seq"]) > int(r["seq"])})))
                continue
            if not r["op"] and r["phase"] == "forward":
                weight = self._module_weight(r)
                if weight is not None:
                    return weight
            call = self.calls[call_stem(r)]
            if not inputs and self._write(call) is r:
                return self._origin(r, "in_place_write")
            if inputs:
                return self._origin(r, "computed", why=(
                    "its only non-finite inputs are values passed over ("
                    + ", ".join(c["name"] for c in inputs) + "), its output is not finite"))
            return self._origin(r, "computed" if call["consumed"] else "no_inputs")
        return None

    def _skip(self, rec: dict, why: str) -> None:
        self.skipped.append({"name": rec["name"], "values": values(rec), "why": why})

    def _entry(self, rec: dict) -> dict[str, Any]:
        """A non-finite value read without a dumped maker: name the in-place write that stored
        it (this call, or one on the same source line), else the parameter or the reader."""
        key = call_stem(rec)
        keys = list(dict.fromkeys(call_stem(r) for r in self.recs
                                  if int(r["seq"]) >= int(rec["seq"])))
        for k in keys:
            call = self.calls[k]
            first = (call["consumed"] or call["produced"])[0]
            if k != key and first["source"] != rec["source"]:
                break
            write = self._write(call)
            if write is not None:
                why = _KIND_WHY["in_place_write"]
                if k != key:
                    why += f"; the value came from outside the dumped calls ({rec['name']})"
                return self._origin(write, "in_place_write", why)
        param = self._param_for(rec)
        if param is not None:
            return self._weight(param, rec)
        return self._origin(rec, "from_outside")

    def _write(self, call: dict[str, list[dict]]) -> dict | None:
        """The non-finite output of an in-place op whose target (input 0) was finite."""
        out = [p for p in call["produced"] if nonfinite(p)]
        if not out or not _in_place(str(out[0]["op"])):
            return None
        target = [c for c in call["consumed"] if int(c["index"]) == 0]
        return out[0] if target and not nonfinite(target[0]) else None

    def _param_for(self, rec: dict) -> dict | None:
        """The optimizer `param` record holding the same values as `rec` (or `rec` itself)."""
        if rec["phase"] == "optimizer" and rec["direction"] == "param":
            return rec
        value = sig(rec)
        for r in self.recs:
            if r["phase"] == "optimizer" and r["direction"] == "param" and sig(r) == value:
                return r
        return None

    def _module_weight(self, out: dict) -> dict[str, Any] | None:
        """At module level: a parameter of `out`'s module that is non-finite when the optimizer
        reads it explains the forward's non-finite output better than the forward does."""
        module = str(out["module"])
        for r in self.recs:
            if (r["phase"] == "optimizer" and r["direction"] == "param" and nonfinite(r)
                    and (module == "<root>" or param_name(r).startswith(module + "."))):
                return self._weight(r, out)
        return None

    def _weight(self, param: dict, first: dict) -> dict[str, Any]:
        scope = param_name(param)
        before = self.finite_before()
        if before is None:
            when = "whether it was finite when the step began is not known (the step before " \
                   "is not in the dump)"
        elif scope in before:
            when = ("it was finite when the step began (finite weight and update at the step "
                    "before), so it was changed during this step")
        else:
            when = "it was already non-finite at the step before"
        seen = (f"it was non-finite by the time of {first['name']} (at "
                f"{first['source'] or 'unknown source'}), the first record to show it")
        found = self._origin(param, "weight", why=(
            f"parameter {scope} holds {values(param)} when the optimizer reads it; {when}; "
            f"{seen}; no dumped call made it: an in-place write that module hooks do not see "
            f"(like `w[0, 0] = nan` or `fill_` in the loop, outside any module's forward) or a "
            f"load changed it; dump at level op or mix for the op and line"))
        found.update(source="", first_seen=first["name"], first_seen_source=first["source"])
        return found

    def _origin(self, r: dict, kind: str, why: str | None = None) -> dict[str, Any]:
        call = self.calls.get(call_stem(r), {"consumed": []})
        if kind == "in_place_write":
            params = [param_name(p) for p in self.recs if p["phase"] == "optimizer"
                      and p["direction"] == "param" and nonfinite(p)]
            if params:
                why = (why or _KIND_WHY[kind]) + ("; parameters non-finite when the optimizer "
                                                  "reads them: " + ", ".join(params))
        return {"name": r["name"], "module": r["module"], "op": r["op"], "phase": r["phase"],
                "direction": r["direction"], "seq": int(r["seq"]), "source": r["source"],
                "nan": int(r["nan"]), "posinf": int(r["posinf"]), "neginf": int(r["neginf"]),
                "numel": int(r["numel"]), "values": values(r), "kind": kind,
                "inputs": [c["name"] for c in call["consumed"]],
                "why": why or _KIND_WHY[kind], "skipped_values": list(self.skipped)}


def finite_params(recs: list[dict]) -> set[str]:
    """Parameter scopes whose weight and update are finite in a step: finite after it."""
    bad = {param_name(r) for r in recs if r["phase"] == "optimizer" and nonfinite(r)
           and r["direction"] in ("param", "update")}
    return {param_name(r) for r in recs if r["phase"] == "optimizer"
            and r["direction"] == "param"} - bad
