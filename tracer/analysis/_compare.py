"""Per-record comparison of two dumps: tolerances, dtype decoding and streamed error metrics.

Everything here is numpy only (no torch), so a diff runs where torch is not even installed.
Tensors arrive as chunks of raw bytes; bf16 and fp8 are decoded from their bits. Metrics are
accumulated chunk by chunk, so a tensor larger than RAM costs one chunk of memory.

Conventions (documented in docs/diff.md):
- errors are measured on elements finite in both tensors; NaN/Inf positions that differ are
  counted separately (`nan_diff`, `inf_diff`), make the record diverge, and set the cosine to
  NaN and the max errors to inf (the finite rest alone would look the same);
- relative error is symmetric: |a - b| / max(|a|, |b|) (0 where both are 0), in [0, 2];
- an element is within tolerance when |a - b| <= atol + rtol * max(|a|, |b|);
- `error`, the one number records are ranked by, is relative to the whole tensor:
  ||a - b|| / max(||a||, ||b||) (0 when both are all zero), in [0, 2]; unlike the relative error
  of single elements it is not made large by elements near zero, and unlike the cosine it sees
  a change of scale.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracer._errors import ConfigError, TracerError
from tracer.storage import decode_bits, element_size, sketch_positions

# (rtol, atol, cosine_min) per dtype family, loosest last. A pair is judged with the looser of
# its two dtypes, so fp32 against bf16 gets bf16's tolerance instead of a sea of false alarms.
DTYPE_DEFAULTS: dict[str, tuple[float, float, float]] = {
    "int": (0.0, 0.0, 1.0),
    "float64": (1e-7, 1e-7, 1.0 - 1e-10),
    "float32": (1e-5, 1e-5, 1.0 - 1e-5),
    "float16": (2e-3, 1e-3, 0.9999),
    "bfloat16": (1.6e-2, 1e-2, 0.999),
    "float8": (0.25, 0.05, 0.99),
}
_LOOSENESS = list(DTYPE_DEFAULTS)

def dtype_family(dtype: str) -> str:
    """The tolerance family of a logical dtype name ("bfloat16" -> "bfloat16", "int8" -> "int")."""
    if dtype.startswith("float8"):
        return "float8"
    if dtype in ("float64", "float32", "float16", "bfloat16"):
        return dtype
    if dtype == "complex128":
        return "float64"
    if dtype.startswith("complex"):
        return "float32"
    return "int"


def itemsize(dtype: str) -> int:
    """Bytes per element of a logical dtype name."""
    size = element_size(dtype)
    if not size:
        raise TracerError(f"cannot compare dtype {dtype!r}: numpy cannot decode it; compare "
                          f"with Dump.tensor_torch() in Python instead")
    return size


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """When two records count as the same. Unset fields take the per-dtype default
    (DTYPE_DEFAULTS) of the looser dtype of the pair."""

    rtol: float | None = None
    """Relative tolerance per element: |a - b| <= atol + rtol * max(|a|, |b|)."""
    atol: float | None = None
    """Absolute tolerance per element."""
    cosine_min: float | None = None
    """Smallest cosine similarity that still counts as the same."""

    def __post_init__(self) -> None:
        for key in ("rtol", "atol", "cosine_min"):
            value = getattr(self, key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ConfigError(f"{key}: expected a number, got {value!r}")
            if key != "cosine_min" and value < 0:
                raise ConfigError(f"{key}: must be >= 0, got {value}")
            if key == "cosine_min" and not -1.0 <= value <= 1.0:
                raise ConfigError(f"cosine_min: must lie in [-1, 1], got {value}")

    def resolve(self, dtype_a: str, dtype_b: str) -> tuple[float, float, float]:
        """(rtol, atol, cosine_min) for a pair of dtypes: explicit values win, else the default
        of the looser dtype."""
        return _resolve(self.rtol, self.atol, self.cosine_min, dtype_a, dtype_b)


@functools.lru_cache(maxsize=256)  # called once per record: a dump has few dtype pairs
def _resolve(rtol: float | None, atol: float | None, cosine_min: float | None, dtype_a: str,
             dtype_b: str) -> tuple[float, float, float]:
    fam = max(dtype_family(dtype_a), dtype_family(dtype_b), key=_LOOSENESS.index)
    r, a, c = DTYPE_DEFAULTS[fam]
    return (r if rtol is None else float(rtol), a if atol is None else float(atol),
            c if cosine_min is None else float(cosine_min))


# -- decoding --------------------------------------------------------------------------------------
def decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Decode a 1-D uint8 array of raw element bytes into a numeric numpy array: floats stay
    float (bf16/fp8 become float32, exactly), ints and bool become float64, complex becomes its
    interleaved real/imaginary float parts."""
    arr = decode_bits(raw, dtype, (-1,))  # the reader's decoding: one table per float8 format
    if dtype.startswith("complex"):
        return arr.view(np.float64 if dtype == "complex128" else np.float32)
    if dtype == "float16":
        return arr.astype(np.float32)
    if dtype in ("float64", "float32", "bfloat16") or dtype.startswith("float8"):
        return arr
    return arr.astype(np.float64)


