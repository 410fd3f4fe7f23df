"""Parameters written in place during a step: which op and line wrote them, read from the two
runs' records of one step (`mark_written`, for the diff); when a parameter that no write explains
came to differ, as far as the step's records tell (`param_when`); and what explain says of both
(`written_verdict`).

The optimizer's `param` records are taken when `optimizer.step()` begins, after anything the
step wrote into a weight (a forward pre-hook's `weight.mul_(1.001)` under `no_grad`, a manual
update, a `copy_` into a weight). The diff orders `param` records first, as the weights the step
began with; a weight the step wrote in place was not that, so its record is found here and
ordered where it was taken instead, and the write is named.

A dump keeps no tensor identities, so a write is found by its values, as the NaN origin search
follows them (tracer.analysis._origin): an in-place op's output 0 is the tensor it wrote, and
the last write of a parameter left exactly the values the optimizer's `param` record holds
(dtype, element count, NaN/Inf counts, checksum, shape). Earlier writes chain back through each
write's input 0, to the value before the first write. A weight counts as written in the step
only where that value agrees between the runs (else the runs began the step with different
weights, written or not).
"""
from __future__ import annotations

from typing import Any

from tracer.analysis._origin import _in_place, call_stem, param_name, sig


def _value(rec: dict) -> tuple:
    return (*sig(rec), str(rec["shape"]))


def _writes(recs: list[dict]) -> dict[tuple, list[tuple[int, dict, dict | None]]]:
    """The in-place op calls of one side's step: value written -> [(seq, output 0, input 0)],
    in execution order."""
    inputs = {call_stem(r): r for r in recs if r["op"] and r["direction"] == "input"
              and int(r["index"]) == 0 and _in_place(str(r["op"]))}
    out: dict[tuple, list[tuple[int, dict, dict | None]]] = {}
    for r in recs:
        if r["op"] and r["direction"] == "output" and int(r["index"]) == 0 \
                and _in_place(str(r["op"])):
            out.setdefault(_value(r), []).append((int(r["seq"]), r, inputs.get(call_stem(r))))
    return out


def _chain(param: dict, writes: dict[tuple, list]) -> list[tuple[int, dict, dict | None]]:
    """The writes that made `param`'s value, first write first: the last write whose output
    holds it, then, through each write's input 0, the writes before it."""
    chain: list[tuple[int, dict, dict | None]] = []
    value, before = _value(param), int(param["seq"])
    while True:
        found = [w for w in writes.get(value, ()) if w[0] < before]
        if not found:
            return chain[::-1]
        write = found[-1]
        chain.append(write)
        if write[2] is None:  # its input was not recorded (`io: output`): the chain stops here
            return chain[::-1]
        value, before = _value(write[2]), write[0]


def _entry(param: str, chains: dict[str, list], side: str) -> dict[str, Any]:
    """What a report says of a written parameter: the first write of B's chain (A's when only
    A writes), and which run wrote it."""
    first = chains["B" if chains["B"] else "A"][0][1]
    return {"param": param, "written_by": side, "op": str(first["op"]),
            "module": str(first["module"]), "source": str(first["source"]),
            "caller": str(first.get("caller") or ""), "name": call_stem(first)}


def mark_written(rows: list[dict], recs_a: list[dict], recs_b: list[dict]) -> None:
    """Mark `written` (a dict: param, written_by "A", "B" or "both", op, module, source, caller,
    name of the first write's call) on the divergent rows a write explains: the parameter's
    `param` record, the write's own records, and every record that holds a value the write
    made.

    `rows`: one step's compared rows (dicts of the diff's columns); `recs_a`, `recs_b`: each
    side's records of that step (dicts of the /records columns)."""
    params = [r for r in rows if r["verdict"] == "diverged" and r["phase"] == "optimizer"
              and r["direction"] == "param"]
    if not params:
        return
    by_seq = ({int(r["seq"]): r for r in recs_a}, {int(r["seq"]): r for r in recs_b})
    writes = (_writes(recs_a), _writes(recs_b))
    if not (writes[0] or writes[1]):
        return
    made: list[tuple[dict, tuple[set, set], tuple[int, int]]] = []
    for row in params:
        pa, pb = by_seq[0].get(int(row["seq"])), by_seq[1].get(int(row["b_seq"]))
        if pa is None or pb is None:
            continue
        chains = {"A": _chain(pa, writes[0]), "B": _chain(pb, writes[1])}
        # writes both runs made alike (a weight's initialisation, where the step built the
        # model) are not where the runs part
        alike = {_value(w[1]) for w in chains["A"]} & {_value(w[1]) for w in chains["B"]}
        chains = {k: [w for w in c if _value(w[1]) not in alike] for k, c in chains.items()}
        if not (chains["A"] or chains["B"]):
            continue
        # the value before each run's first write; an unwritten run's is its param record
        start = [_value(c[0][2]) if c and c[0][2] is not None else (None if c else _value(p))
                 for c, p in ((chains["A"], pa), (chains["B"], pb))]
        if start[0] is None or start[0] != start[1]:
            continue  # the runs began the step with different weights
        side = "both" if chains["A"] and chains["B"] else ("A" if chains["A"] else "B")
        entry = _entry(param_name(row), chains, side)
        row["written"] = entry
        values = ({_value(w[1]) for w in chains["A"]}, {_value(w[1]) for w in chains["B"]})
        first = (chains["A"][0][0] if chains["A"] else -1, chains["B"][0][0] if chains["B"]
                 else -1)
        made.append((entry, values, first))
    if not made:
        return
    for row in rows:
        if row["verdict"] != "diverged" or row.get("written"):
            continue
        ra, rb = by_seq[0].get(int(row["seq"])), by_seq[1].get(int(row["b_seq"]))
        for entry, values, first in made:
            # a record that holds a value a write made, on the side that wrote it, after the
            # write: the weight as each op read it
            if any(rec is not None and 0 <= f <= int(rec["seq"]) and _value(rec) in vals
                   for rec, vals, f in ((ra, values[0], first[0]), (rb, values[1], first[1]))):
                row["written"] = entry
                break


