"""Re-run a recorded op call on recorded tensors: the call's spec (/calls, written by op-level
dumps in tensor or full mode: tracer.capture._calls) and its input records.

`replay(spec, inputs, dtypes)` runs the same overload with the same non-tensor arguments on the
given inputs, on the device the call ran on when this process has it (else the CPU, and the
caller says so), cast to the given dtypes (a reference's inputs in the other run's precision, or in
float64 for the rounding-free answer). Nothing is unpickled: the spec is JSON and the tensors are
the dump's bytes.

Some calls cannot be re-run and are named, never guessed: random ops (torch tags them
`nondeterministic_seeded` and two re-runs differ: their generator state is not recorded; a
seeded op that draws nothing, a dropout of p 0, re-runs), collectives (their result
depends on the other ranks), calls with an argument the spec could not hold (`opaque`), and
overloads this torch does not have. A call whose inputs were not all recorded (an
uninitialised buffer, a statistics dump) cannot be re-run either.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from tracer._errors import TracerError
from tracer.storage import loads_bounded

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


class NotReplayable(TracerError):
    """A recorded call that cannot be re-run; the message says why."""


@dataclass(frozen=True)
class CallSpec:
    """One recorded call: its overload's name and its arguments (tensors as input indices)."""

    op: str
    args: list
    kwargs: dict

    @classmethod
    def parse(cls, text: str) -> "CallSpec":
        try:
            data = loads_bounded(text, "a /calls spec")
            return cls(str(data["op"]), list(data["args"]), dict(data["kwargs"]))
        except (ValueError, KeyError, TypeError) as e:
            raise NotReplayable(f"its /calls spec does not read ({e}): {text[:200]}") from e

    @property
    def inputs(self) -> int:
        """How many tensor inputs the call takes."""
        return _count(self.args) + _count(list(self.kwargs.values()))

    @property
    def device(self) -> str:
        """Where the call ran: its first tensor input's device ("cpu" when none is named)."""
        return _device(self.args) or _device(list(self.kwargs.values())) or "cpu"


def _device(values: list) -> str | None:
    for v in values:
        if isinstance(v, dict) and "input" in v:
            return str(v.get("device", "cpu"))
        if isinstance(v, list) and (found := _device(v)) is not None:
            return found
    return None


def replay_device(spec: CallSpec) -> str:
    """Where `replay` runs `spec`: the device it ran on when this process has it, else the
    CPU (the caller says so: a GPU kernel may round differently from the CPU's)."""
    return _here(spec.device)


@functools.lru_cache(maxsize=None)
def _here(device: str) -> str:
    """`device` when this process can run on it, else "cpu" (a meta tensor has no values to
    re-run on); asked once per device name."""
    import torch

    if device == "cpu" or device.startswith("meta"):
        return "cpu"
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError):
        return "cpu"
    return device


def _count(values: list) -> int:
    n = 0
    for v in values:
        if isinstance(v, dict) and "input" in v:
            n += 1
        elif isinstance(v, list):
            n += _count(v)
    return n


def recorded(dump: Any, rank: int, step: int, name: str) -> Any:
    """Record `name`'s tensor (torch, its logical dtype) for a re-run; NotReplayable when the
    dump holds no bytes for it."""
    try:
        return dump.tensor_torch(rank, step, name)
    except (TracerError, KeyError, ValueError) as e:
        raise NotReplayable(f"{name} has no record with its bytes (uninitialised memory the "
                            f"op writes, left out by design, or a dump without tensors: "
                            f"{type(e).__name__})") from e


def overload(name: str) -> Any:
    """The torch overload "aten.addmm.default" names; NotReplayable when there is none."""
    import torch

    ns, _, rest = name.partition(".")
    op, _, which = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), which)
    except (AttributeError, RuntimeError) as e:
        raise NotReplayable(f"{name}: no such overload in this torch ({torch.__version__})") from e


def why_not(spec: CallSpec) -> str | None:
    """Why `spec` cannot be re-run, or None when it can (a random op is known only by re-running
    it twice: `replay`)."""
    ns = spec.op.split(".", 1)[0]
    if ns in _COLLECTIVE_NAMESPACES:
        return "a collective: its result depends on the other ranks"
    if _has(spec.args, "opaque") or _has(list(spec.kwargs.values()), "opaque"):
        return "an argument the dump could not record (a generator, an object)"
    try:
        overload(spec.op)
    except NotReplayable as e:
        return str(e)
    return None


