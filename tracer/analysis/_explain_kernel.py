"""A first divergence at one of Inductor's generated kernels: the kernel, and the graph nodes it
fused, named.

A dumped compiled step in tensor mode records each kernel's outputs (op ``kernel.{name}``,
tracer.capture._inductor_kernels) and, in its setup's ``compile.kernels``, which nodes the
kernel fused: each node's aten op, module and line. Every record before the first divergence
agrees, the region's inputs among them, so the kernel computes something else from what both
runs gave the region: a fault in the code Inductor generated for those ops (a lowering, a
fusion), or, where the runs fused them differently, another graph. The kernel's own call is
never re-run (its code is not in the dump), so the verdict rests on the order of the records.
"""
from __future__ import annotations

from typing import Any

from tracer.analysis._explain_sides import stem
from tracer.capture import KERNEL_OP

def kernel_op(op: Any) -> bool:
    """Whether a record's op is one of Inductor's generated kernels'."""
    return str(op or "").startswith(KERNEL_OP)


def fused_of(setup: dict[str, Any] | None, fd: dict[str, Any], name_key: str = "name"
             ) -> list[list[str]] | None:
    """What the kernel of record `fd` fused, as its run's setup says: ``[op, module,
    file:line]`` per distinct node, or None where the setup does not say."""
    kernels = kernels_of(setup)
    scope = str(fd.get(name_key) or fd["name"]).rsplit(".", 4)[0]  # name: docs/dump-format.md
    entry = kernels.get(f"{scope}.{fd['phase']}")
    nodes = entry.get("nodes") if isinstance(entry, dict) else None
    if not isinstance(nodes, list):
        return None
    return [[str(x) for x in n[:3]] for n in nodes if isinstance(n, list) and len(n) >= 3]


def fused_words(nodes: list[list[str]], most: int = 6) -> str:
    """The fused nodes in words, grouped by module and line in their order: ``aten.mul,
    aten.erf in <root> at model.py:9; aten.var_mean in n at model.py:9``."""
    groups: dict[tuple[str, str], list[str]] = {}
    for op, module, source in nodes:
        ops = groups.setdefault((module, source), [])
        if op not in ops:
            ops.append(op)
    parts = [f"{', '.join(ops)} in {module} at {source or 'an unknown line'}"
             for (module, source), ops in list(groups.items())[:most]]
    more = len(groups) - most
    return "; ".join(parts) + (f"; and {more} more place(s)" if more > 0 else "")


def kernel_verdict(fd: dict[str, Any], setups: list[dict[str, Any] | None]
                   ) -> tuple[str, str, dict[str, Any]]:
    """(status, verdict, blamed) for a first divergence `fd` that is a kernel's output."""
    kernel = str(fd["op"])[len(KERNEL_OP):]
    fused_a = fused_of(setups[0], fd)
    fused_b = fused_of(setups[1], fd, "b_name")
    where = fused_words(fused_b or fused_a or [])
    first = (fused_b or fused_a or [["", "", ""]])[-1]
    blamed = {"name": stem(fd["name"]), "b_name": stem(fd["b_name"] or fd["name"]),
              "op": fd["op"], "kernel": kernel, "module": fd["module"],
              "source": fd["source"] or first[2], "a_source": fd["source"],
              "phase": fd["phase"], "step": fd["step"], "judged": "bug", "fault": "kernel",
              "fused": fused_b or fused_a or []}
    head = (f"Inductor's kernel {kernel} ({fd['phase']}, in the compiled region of "
            f"{fd['module']}) is where the runs first part: its output {fd['index']} "
            f"({fd['name']}) differs while every record before it agrees, the region's inputs "
            f"among them")
    if fused_a is not None and fused_b is not None and \
            sorted(map(tuple, fused_a)) != sorted(map(tuple, fused_b)):
        why = (f"{head}; B's kernel fuses other nodes than A's ({where}; A's: "
               f"{fused_words(fused_a)}): the compiled graphs differ, so dump both runs with "
               "\"compiled\": \"interpret\" to name the op")
        blamed.update(fault="fused", why=why)
        return "bug", f"bug: {why}", blamed
    fused = f"; it fuses {where}" if where else "; what it fuses is not recorded"
    why = (f"{head}{fused}: the code generated for these ops computes something else from "
           "the same inputs (a lowering or fusion fault; between different torch builds or "
           "machines, possibly their rounding)")
    blamed["why"] = why
    return "bug", f"bug: {why}", blamed


def kernels_of(setup: dict[str, Any] | None) -> dict[str, Any]:
    """A run's ``compile.kernels`` (what each kernel recorded in the step fused), {} if none."""
    found = ((setup or {}).get("compile") or {}).get("kernels")
    return found if isinstance(found, dict) else {}


def fused_change(gone: list[dict], new: list[dict], kernels_a: dict[str, Any],
                 kernels_b: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]] | None:
    """Where the calls only one run runs include Inductor's kernels (`gone`: A's, `new`:
    B's output records): the nodes B's kernels fuse that A's do not, and A's that B's do not,
    each ``[op, module, file:line]``; None where no kernel is among them or a setup does not
    say what one fused."""
    def fused(recs: list[dict], kernels: dict[str, Any]) -> dict[tuple[str, ...], None] | None:
        out: dict[tuple[str, ...], None] = {}
        for r in recs:
            if not kernel_op(r["op"]):
                continue
            entry = kernels.get(f"{str(r['name']).rsplit('.', 4)[0]}.{r['phase']}")
            nodes = entry.get("nodes") if isinstance(entry, dict) else None
            if not isinstance(nodes, list):
                return None
            out.update((tuple(str(x) for x in n[:3]), None) for n in nodes
                       if isinstance(n, list) and len(n) >= 3)
        return out

    if not any(kernel_op(r["op"]) for r in (*gone, *new)):
        return None
    in_a, in_b = fused(gone, kernels_a), fused(new, kernels_b)
    if in_a is None or in_b is None:
        return None
    return [list(n) for n in in_b if n not in in_a], [list(n) for n in in_a if n not in in_b]