def param_when(rows: list[dict], i: int) -> dict[str, Any]:
    """When the parameter of `rows[i]` (a divergent `param` record no write was found for) came
    to differ, as far as its step's rows (in diff order) tell: {"when": ...}

    - "before": op records show every op of the step up to the first record that differs, and
      none of them is an in-place write the runs made differently: the runs began the step
      with different weights;
    - "unmatched", with `write` (op, source, name of the first such write): the runs wrote in
      place differently before anything else differed, but the records do not tie the write
      to the weight (a write into a slice of it, `w[0, 0] = nan`, or one whose input was not
      dumped, `io: output`), so the weight may have been written there;
    - "in_step": no op records, but the outputs of its module's forward agree, so the weight
      they read did: it changed after them;
    - "unknown": no op records: a module dump cannot tell a weight the step began with from
      one written in place before its module read it."""
    row = rows[i]
    step = [r for r in rows if r["step"] == row["step"]]
    if any(r["op"] for r in step):
        rest = [r for r in step if not (r["phase"] == "optimizer" and r["direction"] == "param")]
        first = next((k for k, r in enumerate(rest) if r["verdict"] == "diverged"), len(rest))
        # an input record too: a dump of inputs only (`io: input`) has no output of a write
        writes = [r for r in rest[:first + 1] if r["op"] and _in_place(str(r["op"]))
                  and r["verdict"] != "same"]
        if not writes:
            return {"when": "before"}
        w = writes[0]
        return {"when": "unmatched", "write": {"op": str(w["op"]), "source": str(w["source"]),
                                               "name": call_stem(w)}}
    outs = [r for r in step if r["module"] == row["module"] and r["phase"] == "forward"
            and r["direction"] == "output" and not r["op"]]
    return {"when": "in_step" if outs and all(r["verdict"] == "same" for r in outs)
            else "unknown"}


def written_verdict(fd: dict[str, Any]) -> tuple[str, str, dict[str, Any] | None] | None:
    """`explain`'s verdict (status, text, blamed) on a first divergence in a weight that was
    written in place during the step (kind "written": a bug, fault "written", blaming the first
    write of B, of A when only A writes) or that a module dump cannot date (kind "parameter",
    `when` other than "before": unexplained); None for any other."""
    if fd["kind"] == "parameter" and fd.get("when", "before") != "before":
        return "unexplained", param_text(fd), None
    if fd["kind"] != "written":
        return None
    w = fd["written"]
    who = {"A": "A writes it and B does not", "B": "B writes it and A does not",
           "both": "both runs write it, to different values"}[w["written_by"]]
    called = f", called from {w['caller']}" if w.get("caller") else ""
    text = (f"bug: written in place: {w['op']} at {w['source'] or 'an unknown line'}{called} "
            f"({w['name']}, module {w['module']}) writes parameter {w['param']} during step "
            f"{fd['step']}: {who}. The runs began the step with the same weights; every record "
            f"that differs from {fd['name']} on reads the weight as written (the optimizer's "
            f"param record is taken after the write)")
    # `side`, as for an op added or removed: the one run that runs the write
    one = {"side": w["written_by"]} if w["written_by"] != "both" else {}
    blamed = {"fault": "written", "param": w["param"], "written_by": w["written_by"], **one,
              "name": w["name"], "b_name": w["name"] if w["written_by"] != "A" else "",
              "op": w["op"], "module": w["module"], "phase": fd["phase"] if fd["op"] else "",
              "step": fd["step"], "source": w["source"], "caller": w.get("caller", ""),
              "judged": "bug", "why": who}
    return "bug", text, blamed


def param_text(fd: dict[str, Any]) -> str:
    """A parameter record that differs, in words, by what its step's records tell of when
    (`param_when`)."""
    name, module, step = fd["name"], fd["module"], fd["step"]
    if fd["when"] == "in_step":
        return (f"{name} differs when optimizer.step() reads it at step {step}, while the "
                f"outputs of its module {module}'s forward agree: the weight changed during the "
                f"step, after that forward read it, by something module hooks do not see (an "
                f"in-place write); dump at level op or mix for the op and line")
    if fd["when"] == "unmatched":
        w = fd["write"]
        return (f"{name} differs when optimizer.step() reads it at step {step}, and before "
                f"anything else differed the runs wrote in place differently: {w['op']} at "
                f"{w['source'] or 'an unknown line'} ({w['name']}). The records do not tie that "
                f"write to the weight (a write into a part of it, or one whose input was not "
                f"dumped), so whether the runs began the step with different weights or that "
                f"write changed it is not known")
    return (f"{name} differs when optimizer.step() reads it at step {step}: a module-level dump "
            f"cannot tell whether the runs began the step with different weights or one wrote "
            f"it in place during the step before {module} read it; dump at level op or mix to "
            f"see the op and line of any write")