def _seeded(spec: CallSpec) -> bool:
    import torch

    return torch.Tag.nondeterministic_seeded in getattr(overload(spec.op), "tags", ())


def _has(values: list, key: str) -> bool:
    for v in values:
        if isinstance(v, dict) and key in v:
            return True
        if isinstance(v, list) and _has(v, key):
            return True
    return False


def replay(spec: CallSpec, inputs: list[Any], dtypes: list[Any] | None = None,
           float64: bool = False) -> list[Any]:
    """The tensor outputs (on the CPU) of `spec` run on `inputs` (torch tensors, in input record
    order), on `replay_device(spec)`:
    each cast to `dtypes[i]` when given (None keeps it), or every floating one to float64 with
    `float64` (dtype arguments that name a floating type then read float64 too, so the call
    computes in float64 throughout). In-place calls write copies. NotReplayable when the call
    cannot be re-run (see `why_not`; a random op that draws: its two re-runs differ)."""
    reason = why_not(spec)
    if reason is not None:
        raise NotReplayable(reason)
    if len(inputs) != spec.inputs:
        raise NotReplayable(f"the call takes {spec.inputs} tensor input(s), {len(inputs)} given")
    outs = _run(spec, inputs, dtypes, float64)
    if _seeded(spec):  # a random op re-runs only where it draws nothing (a dropout of p 0)
        again = _run(spec, inputs, dtypes, float64)
        if len(again) != len(outs) or any(rel_error(x, y) != 0.0 for x, y in zip(again, outs)):
            raise NotReplayable("a random op: two re-runs differ, and its generator state is "
                                "not recorded")
    return outs


def _run(spec: CallSpec, inputs: list[Any], dtypes: list[Any] | None,
         float64: bool) -> list[Any]:
    """One run of `spec` on copies of `inputs` (an in-place op writes the copies)."""
    import torch

    ready = []
    where = replay_device(spec)
    for i, t in enumerate(inputs):
        t = t.clone().to(where)
        if float64 and t.is_floating_point():
            t = t.to(torch.float64)
        elif dtypes is not None and dtypes[i] is not None and t.dtype != dtypes[i]:
            t = t.to(dtypes[i])
        ready.append(t)
    args = [_decode(a, ready, float64) for a in spec.args]
    kwargs = {k: _decode(v, ready, float64) for k, v in spec.kwargs.items()}
    try:
        out = overload(spec.op)(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        raise NotReplayable(f"{spec.op} did not run on the recorded inputs: {e}") from e
    if isinstance(out, torch.Tensor):
        return [out.cpu()]
    if isinstance(out, (list, tuple)):
        return [t.cpu() for t in out if isinstance(t, torch.Tensor)]
    return []


def _decode(v: Any, inputs: list[Any], float64: bool) -> Any:
    import torch

    if isinstance(v, list):
        return [_decode(x, inputs, float64) for x in v]
    if not isinstance(v, dict):
        return v
    if "input" in v:
        return inputs[int(v["input"])]
    if "float" in v:
        return float(v["float"])
    if "dtype" in v:
        dtype = getattr(torch, v["dtype"])
        return torch.float64 if float64 and dtype.is_floating_point else dtype
    if "device" in v:
        return torch.device(_here(v["device"]))
    if "layout" in v:
        return getattr(torch, v["layout"])
    if "memory_format" in v:
        return getattr(torch, v["memory_format"])
    raise NotReplayable(f"an argument the spec cannot rebuild: {v}")


def rel_error(x: Any, ref: Any) -> float:
    """||x - ref|| / ||ref|| in float64 (NaN where the shapes differ; inf where ref is zero
    and x is not; NaN/Inf positions that agree count as equal)."""
    import torch

    if tuple(x.shape) != tuple(ref.shape):
        return math.nan
    a, b = x.detach().to(torch.float64).flatten(), ref.detach().to(torch.float64).flatten()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    a, b = torch.where(same, 0.0, a), torch.where(same, 0.0, b)
    diff = float(torch.linalg.vector_norm(a - b))
    scale = float(torch.linalg.vector_norm(ref.detach().to(torch.float64).nan_to_num(
        0.0, 0.0, 0.0)))
    if diff == 0.0:
        return 0.0
    if not math.isfinite(diff):
        return math.inf
    return diff / scale if scale > 0 else math.inf
