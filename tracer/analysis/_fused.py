"""One module in one codebase, several in the other: a fused projection against its parts.

GPT-2 and the trainer's GPT compute queries, keys and values with one projection (`c_attn`,
weight [3d, d]); Llama computes them with three (`q_proj`, `k_proj`, `v_proj`). The fused
weight holds the parts' weights concatenated, and the fused output holds the parts' outputs
concatenated, so no record of one side pairs with a record of the other by shape or by value.

Concatenation keeps every element, so the statistics of the whole follow from the parts': the
element counts, NaN/Inf and zero counts add up, the minimum and maximum are the parts' extremes,
the mean is the count-weighted mean, the norm is the root of the summed squared norms, and the
checksum (a wrapping sum of the elements' bits) is the parts' checksums summed with the same
wrap. That is exact for the counts and the checksum whatever order the parts are concatenated
in (a weight stored transposed too), which lets `sleuth map` find the parts of a fused
parameter, and lets the diff compare the fused record with its parts combined.

Three kinds of record meet in such a group, told apart by element counts:
- the parts' records concatenate into the whole's (weights, their gradients, forward outputs,
  the gradients flowing into those outputs): compared with the parts combined;
- every part reads the same tensor the whole reads (the forward input): compared with one part;
- the whole's record is the sum of the parts' (the gradient flowing out to the shared input):
  a sum cannot be rebuilt from statistics, so the pair is named as not compared, never judged.
"""
from __future__ import annotations

import math
from typing import Any

from tracer.analysis._compare import Tolerance, compare_stats
from tracer.analysis._origin import param_name

MAX_PARTS = 8
"""The most parts one fused parameter is searched for among (q, k, v; gate and up; ...)."""

_KEY = ("phase", "op", "direction", "index", "call")


def wrap(total: int, dtype: str) -> int:
    """`total` wrapped to a signed integer of the dtype's element width, as the checksum is."""
    from tracer.storage import element_size

    bits = 8 * (element_size(dtype) or 8)
    total &= (1 << bits) - 1
    return total - (1 << bits) if total >= 1 << (bits - 1) else total


def _local(rec: Any, module: str) -> str:
    """The parameter's name inside its module ("weight") for optimizer records, else ""."""
    if rec["phase"] != "optimizer":
        return ""
    return param_name(rec).removeprefix(f"{module}.")


def find_fused(pa: list[dict], pb: list[dict]) -> list[tuple[list[str], list[str], str]]:
    """Fused parameters among the parameter records (dicts, in recorded order) that paired
    nothing one to one: ([A modules], [B modules], why) for each group in which one module of
    one side holds the concatenation of parameters several modules of the other side hold (a
    fused weight and its fused bias name the same modules: one group)."""
    found: dict[tuple[tuple[str, ...], tuple[str, ...]], list[str]] = {}
    taken: set[int] = set()
    for whole_side, wholes, parts in (("a", pa, pb), ("b", pb, pa)):
        for w in wholes:
            if id(w) in taken or float(w["min"]) == float(w["max"]):
                continue  # values alike everywhere (zeros, ones) would add up by chance
            local = _local(w, w["module"])
            same = [p for p in parts if id(p) not in taken and p["dtype"] == w["dtype"]
                    and _local(p, p["module"]) == local and int(p["numel"]) < int(w["numel"])]
            window = _window(w, same)
            if window is None:
                continue
            taken.update(id(x) for x in (w, *window))
            whole, mods = (w["module"],), tuple(p["module"] for p in window)
            key = (whole, mods) if whole_side == "a" else (mods, whole)
            found.setdefault(key, []).append(local or "parameter")
    return [(list(a), list(b), f"parameters {', '.join(names)}: "
             f"{a[0] if len(a) == 1 else b[0]} holds {', '.join(b if len(a) == 1 else a)} "
             "concatenated (element counts and checksums add up; the order of the parts is not "
             "seen)") for (a, b), names in found.items()]


def _window(whole: dict, parts: list[dict]) -> list[dict] | None:
    """The first run of 2 to MAX_PARTS consecutive `parts` whose element counts and wrapped
    checksums add up to `whole`'s and whose extremes are its extremes."""
    n, checksum = int(whole["numel"]), int(whole["checksum"])
    for start in range(len(parts)):
        total = ck = 0
        for k in range(start, min(start + MAX_PARTS, len(parts))):
            total += int(parts[k]["numel"])
            ck += int(parts[k]["checksum"])
            if total > n:
                break
            if k > start and total == n and wrap(ck, whole["dtype"]) == checksum:
                run = parts[start:k + 1]
                if _extremes(run) == (float(whole["min"]), float(whole["max"])):
                    return run
    return None


def _extremes(rows: list[dict]) -> tuple[float, float]:
    return min(float(r["min"]) for r in rows), max(float(r["max"]) for r in rows)


def group_name(parts: list[str]) -> str:
    """The name a set of part modules goes by once combined: "blocks.0.{q,k,v}"."""
    prefix = parts[0].rsplit(".", 1)[0] + "." if "." in parts[0] else ""
    if all(p.startswith(prefix) and "." not in p[len(prefix):] for p in parts):
        return prefix + "{" + ",".join(p[len(prefix):] for p in parts) + "}"
    return "{" + ",".join(parts) + "}"