# -- streamed tensor metrics -----------------------------------------------------------------------
_SUB = 1 << 15  # elements per inner pass: the temporaries stay in L2 (best of 2^14..2^17)


class TensorMetrics:
    """Accumulates error metrics over pairs of aligned chunks of two tensors."""

    def __init__(self, rtol: float, atol: float) -> None:
        self.rtol, self.atol = rtol, atol
        self.n = self.finite = self.within = self.nan_diff = self.inf_diff = 0
        self.sse = self.sae = self.sq_a = self.sq_b = 0.0
        self.max_abs = self.max_rel = 0.0
        self.identical = True

    def add_raw(self, ra: np.ndarray, rb: np.ndarray, dtype_a: str, dtype_b: str,
                norms: bool = True) -> bool:
        """Add one chunk given as raw bytes (uint8) of equal element counts; True when the two
        chunks hold the same bits. `norms=False` is allowed when this chunk is the whole
        tensor: equal bits then need no measuring at all."""
        if dtype_a == dtype_b and ra.nbytes == rb.nbytes and _bytes_equal(ra, rb):
            n = ra.nbytes // itemsize(dtype_a)
            self.n += n
            self.within += n
            if not norms:
                return True  # the whole tensor is this one chunk: nothing to measure
            a = decode(ra, dtype_a)
            with np.errstate(invalid="ignore", over="ignore"):
                sq = float(np.dot(a, a))
                if not math.isfinite(sq):  # NaN/Inf (in the same places) or float32 overflow
                    a = a[np.isfinite(a)].astype(np.float64)
                    sq = float(np.dot(a, a))
            self.finite += int(a.size)
            self.sq_a += sq
            self.sq_b += sq
            return True
        self.identical = False
        self.add(decode(ra, dtype_a), decode(rb, dtype_b))
        return False

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        """Add one chunk given as decoded numeric arrays of equal length."""
        if a.size != b.size:
            raise TracerError(f"internal: chunk sizes differ ({a.size} vs {b.size})")
        work = np.float64 if np.float64 in (a.dtype, b.dtype) else np.float32
        a = a.astype(work, copy=False)
        b = b.astype(work, copy=False)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf are counted, not warned
            for i in range(0, a.size, _SUB):
                self._add(a[i:i + _SUB], b[i:i + _SUB])

    def _add(self, a: np.ndarray, b: np.ndarray) -> None:
        self.n += a.size
        d = a - b
        sse = float(np.dot(d, d))
        if not math.isfinite(sse):
            # NaN/Inf somewhere (they propagate through the difference): the slow path runs
            # only on chunks that hold them.
            nan_a, nan_b = np.isnan(a), np.isnan(b)
            inf_a, inf_b = np.isinf(a), np.isinf(b)
            self.nan_diff += int(np.count_nonzero(nan_a != nan_b))
            self.inf_diff += int(np.count_nonzero((inf_a | inf_b) & (a != b) & ~(nan_a | nan_b)))
            both_nonfinite_same = (nan_a & nan_b) | ((inf_a | inf_b) & (a == b))
            self.within += int(np.count_nonzero(both_nonfinite_same))
            fin = ~(nan_a | nan_b | inf_a | inf_b)
            a, b = a[fin].astype(np.float64), b[fin].astype(np.float64)
            d = a - b
            sse = float(np.dot(d, d))
        self.finite += a.size
        if a.size == 0:
            return
        self.sse += sse
        self.sq_a += float(np.dot(a, a))
        self.sq_b += float(np.dot(b, b))
        if sse == 0.0:
            self.within += a.size
            return
        self.identical = False
        np.abs(d, out=d)
        self.max_abs = max(self.max_abs, float(d.max()))
        self.sae += float(d.sum())  # numpy sums pairwise: float32 is accurate enough here
        m = np.maximum(np.abs(a), np.abs(b))
        np.maximum(m, np.finfo(m.dtype).tiny, out=m)
        thr = m * self.rtol
        thr += self.atol
        self.within += int(np.count_nonzero(d <= thr))
        np.divide(d, m, out=d)
        self.max_rel = max(self.max_rel, float(d.max()))

    def result(self) -> dict[str, Any]:
        """The metrics as a dict of plain floats and ints."""
        na, nb = math.sqrt(self.sq_a), math.sqrt(self.sq_b)
        if na == 0.0 and nb == 0.0:
            cosine = 1.0
        elif na == 0.0 or nb == 0.0:
            cosine = 0.0
        else:
            # 1 - cos from the squared error keeps its precision when a ~ b, where a plain
            # dot product loses it (float32 dot of near-equal vectors rounds to 1.0)
            cosine = 1.0 - (self.sse - (na - nb) ** 2) / (2.0 * na * nb)
            cosine = max(-1.0, min(1.0, cosine))
        f = max(self.finite, 1)
        max_abs, max_rel = self.max_abs, self.max_rel
        error = math.sqrt(self.sse) / max(na, nb) if self.sse else 0.0
        if self.nan_diff or self.inf_diff:
            # a NaN or an infinity against a number: no angle, no bounded error (the finite
            # elements alone would say cosine 1 and error 0 for a tensor that is not the same)
            cosine, max_abs, max_rel, error = math.nan, math.inf, math.inf, math.inf
        return {
            "error": error,
            "cosine": cosine,
            "max_abs_err": max_abs,
            "max_rel_err": max_rel,
            "mean_abs_err": self.sae / f,
            "rmse": math.sqrt(self.sse / f),
            "within": self.within / self.n if self.n else 1.0,
            # the larger side's RMS over the finite elements (see judge_tensor)
            "rms": max(na, nb) / math.sqrt(f),
            "nan_diff": self.nan_diff,
            "inf_diff": self.inf_diff,
            "identical": self.identical,
        }


