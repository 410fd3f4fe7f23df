"""`tracer.audit`: how much precision each op of one run loses, without a reference run.

Every op call of a recorded step (an op-level dump in tensor or full mode keeps its inputs and
its spec, /calls) is re-run in float64 on its recorded inputs, and its recorded outputs are
compared with that: the relative error an op adds on its own inputs, in units of its output
dtype's unit roundoff. A float32 op near 1 unit is as exact as float32 allows; a bf16 matmul at
many units loses more than its dtype must (a long reduction in low precision); ops far above
the rest are where a float32 island would help, and where a bf16 run starts to drift.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from tracer._errors import TracerError
from tracer.analysis._replay import CallSpec, NotReplayable, recorded, rel_error, replay

AUDIT_COLUMNS = ("name", "op", "module", "phase", "source", "dtype", "rel_error",
                 "unit_roundoff", "units")


@dataclass
class AuditResult:
    """What `audit` measured: one row per recorded output of a re-run call, worst first."""

    rank: int
    step: int
    table: Any
    """DataFrame (AUDIT_COLUMNS): `units` = rel_error / unit_roundoff, worst first."""
    calls: int = 0
    """Calls the step recorded."""
    not_replayed: list[dict[str, str]] = field(default_factory=list)
    """{name, why} of each call that could not be re-run (random, collective, inputs not
    kept, ...): named, never left out silently."""

    def to_dict(self) -> dict[str, Any]:
        rows = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in r.items()} for r in self.table.to_dict("records")]
        return {"rank": self.rank, "step": self.step, "calls": self.calls,
                "replayed": self.calls - len(self.not_replayed), "ops": rows,
                "not_replayed": self.not_replayed}


def audit(path: str | os.PathLike, *, step: int | None = None, rank: int = 0) -> AuditResult:
    """Re-run every recorded op call of one step in float64 and rank its outputs by the error
    the op added, in units of its dtype's roundoff (module doc). `step` None: the rank's first
    step. Raises TracerError when the dump holds no call specs (not op level in tensor or
    full mode) or the rank or step is not there."""
    import pandas as pd
    import torch

    from tracer.storage import open_dump

    dump = open_dump(path)
    try:
        if rank not in dump.ranks:
            raise TracerError(f"no rank {rank} in {path} (ranks: {dump.ranks})")
        steps = dump.steps(rank)
        step = steps[0] if step is None and steps else step
        if step not in steps:
            raise TracerError(f"rank {rank} has no step {step} (steps: {steps})")
        calls = dump.calls(rank, step)
        if not len(calls):
            raise TracerError(f"{path} rank {rank} step {step} holds no op call specs "
                              "(/calls): an audit re-runs ops, so dump at level op (or mix) "
                              'with {"mode": "tensor"} (or "full")')
        rows, skipped = [], []
        for name, text in zip(calls["name"], calls["spec"]):
            try:
                spec = CallSpec.parse(text)
                inputs = [recorded(dump, rank, step, f"{name}.input.{i}")
                          for i in range(spec.inputs)]
                exact = replay(spec, inputs, float64=True)
            except NotReplayable as e:
                skipped.append({"name": name, "why": str(e)})
                continue
            for j, ref in enumerate(exact):
                try:
                    out = dump.tensor_torch(rank, step, f"{name}.output.{j}")
                    meta = dump.record(rank, step, f"{name}.output.{j}")
                except (TracerError, KeyError, ValueError):
                    continue  # an output the dump left out (an uninitialised buffer)
                if not out.is_floating_point():
                    continue  # integers and booleans are exact or wrong, not rounded
                unit = float(torch.finfo(out.dtype).eps) / 2
                err = rel_error(out, ref)
                rows.append({"name": f"{name}.output.{j}", "op": meta["op"],
                             "module": meta["module"], "phase": meta["phase"],
                             "source": meta["source"], "dtype": meta["dtype"],
                             "rel_error": err, "unit_roundoff": unit,
                             "units": err / unit if math.isfinite(err) else err})
    finally:
        dump.close()
    table = pd.DataFrame(rows, columns=list(AUDIT_COLUMNS))
    table = table.sort_values("units", ascending=False, kind="stable", na_position="last")
    return AuditResult(rank=rank, step=int(step), table=table.reset_index(drop=True),
                       calls=len(calls), not_replayed=skipped)

