"""A one-op repro of what `explain` blames: a script and an HDF5 file with the op's inputs.

The script needs only torch, numpy and h5py (not sleuth), so it can go with a bug report
upstream: `python repro_<op>.py` loads the reference run's inputs of the op, runs the op as
each run called it (B's call in B's dtypes, A's call in A's), and prints how far each is from
A's recorded output and from float64. The calls are written out as Python source from the
dumps' /calls specs; the tensors are stored as their raw bytes with dtype and shape, so a
bfloat16 or float8 input is the very bits the run had.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tracer._errors import TracerError
from tracer.analysis._explain_sides import b_over_a
from tracer.analysis._replay import CallSpec, recorded

_SCRIPT = '''"""One-op repro written by `sleuth explain --repro`: {what}

A (the reference) called:  {call_a}
B called:                  {call_b}
at {source} (module {module}, {phase}, step {step}).

Run: python {script}   (needs torch, numpy and h5py; reads {data})
"""
from pathlib import Path

import h5py
import numpy as np
import torch


def load(ds):
    """A tensor stored as its raw bytes, with its dtype and shape."""
    dtype = getattr(torch, ds.attrs["dtype"])
    shape = [int(d) for d in ds.attrs["shape"]]
    raw = torch.from_numpy(np.ascontiguousarray(ds[()]))
    return raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)


def call_a(x):
    return {code_a}


def call_b(x):
    return {code_b}


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm()) if ref.norm() > 0 else float((x - ref).norm())


def first(out):
    return out if isinstance(out, torch.Tensor) else out[0]


with h5py.File(Path(__file__).with_name("{data}"), "r") as f:
    inputs = [load(f[f"input_{{i}}"]) for i in range({n})]
    expected = load(f["a_output_0"])
b_dtypes = {b_dtypes}
a_out = first(call_a([t.clone() for t in inputs]))
b_out = first(call_b([t.clone().to(d) if d is not None else t.clone()
                      for t, d in zip(inputs, b_dtypes)]))
exact = first(call_a([t.clone().double() if t.is_floating_point() else t.clone()
                      for t in inputs]))
print("A's call on A's inputs vs A's recorded output: relative error", rel(a_out, expected))
print("B's call on A's inputs vs A's recorded output: relative error", rel(b_out, expected))
print("A's call in float64 vs A's recorded output:    relative error", rel(exact, expected))
print("B's call on A's inputs vs float64:             relative error", rel(b_out, exact))
'''


def write_repro(a: Any, b: Any, blamed: dict[str, Any], fd: dict[str, Any],
                out_dir: str | Path) -> tuple[Path, Path]:
    """Write `repro_<op>.py` and `repro_<op>.h5` for the blamed call into `out_dir`: A's
    inputs and recorded first output (rank and step of the first divergence), both calls.
    `a`, `b`: the two open Dumps. Returns (script, data). TracerError when the blamed call
    has no specs or inputs to write."""
    import h5py

    rank_a, step_a, rank_b, step_b = fd["rank"], fd["step"], fd["b_rank"], fd["b_step"]
    spec_a = _spec(a, rank_a, step_a, blamed["name"])
    spec_b = _spec(b, rank_b, step_b, blamed["b_name"])
    inputs = [recorded(a, rank_a, step_a, f"{blamed['name']}.input.{i}")
              for i in range(spec_a.inputs)]
    over_a = b_over_a(spec_a, spec_b)  # a call that lost an argument has fewer inputs in B
    if over_a is None:
        raise TracerError(f"B's call of {blamed['op']} passes a tensor where A's passes none: "
                          "a repro on A's inputs cannot run it")
    spec_b, b_of_a = over_a
    b_dtypes = [recorded(b, rank_b, step_b, f"{blamed['b_name']}.input.{b_of_a[i]}").dtype
                if i in b_of_a else None for i in range(spec_a.inputs)]
    expected = recorded(a, rank_a, step_a, f"{blamed['name']}.output.0")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "repro_" + re.sub(r"[^A-Za-z0-9_]+", "_", blamed["op"]).strip("_")
    script, data = out / f"{stem}.py", out / f"{stem}.h5"
    with h5py.File(data, "w") as f:
        for i, t in enumerate(inputs):
            _store(f, f"input_{i}", t)
        _store(f, "a_output_0", expected)
        f.attrs["spec_a"] = json.dumps(vars(spec_a))
        f.attrs["spec_b"] = json.dumps(vars(spec_b))
    call_a, call_b = _call(spec_a), _call(spec_b)
    script.write_text(_SCRIPT.format(
        what=f"{blamed['op']} ({blamed['name']}): {blamed.get('why', '')}",
        call_a=call_a, call_b=call_b, source=blamed.get("source") or "?",
        module=blamed.get("module", "?"), phase=blamed.get("phase", "?"), step=step_a,
        script=script.name, data=data.name, code_a=call_a, code_b=call_b,
        n=len(inputs), b_dtypes="[" + ", ".join(
            "None" if d is None else f"torch.{str(d).removeprefix('torch.')}"
            for d in b_dtypes) + "]"))
    return script, data


def _spec(dump: Any, rank: int, step: int, name: str) -> CallSpec:
    calls = dump.calls(rank, step)
    found = calls[calls["name"] == name]
    if not len(found):
        raise TracerError(f"no /calls record for {name}: no repro can be written")
    return CallSpec.parse(str(found["spec"].iloc[0]))


def _store(f: Any, key: str, t: Any) -> None:
    import torch

    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    ds = f.create_dataset(key, data=raw)
    ds.attrs["dtype"] = str(t.dtype).removeprefix("torch.")
    ds.attrs["shape"] = list(t.shape)


def _call(spec: CallSpec) -> str:
    """The call as Python source over `x` (the inputs): torch.ops.aten.add.Tensor(x[0], 1e-06)."""
    ns, _, rest = spec.op.partition(".")
    op, _, which = rest.rpartition(".")
    args = [_py(v) for v in spec.args] + [f"{k}={_py(v)}" for k, v in spec.kwargs.items()]
    return f"torch.ops.{ns}.{op}.{which}({', '.join(args)})"


def _py(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_py(x) for x in v) + "]"
    if not isinstance(v, dict):
        return repr(v)
    if "input" in v:
        return f"x[{int(v['input'])}]"
    if "float" in v:
        return f"float({v['float']!r})"
    if "device" in v:
        return "torch.device('cpu')"
    for key in ("dtype", "layout", "memory_format"):
        if key in v:
            return f"torch.{v[key]}"
    raise TracerError(f"an argument no repro can write: {v}")