def _bytes_equal(ra: np.ndarray, rb: np.ndarray) -> bool:
    if ra.nbytes % 8 == 0 and ra.ctypes.data % 8 == 0 and rb.ctypes.data % 8 == 0:
        return bool(np.array_equal(ra.view(np.uint64), rb.view(np.uint64)))
    return bool(np.array_equal(ra, rb))


def compare_arrays(a: np.ndarray, b: np.ndarray, tol: Tolerance | None = None,
                   dtype_a: str | None = None, dtype_b: str | None = None) -> dict[str, Any]:
    """Compare two in-memory numeric arrays (any shape, same numel) and return the metrics plus
    `verdict` ("same" or "diverged") and `reason`. For tests and small tensors."""
    tol = tol or Tolerance()
    da, db = dtype_a or str(a.dtype), dtype_b or str(b.dtype)
    rtol, atol, cos_min = tol.resolve(da, db)
    acc = TensorMetrics(rtol, atol)
    if a.size != b.size:
        raise TracerError(f"cannot compare {a.size} elements with {b.size}")
    acc.identical = False
    acc.add(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1))
    out = acc.result()
    out.update(judge_tensor(out, cos_min, atol))
    return out


def judge_tensor(m: dict[str, Any], cosine_min: float, atol: float = 0.0) -> dict[str, str]:
    """Verdict of tensor metrics: every element within tolerance, NaN/Inf where the other side
    has them too, and cosine at least `cosine_min`, where the cosine means something: not when
    both sides' RMS is at most `atol` (rounding noise around zero, such as the gradient of a
    bias that a following BatchNorm cancels, points anywhere), and the elements decide."""
    reasons = []
    if m["nan_diff"] or m["inf_diff"]:
        reasons.append(f"NaN/Inf differ at {m['nan_diff'] + m['inf_diff']} elements")
    if m["within"] < 1.0:
        err = "" if math.isinf(m["max_abs_err"]) else f" (max abs err {m['max_abs_err']:.3g})"
        reasons.append(f"{(1.0 - m['within']) * 100:.3g}% of elements out of tolerance{err}")
    if m["cosine"] < cosine_min and m.get("rms", math.inf) > atol:  # False for NaN
        reasons.append(f"cosine {m['cosine']:.6g} < {cosine_min:.6g}")
    return {"verdict": "diverged" if reasons else "same", "reason": "; ".join(reasons)}