def combine(table: Any, groups: dict[str, list[str]]) -> Any:
    """`table` (a /records DataFrame) with the records of each group's part modules replaced
    by one combined record per (phase, op, direction, index, call, parameter): the parts'
    statistics concatenated, named after the group, module the group's key. Columns added:
    `_file_row` (the record's row in the file, -1 for a combined one), `parts`, `part_numel`,
    `part_checksum`, `parts_equal`. Records of parts that do not all have the record stay as
    they are."""
    import pandas as pd

    table = table.assign(_file_row=range(len(table)), parts=0, part_numel=0, part_checksum=0,
                         parts_equal=False)
    owner = {m: whole for whole, parts in groups.items() for m in parts}
    mine = table["module"].isin(owner)
    if not mine.any():
        return table
    recs = table[mine].to_dict("records")
    buckets: dict[tuple, list[dict]] = {}
    for r in recs:
        key = (owner[r["module"]], *(r[k] for k in _KEY), _local(r, r["module"]))
        buckets.setdefault(key, []).append(r)
    drop, rows = [], []
    for key, found in buckets.items():
        whole = key[0]
        order = {m: i for i, m in enumerate(groups[whole])}
        found.sort(key=lambda r: order[r["module"]])
        if [r["module"] for r in found] != groups[whole]:
            continue  # not every part has this record: they stay as they are
        rows.append(_combined(found, whole, groups[whole]))
        drop += [r["_file_row"] for r in found]
    kept = table[~table["_file_row"].isin(drop)]
    return (pd.concat([kept, pd.DataFrame(rows, columns=table.columns)], ignore_index=True)
            .sort_values("seq", kind="stable").reset_index(drop=True))


def _combined(parts: list[dict], whole: str, modules: list[str]) -> dict:
    first = parts[0]
    n = sum(int(p["numel"]) for p in parts)
    counts = {k: sum(int(p[k]) for p in parts) for k in ("nan", "posinf", "neginf", "zeros")}
    equal = len({(int(p["checksum"]), int(p["numel"]), str(p["shape"])) for p in parts}) == 1
    mean = (sum(float(p["mean"]) * int(p["numel"]) for p in parts) / n) if n else 0.0
    name = str(first["name"])
    group = group_name(modules)
    if name.startswith(first["module"]):
        name = group + name[len(first["module"]):]
    return {**first, "name": name, "module": whole, "numel": n,
            "min": min(float(p["min"]) for p in parts), "max": max(float(p["max"]) for p in parts),
            "mean": mean, "norm": math.sqrt(sum(float(p["norm"]) ** 2 for p in parts)),
            **counts, "checksum": wrap(sum(int(p["checksum"]) for p in parts), first["dtype"]),
            "shape": _concat_shape([str(p["shape"]) for p in parts]),
            "data_offset": -1, "data_nbytes": 0, "strides": "", "_file_row": -1,
            "parts": len(parts), "part_numel": int(first["numel"]),
            "part_checksum": int(first["checksum"]), "parts_equal": equal}


def _concat_shape(shapes: list[str]) -> str:
    """The shape of the parts concatenated along the one dimension where they differ (the
    first when they differ nowhere)."""
    dims = [[int(d) for d in s.split(",")] if s else [] for s in shapes]
    if len({len(d) for d in dims}) != 1 or not dims[0]:
        return shapes[0]
    differ = [i for i in range(len(dims[0])) if len({d[i] for d in dims}) > 1]
    if len(differ) > 1:
        return shapes[0]
    axis = differ[0] if differ else 0
    out = list(dims[0])
    out[axis] = sum(d[axis] for d in dims)
    return ",".join(map(str, out))


def is_combined(rec: dict | None) -> bool:
    return rec is not None and int(rec.get("parts", 0) or 0) > 0


def compare_fused(ra: dict, rb: dict, tol: Tolerance) -> dict[str, Any]:
    """Compare a fused module's record with its parts' combined record (either side may be
    the combined one): {compared, verdict, reason, *_rdiff, ...} as `compare_stats` gives,
    or verdict "only_a" with the reason when the pair cannot be compared (a sum)."""
    parts, whole = (rb, ra) if is_combined(rb) else (ra, rb)
    k = int(parts["parts"])
    if int(whole["numel"]) == int(parts["numel"]):
        out = compare_stats(ra, rb, tol)  # the parts concatenated
        how = f"the {k} parts concatenated"
    elif int(whole["numel"]) == int(parts["part_numel"]) and parts["parts_equal"]:
        one = {**parts, "numel": parts["part_numel"], "norm": float(parts["norm"]) / math.sqrt(k),
               "checksum": parts["part_checksum"],
               **{c: int(parts[c]) // k for c in ("nan", "posinf", "neginf", "zeros")}}
        out = compare_stats(*((whole, one) if parts is rb else (one, whole)), tol)
        how = f"one of the {k} parts (each reads the same tensor)"
    else:
        return {"compared": "", "verdict": "only_a",
                "reason": f"not compared: {whole['name']} holds {whole['numel']} elements "
                          f"where each of the {k} parts holds {parts['part_numel']}: the sum of "
                          f"the parts' (the gradient flowing back into the input they share), "
                          f"which statistics cannot rebuild"}
    out["compared"] = "statistics"
    if out["verdict"] == "diverged":
        out["reason"] = f"{out['reason']} (against {how})"
    return out
