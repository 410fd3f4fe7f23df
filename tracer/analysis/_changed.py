"""What changed between two runs, where a diff can tell: how they were set up (optimizer,
clipping, config, buffers, flags: tracer.analysis._setup), the dtypes their matched records were
computed in, a first divergence that lies before any computation (the data fed to the
model, or the weights a step began with), and a weight written in place during the step
(tracer.analysis._written). A report says these first, since everything that
diverges after them follows from them."""
from __future__ import annotations

import math
import re
from typing import Any

from tracer.analysis._origin import call_stem

_DATA_INPUT = re.compile(r"^<root>\.forward\.0\.input\.")
_INTEGER = ("int", "uint", "bool")
_OUTSIDE = ("<none>", "")  # the module of an op run outside every module


def kind(row: dict[str, Any]) -> str:
    """What a divergent record is: "data" (the model's input, or an input marked `fed`),
    "written" (a weight an in-place op wrote during the step, or a value that write made),
    "parameter" (a weight before the optimizer step) or "compute"."""
    if row.get("made"):  # `mark_fed` found the op that made it, in either run
        return "compute"
    if _DATA_INPUT.match(str(row["name"])) or row.get("fed"):
        return "data"
    if row.get("written"):
        return "written"
    if row["phase"] == "optimizer" and row["direction"] == "param":
        return "parameter"
    return "compute"


# in-place ops that fill a tensor with new values (a synthetic batch drawn in place)
_FILLS = ("aten.uniform_", "aten.normal_", "aten.random_", "aten.bernoulli_",
          "aten.exponential_", "aten.geometric_", "aten.cauchy_", "aten.log_normal_",
          "aten.fill_", "aten.zero_")


def _updates_in_place(row: dict[str, Any]) -> bool:
    """A float tensor updated in place by arithmetic on what it holds (`p.data.add_(...)`, an
    EMA's `mul_` and `add_` of the weights, left over from the step before): a computation
    of the loop's, not the batch being made, though it runs before the model's first call."""
    op = str(row["op"])
    dtype = str(row["dtype"] or row.get("b_dtype") or "")  # a record of B's alone: B's dtype
    return op.endswith("_") and op not in _FILLS and dtype.startswith(
        ("float", "bfloat", "complex"))


def _made(recs: list[dict]) -> dict[tuple, int]:
    """(dtype, element count, checksum) of each integer op output -> the first seq holding it."""
    made: dict[tuple, int] = {}
    for rec in recs:
        if rec["direction"] == "output" and str(rec["dtype"]).startswith(_INTEGER):
            key = (rec["dtype"], int(rec["numel"]), int(rec["checksum"]))
            made[key] = min(made.get(key, int(rec["seq"])), int(rec["seq"]))
    return made


def mark_fed(rows: list[dict], recs_a: list[dict], recs_b: list[dict] | None = None) -> None:
    """Mark `fed` what the step's data is, in its divergent records:

    - the ops run outside every module before the model's first module call of the step
      (loading, sampling, `torch.randn` of a synthetic batch, augmentation): the batch being
      made, so two runs (two DDP ranks) fed different batches differ there as data, not as
      a compute divergence of the op that made it;
    - forward inputs of integer dtype (token ids, labels, masks) that no earlier record of A's
      step holds (same dtype, element count and checksum): no recorded op made them, so they
      came from the data. A float input without a maker may be a weight (an op-level dump
      records no parameters), which is why only integers are marked.

    `rows`: one step's compared rows (dicts of the diff's columns); `recs_a`, `recs_b`: each
    side's records of that step (dicts of the /records columns). An integer input is not fed,
    and is `made`, where a recorded op of either run made that run's value (one run edits its
    labels in the loop), the model's own input included."""
    model_from = min((int(rec["seq"]) for rec in recs_a if rec["phase"] == "forward"
                      and str(rec["module"]) not in _OUTSIDE), default=None)
    if model_from is not None:
        # an op whose recorded inputs agree and whose output differs was called otherwise (a
        # constant from a config as its argument): computed, not fed
        inputs: dict[str, list[str]] = {}
        for r in rows:
            if r["direction"] == "input" and r["op"]:
                inputs.setdefault(call_stem(r), []).append(r["verdict"])
        # the first write in place only one run makes outside the model (a weight nudged
        # after the optimizer step, `p.data.add_`), by each run's seq: what reads after it
        # reads a tensor the loop computed, not the batch being made
        first_write = {"only_a": math.inf, "only_b": math.inf}
        for r in rows:
            if r["verdict"] in first_write and r["op"] and _updates_in_place(r) \
                    and str(r["module"]) in _OUTSIDE:
                seq = r["seq"] if r["verdict"] == "only_a" else r.get("b_seq", -1)
                if seq is not None and seq == seq and int(seq) >= 0:
                    first_write[r["verdict"]] = min(first_write[r["verdict"]], int(seq))
        for r in rows:
            if r["verdict"] == "diverged" and r["phase"] == "forward" and r["op"] \
                    and str(r["module"]) in _OUTSIDE and 0 <= int(r["seq"]) < model_from \
                    and not _updates_in_place(r) and not (
                        int(r["seq"]) > first_write["only_a"]
                        or int(r.get("b_seq", -1)) > first_write["only_b"]):
                given = inputs.get(call_stem(r))
                r["fed"] = r["direction"] == "input" or not given \
                    or any(v != "same" for v in given)
    wanted = [r for r in rows if r["verdict"] == "diverged" and r["phase"] == "forward"
              and r["direction"] == "input" and str(r["dtype"]).startswith(_INTEGER)]
    if not wanted:
        return
    made_a, made_b = _made(recs_a), _made(recs_b or [])
    by_seq = {int(rec["seq"]): rec for rec in recs_a}
    by_seq_b = {int(rec["seq"]): rec for rec in recs_b or []}
    for r in wanted:
        rec = by_seq.get(int(r["seq"]))
        if rec is None:
            continue
        maker = made_a.get((rec["dtype"], int(rec["numel"]), int(rec["checksum"])))
        r["fed"] = maker is None or maker > int(r["seq"])
        if not r["fed"]:
            # A's value made by a recorded op of A's (labels edited in place in the loop, an
            # index_put_ A runs and B does not): computed, even as the model's own input
            r["made"] = True
        rec_b = by_seq_b.get(int(r.get("b_seq", -1)))
        if r["fed"] and rec_b is not None:
            # likewise B's value made by a recorded op of B's
            maker_b = made_b.get((rec_b["dtype"], int(rec_b["numel"]), int(rec_b["checksum"])))
            if maker_b is not None and maker_b < int(rec_b["seq"]):
                r["fed"], r["made"] = False, True


