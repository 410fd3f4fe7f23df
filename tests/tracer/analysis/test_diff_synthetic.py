"""The diff on hand-built dumps (no torch): alignment with inserted ops, first divergence,
statistics-only comparison, cross-step/rank selection, errors. Also home of `write_step`, the
synthetic dump writer the other diff tests and the benchmark reuse."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tracer.storage._format import RECORD_FIELDS, root_attrs, step_path
from tracer.storage._step_file import StepFile

REPO = Path(__file__).resolve().parents[3]


def _stats(t: np.ndarray, dtype: str) -> dict:
    f = t.astype(np.float64).reshape(-1)
    width = t.dtype.itemsize
    signed = t.reshape(-1).view({1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[width])
    total = int(signed.astype(np.int64).sum(dtype=np.int64))
    bits = width * 8
    total = (total + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
    n = f.size
    return dict(numel=n, min=float(f.min()) if n else np.nan, max=float(f.max()) if n else np.nan,
                mean=float(f.mean()) if n else np.nan, norm=float(np.sqrt((f * f).sum())),
                nan=int(np.isnan(f).sum()), posinf=int(np.isposinf(f).sum()),
                neginf=int(np.isneginf(f).sum()), zeros=int((f == 0).sum()), checksum=total)


def rec(scope: str, phase: str, direction: str, tensor: np.ndarray, *, op: str = "",
        call: int = 0, index: int = 0, module: str | None = None, source: str = "model.py:1",
        dtype: str | None = None, caller: str = "") -> dict:
    """One record for `write_step`. `tensor` holds the stored bits (for bf16 pass uint16 bits
    and dtype="bfloat16")."""
    module = module if module is not None else scope
    full_scope = f"{scope}::{op}" if op else scope
    return dict(name=f"{full_scope}.{phase}.{call}.{direction}.{index}", module=module, op=op,
                phase=phase, direction=direction, index=index, call=call, tensor=tensor,
                dtype=dtype or str(tensor.dtype), source=source, caller=caller)


def write_step(run: Path, records: list[dict], *, rank: int = 0, step: int = 0,
               level: str = "op", mode: str = "tensor") -> Path:
    """Write RUN/dump/rank{rank}/step{step}.h5 with these records in this order."""
    sf = StepFile(step_path(run, rank, step),
                  root_attrs(rank=rank, world_size=2, step=step, level=level, mode=mode,
                             config={}), spill_bytes=1 << 30)
    for seq, r in enumerate(records):
        t = np.ascontiguousarray(r["tensor"])
        st = _stats(t.astype(np.float32) if r["dtype"] == "bfloat16" else t, r["dtype"])
        if r["dtype"] == "bfloat16":
            st = _stats((t.astype(np.uint32) << 16).view(np.float32), r["dtype"])
            st["checksum"] = _stats(t, "int16")["checksum"]
        off, nbytes = -1, 0
        if mode != "statistics":
            off, nbytes = sf.add_bytes(t.reshape(-1).view(np.uint8)), t.nbytes
        row = dict(r, seq=seq, shape=",".join(map(str, t.shape)), data_offset=off,
                   data_nbytes=nbytes, strides="", **st)
        sf.add_row(tuple(row[k] for k in RECORD_FIELDS))
    return sf.finish()


def model_records(x: np.ndarray, *, w: np.ndarray, insert_noop: bool = False,
                  eps: float = 1e-5) -> list[dict]:
    """A tiny forward of two linear layers with an add each, recorded at op level."""
    out = [rec("<root>", "forward", "input", x)]
    h = x
    for layer in range(2):
        m = f"layers.{layer}"
        y = h @ w
        out += [rec(m, "forward", "input", h, op="aten.mm"),
                rec(m, "forward", "output", y, op="aten.mm")]
        if insert_noop and layer == 0:
            out.append(rec(m, "forward", "output", y + 0.0, op="aten.add"))
        z = y + 1.0
        out.append(rec(m, "forward", "output", z, op="aten.add",
                       call=1 if insert_noop and layer == 0 else 0))
        n = z / np.sqrt((z * z).mean() + (eps if layer == 1 else 1e-5))
        out.append(rec(m, "forward", "output", n.astype(np.float32), op="aten.rms",
                       source=f"model.py:{10 + layer}"))
        h = n.astype(np.float32)
    return out


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((4, 8)).astype(np.float32), (
        rng.standard_normal((8, 8)) * 0.3).astype(np.float32)


def test_identical_dumps_same(tmp_path, data):
    import tracer

    x, w = data
    write_step(tmp_path / "a", model_records(x, w=w))
    write_step(tmp_path / "b", model_records(x, w=w))
    res = tracer.diff(tmp_path / "a", tmp_path / "b")
    assert res.status == "same" and res.first_divergence is None
    assert set(res.records["verdict"]) == {"same"} and res.compared == "tensor"
    assert (res.records["cosine"] == 1.0).all()


def test_inserted_noop_is_not_a_divergence(tmp_path, data):
    import tracer
    from tracer.analysis._align import align_by_name

    x, w = data
    write_step(tmp_path / "a", model_records(x, w=w))
    write_step(tmp_path / "b", model_records(x, w=w, insert_noop=True))
    res = tracer.diff(tmp_path / "a", tmp_path / "b")
    assert res.status == "same", res.records[["name", "b_name", "verdict", "reason"]]
    only_b = res.records[res.records["verdict"] == "only_b"]
    assert list(only_b["b_name"]) == ["layers.0::aten.add.forward.0.output.0"]
    # the exact-name join pairs A's `add` (call 0) with B's inserted no-op and would call it
    # diverged; that is what the sequence alignment avoids
    a = tracer.open_dump(tmp_path / "a").stats(0, 0)
    b = tracer.open_dump(tmp_path / "b").stats(0, 0)
    naive = [(i, j) for i, j in align_by_name(a, b) if i is not None and j is not None]
    wrong = [a["name"].iat[i] for i, j in naive
             if not np.allclose(tracer.open_dump(tmp_path / "a").tensor(0, 0, a["name"].iat[i]),
                                tracer.open_dump(tmp_path / "b").tensor(0, 0, b["name"].iat[j]))]
    assert wrong == ["layers.0::aten.add.forward.0.output.0"]


def test_parameter_records_pair_by_their_parameter(tmp_path):
    """A run that froze a LayerNorm's weight records only its bias: the bias pairs with the
    bias (whose values moved a little), never with the weight of the same shape that the other
    run recorded first."""
    import tracer

    weight, bias = np.ones(4, dtype=np.float32), np.full(4, 0.1, dtype=np.float32)

    def params(*named):
        return [rec(f"ln.{n}", "optimizer", d, t * (2 if d == "grad" else 1), module="ln")
                for n, t in named for d in ("param", "grad")]

    write_step(tmp_path / "a", params(("weight", weight), ("bias", bias)), level="module")
    write_step(tmp_path / "b", params(("bias", bias + np.float32(1e-3))), level="module")
    recs = tracer.diff(tmp_path / "a", tmp_path / "b").records
    partner = dict(zip(recs["name"], recs["b_name"]))
    assert partner == {"ln.weight.optimizer.0.param.0": "", "ln.weight.optimizer.0.grad.0": "",
                       "ln.bias.optimizer.0.param.0": "ln.bias.optimizer.0.param.0",
                       "ln.bias.optimizer.0.grad.0": "ln.bias.optimizer.0.grad.0"}, partner


def test_first_divergence_in_execution_order(tmp_path, data):
    import tracer

    x, w = data
    write_step(tmp_path / "a", model_records(x, w=w))
    write_step(tmp_path / "b", model_records(x, w=w, eps=0.5))
    res = tracer.diff(tmp_path / "a", tmp_path / "b")
    fd = res.first_divergence
    assert res.status == "diverged"
    assert fd["name"] == "layers.1::aten.rms.forward.0.output.0"
    assert fd["module"] == "layers.1" and fd["op"] == "aten.rms" and fd["phase"] == "forward"
    assert fd["source"] == "model.py:11" and fd["kind"] == "compute"
    assert fd["step"] == 0 and fd["rank"] == 0


def test_data_divergence(tmp_path, data):
    import tracer

    x, w = data
    write_step(tmp_path / "a", model_records(x, w=w))
    write_step(tmp_path / "b", model_records(x + 1, w=w))
    fd = tracer.diff(tmp_path / "a", tmp_path / "b").first_divergence
    assert fd["name"] == "<root>.forward.0.input.0" and fd["kind"] == "data"


def test_statistics_only_and_mixed(tmp_path, data):
    import tracer

    x, w = data
    write_step(tmp_path / "a", model_records(x, w=w), mode="statistics")
    write_step(tmp_path / "b", model_records(x, w=w, eps=0.5))
    res = tracer.diff(tmp_path / "a", tmp_path / "b")
    assert res.compared == "statistics" and any("statistics" in n for n in res.notes)
    assert res.first_divergence["name"] == "layers.1::aten.rms.forward.0.output.0"
    same = res.records[res.records["name"] == "layers.0::aten.mm.forward.0.output.0"].iloc[0]
    assert bool(same["checksum_equal"]) and same["verdict"] == "same"


def test_bf16_against_fp32_is_judged_with_bf16_tolerance(tmp_path):
    import tracer

    t = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    bits = ((t.view(np.uint32) + 0x7FFF + ((t.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
    write_step(tmp_path / "a", [rec("m", "forward", "output", t)])
    write_step(tmp_path / "b", [rec("m", "forward", "output", bits, dtype="bfloat16")])
    res = tracer.diff(tmp_path / "a", tmp_path / "b")
    assert res.status == "same"
    assert res.records["max_rel_err"].iat[0] > 1e-4  # the bf16 rounding is measured
    strict = tracer.diff(tmp_path / "a", tmp_path / "b", tolerance=tracer.Tolerance(rtol=1e-6,
                                                                                 atol=0.0))
    assert strict.status == "diverged"


def test_cross_rank_and_step(tmp_path, data):
    import tracer

    x, w = data
    write_step(tmp_path / "r", model_records(x, w=w), rank=0, step=3)
    write_step(tmp_path / "r", model_records(x, w=w * 1.01), rank=1, step=3)
    write_step(tmp_path / "r", model_records(x, w=w), rank=0, step=4)
    assert tracer.diff(tmp_path / "r", tmp_path / "r", step=3, b_step=4).status == "same"
    res = tracer.diff(tmp_path / "r", tmp_path / "r", step=3, b_rank=1)
    assert res.status == "diverged" and res.first_divergence["b_rank"] == 1
    with pytest.raises(tracer.TracerError, match="no rank 7"):
        tracer.diff(tmp_path / "r", tmp_path / "r", b_rank=7)
    with pytest.raises(tracer.TracerError, match="no step 9"):
        tracer.diff(tmp_path / "r", tmp_path / "r", step=9)
    # two step files are compared whatever their step numbers
    f0 = tmp_path / "r" / "dump" / "rank0" / "step3.h5"
    f1 = tmp_path / "r" / "dump" / "rank0" / "step4.h5"
    assert tracer.diff(f0, f1).status == "same"


def test_missing_path_and_unrelated_dumps(tmp_path, data):
    import tracer

    x, w = data
    with pytest.raises(tracer.TracerError, match="does not exist"):
        tracer.diff(tmp_path / "nope", tmp_path / "nope")
    write_step(tmp_path / "a", model_records(x, w=w))
    write_step(tmp_path / "b", [rec("other", "forward", "output", x)], level="module")
    with pytest.raises(tracer.TracerError, match="level op.*level module"):
        tracer.diff(tmp_path / "a", tmp_path / "b")


def test_diff_does_not_import_torch(tmp_path, data):
    x, w = data
    write_step(tmp_path / "a", model_records(x, w=w))
    write_step(tmp_path / "b", model_records(x, w=w, eps=0.5))
    code = ("import sys, tracer; r = tracer.diff(sys.argv[1], sys.argv[2]); "
            "assert r.status == 'diverged', r.status; "
            "h = tracer.check(sys.argv[1], watch=[{'condition': 'max_abs_gt', 'threshold': 0}]); "
            "assert len(h) > 0; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), str(tmp_path / "b")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_chunked_reads_bound_memory_and_match(tmp_path, monkeypatch):
    import tracemalloc

    import tracer
    import tracer.analysis._diff_record as d

    rng = np.random.default_rng(7)
    big = rng.standard_normal(1 << 22).astype(np.float32)  # 16 MiB
    other = big + np.float32(1e-3) * rng.standard_normal(big.size).astype(np.float32)
    other[5] = np.nan
    write_step(tmp_path / "a", [rec("m", "forward", "output", big)])
    write_step(tmp_path / "b", [rec("m", "forward", "output", other)])
    whole = tracer.diff(tmp_path / "a", tmp_path / "b").records.iloc[0]
    monkeypatch.setattr(d, "CHUNK_ELEMENTS", 1 << 16)
    tracemalloc.start()
    chunked = tracer.diff(tmp_path / "a", tmp_path / "b").records.iloc[0]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB for a 16 MiB tensor pair"
    for k in ("cosine", "max_abs_err", "max_rel_err", "rmse", "within", "nan_diff"):
        assert chunked[k] == pytest.approx(whole[k], rel=1e-5, nan_ok=True), k
    assert chunked["nan_diff"] == 1 and chunked["verdict"] == "diverged"
    # the NaN on one side: no cosine, unbounded error, never 1.0 and 0 from the finite rest
    assert np.isnan(chunked["cosine"]) and chunked["max_abs_err"] == np.inf
    assert chunked["reason"].startswith("NaN/Inf differ: A has 0 NaN"), chunked["reason"]


def test_a_record_only_b_has_is_ordered_within_its_own_step():
    """Sequence numbers restart every step: a B-only record follows the record before it in its
    own step, never one of another step with the same number."""
    from tracer.analysis._diff_result import _ordered

    def row(name, step, seq, b_seq):
        return {"name": name, "step": step, "seq": seq, "b_seq": b_seq, "phase": "forward",
                "direction": "output"}

    rows = [row(f"s{s}.r{i}", s, i, i if s == 0 or i < 2 else i + 1)
            for s in (0, 1) for i in range(4)] + [row("s1.extra", 1, -1, 2)]
    first = row("s0.extra", 0, -1, 0)  # before every matched record of its step
    rows = [{**r, "b_seq": r["b_seq"] + (1 if r["step"] == 0 and r["seq"] >= 0 else 0)}
            for r in rows] + [first]
    names = [r["name"] for r in _ordered(rows)]
    assert names == ["s0.extra", "s0.r0", "s0.r1", "s0.r2", "s0.r3",
                     "s1.r0", "s1.r1", "s1.extra", "s1.r2", "s1.r3"]