def nonfinite_differ(a: dict[str, Any], b: dict[str, Any]) -> str:
    """"NaN/Inf differ: A has ... B has ..." from two statistics rows' counts."""
    def side(r: dict[str, Any]) -> str:
        return f"{int(r['nan'])} NaN, {int(r['posinf'])} +Inf, {int(r['neginf'])} -Inf"
    return f"NaN/Inf differ: A has {side(a)}, B has {side(b)}"


# -- statistics ------------------------------------------------------------------------------------
def _rel(x: float, y: float, scale: float) -> float:
    if x == y or (math.isnan(x) and math.isnan(y)):
        return 0.0
    if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
        return math.inf
    return abs(x - y) / scale if scale > 0 else math.inf


def compare_stats(a: dict[str, Any], b: dict[str, Any], tol: Tolerance) -> dict[str, Any]:
    """Compare two records by their statistics rows (min, max, mean, norm, NaN/Inf counts,
    checksum) when at least one side stored no tensor bytes."""
    rtol, atol, _ = tol.resolve(str(a["dtype"]), str(b["dtype"]))
    same_dtype = a["dtype"] == b["dtype"]
    checksum_equal = bool(same_dtype and int(a["checksum"]) == int(b["checksum"]))
    out: dict[str, Any] = {"checksum_equal": checksum_equal if same_dtype else None}
    n = max(int(a["numel"]), 1)
    rms = max(abs(float(a["norm"])), abs(float(b["norm"]))) / math.sqrt(n)
    reasons = []
    for key in ("min", "max", "mean", "norm"):
        x, y = float(a[key]), float(b[key])
        scale = rms if key == "mean" else max(abs(x), abs(y))
        # relative to the tensor's RMS for the mean, which may sit near zero by cancellation
        rel = _rel(x, y, scale)
        out[f"{key}_rdiff"] = rel
        if not (rel == 0.0 or abs(x - y) <= atol + rtol * scale):
            reasons.append(f"{key} {x:.6g} vs {y:.6g}")
    out["nan_diff"] = abs(int(a["nan"]) - int(b["nan"]))
    out["inf_diff"] = (abs(int(a["posinf"]) - int(b["posinf"]))
                       + abs(int(a["neginf"]) - int(b["neginf"])))
    if out["nan_diff"] or out["inf_diff"]:
        reasons.insert(0, nonfinite_differ(a, b))
    if checksum_equal and reasons:
        # the checksum adds the elements' bits, which some changes keep (every float32
        # element of 512 times k scaled by a power of two): the statistics say the values
        # differ, and an equal checksum never makes them "same"
        reasons = [f"{'; '.join(reasons)} (the checksums are equal: a sum of the elements' "
                   f"bits, which some changes keep, such as every element scaled by a power "
                   f"of two)"]
    out["error"] = 0.0 if checksum_equal and not reasons else (
        math.inf if out["nan_diff"] or out["inf_diff"]
        else max(out[f"{key}_rdiff"] for key in ("min", "max", "mean", "norm")))
    out["verdict"] = "diverged" if reasons else "same"
    out["reason"] = "; ".join(reasons)
    return out



_SAME_SKETCH = {"error": 0.0, "cosine": 1.0, "max_abs_err": 0.0, "max_rel_err": 0.0,
                "mean_abs_err": 0.0, "rmse": 0.0, "within": 1.0, "rms": math.nan, "nan_diff": 0,
                "inf_diff": 0, "identical": True, "verdict": "same", "reason": ""}


def compare_sketch(sa: np.ndarray, sb: np.ndarray, numel: int, dtype_a: str, dtype_b: str,
                   tol: Tolerance) -> dict[str, Any]:
    """Compare two records' sketches (tracer.storage._sketch: the same positions on both sides
    for the same `numel`) element by element, as `compare_arrays` compares tensors: the error
    metrics of the sampled elements (estimates of the whole tensor's), `verdict` and
    `reason`. A sampled element out of tolerance is a real element out of tolerance."""
    k = len(sketch_positions(numel))
    if np.array_equal(sa[:k], sb[:k], equal_nan=True):  # the common case, at a tenth the cost
        return dict(_SAME_SKETCH)
    rtol, atol, cos_min = tol.resolve(dtype_a, dtype_b)
    acc = TensorMetrics(rtol, atol)
    acc.add(np.asarray(sa[:k], dtype=np.float64), np.asarray(sb[:k], dtype=np.float64))
    out = acc.result()
    out.update(judge_tensor(out, cos_min, atol))
    if out["verdict"] == "diverged":
        reason = out["reason"].replace("% of elements out of", "% of them out of")
        out["reason"] = f"{k} sampled elements: {reason}"
    return out