def _batch_of(inputs: dict[tuple[int, int], dict[str, Any]] | None, first: dict[str, Any]
              ) -> dict[str, Any]:
    found = (inputs or {}).get((int(first.get("rank") or 0), int(first.get("step") or 0)))
    if not found or first["kind"] != "data":
        return {}
    return {"batch": found["batch"], "batch_detail": found["batch_detail"]}


def changes(dtype_pairs: dict[tuple[str, str], int], first_mixed: dict[str, Any] | None,
            first: dict[str, Any] | None, paired: int,
            setup: dict[str, Any] | None = None,
            inputs: dict[tuple[int, int], dict[str, Any]] | None = None
            ) -> list[dict[str, Any]]:
    """`DiffResult.changes` from what the diff gathered: how the runs were set up differently
    (`setup`, the earliest step pair whose setups differ: tracer.analysis._setup), matched
    records per (A dtype, B dtype) pair that differ, the first such record, the first
    divergence, and the matched records in all. The setup comes first: it was there before
    any record. `inputs` (by A's rank and step: tracer.analysis._setup.step_inputs) says of a
    first divergence in the data whether the model's own batch differs (`batch`, "same",
    "differs" or None where no setup says, and `batch_detail`)."""
    out: list[dict[str, Any]] = []
    if setup is not None:
        out.append({"kind": "setup", "rank": setup["rank"], "step": setup["step"],
                    "b_rank": setup["b_rank"], "b_step": setup["b_step"],
                    "differences": setup["differences"]})
    if dtype_pairs:
        ranked = sorted(dtype_pairs.items(), key=lambda kv: -kv[1])
        (a, b), n = ranked[0]
        where = first_mixed or {}
        out.append({"kind": "dtype", "a": a, "b": b, "records": n, "paired": paired,
                    "others": {f"{x}->{y}": k for (x, y), k in ranked[1:]},
                    "name": where.get("name"), "source": where.get("source"),
                    "step": where.get("step")})
    if first is not None and first["kind"] in ("data", "parameter"):
        out.append({"kind": first["kind"], "name": first["name"], "dtype": first["dtype"],
                    "shape": first.get("shape", ""), "source": first["source"],
                    "step": first["step"],
                    # the op that made the batch outside the model, "" for a recorded input
                    "made_by": first.get("op", "") if first.get("direction") == "output"
                    else "",
                    **_batch_of(inputs, first),
                    # a weight: whether the step's records date the difference (`param_when`)
                    **({k: first[k] for k in ("when", "write", "module") if k in first}
                       if "when" in first else {})})
    if first is not None and first["kind"] == "written":
        # the parameter written, by which op at which line, in which run
        out.append({"kind": "written", **first["written"], "record": first["name"],
                    "dtype": first["dtype"], "shape": first.get("shape", ""),
                    "step": first["step"]})
    return out
