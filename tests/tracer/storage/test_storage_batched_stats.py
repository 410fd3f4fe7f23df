"""The multi-tensor statistics kernel (tracer.storage._batched_stats) and the batched records
(tracer.storage._batcher) against the torch-op reference, on CPU through Triton's interpreter,
and (marked `cuda`) on a device."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tracer.storage import _batched_stats as kernel
from tracer.storage._batcher import Deferred
from tracer.storage._device_stats import decode_packed, device_stats, element_bits
from tracer.storage._sampling import with_sketch

triton = pytest.importorskip("triton")

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
       if d is not None]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter, for kernels run on CPU tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def reference(t: torch.Tensor) -> dict:
    """`device_stats` with its sketch by torch ops alone (no Triton), decoded."""
    from tracer.storage import _cuda_stats

    keep, _cuda_stats._kernels = _cuda_stats._kernels, False
    try:
        return decode_packed(with_sketch(device_stats(t), t).cpu().tolist(),
                             element_bits(t.dtype))
    finally:
        _cuda_stats._kernels = keep


def batched(tensors: list[torch.Tensor], **sizes) -> list[dict]:
    descriptors = [kernel.describe(t) for t in tensors]
    slab = kernel.launch(descriptors, tensors[0].device, True, **sizes)
    return kernel.decode(slab.cpu().numpy(), [t.dtype for t in tensors])


def assert_same(got: dict, want: dict, what) -> None:
    """Min, max, counts, checksum and sketch exactly; mean and norm to float64 rounding of
    sums taken in another order."""
    assert set(got) == set(want), what
    for key, b in want.items():
        a = got[key]
        if key == "sketch":
            np.testing.assert_array_equal(a, b, err_msg=str(what))
        elif key in ("mean", "norm") and math.isfinite(b):
            assert a == pytest.approx(b, rel=1e-9, abs=1e-12), (what, key)
        elif isinstance(b, float) and math.isnan(b):
            assert math.isnan(a), (what, key, a)
        else:
            assert a == b, (what, key, a, b)


def sample(dtype: torch.dtype, n: int, special: bool, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g, dtype=torch.float64) * 30
        if special and n > 200:
            x[5], x[7], x[100:150], x[n - 3] = math.inf, -math.inf, 0, math.nan
        elif special:
            x[0] = 0
        return x.to(dtype).to(device)
    lo, hi = (0, 2) if dtype == torch.bool else (-100, 100) if dtype != torch.uint8 else (0, 255)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype).to(device)


def _every_dtype_case(device: str) -> None:
    tensors = [sample(d, n, s, device) for d in FLOATS + FP8 + INTS
               for n in (1, 7, 128, 129, 8193, 70_001) for s in (False, True)]
    for t, got in zip(tensors, batched(tensors)):
        assert_same(got, reference(t), (t.dtype, t.numel()))


@pytest.mark.slow
def test_every_dtype_and_size_in_one_launch_equals_the_torch_ops(interpreted):
    """Floats (with NaN, infinities and zeros), float8, integers and bool, from one element to
    several chunks, in one batch: one partials launch per dtype, one combine."""
    _every_dtype_case("cpu")


def _views_case(device: str) -> None:
    base = torch.randn(64, 96, 5, generator=torch.Generator().manual_seed(1)).to(device)
    base[3, 4, 1] = 0
    views = [base.transpose(0, 1), base[10:50:3, ::2], base[7], base[:, 5, 2],
             base.permute(2, 0, 1)[1:, 3:, 5:], base[1:2].expand(4, 96, 5),
             base.reshape(-1)[17:9000], base.unsqueeze(1)[:, :, 3:6],
             base.view(8, 8, 96, 5).permute(3, 1, 0, 2)[:, 1:7],  # five dimensions: a copy
             base.to(torch.bfloat16).t() if base.dim() == 2 else base.to(torch.bfloat16)[2:, 1]]
    assert views[6].storage_offset() == 17 and not views[0].is_contiguous()
    for t, got in zip(views, batched(views)):
        assert_same(got, reference(t), (tuple(t.shape), t.stride(), t.storage_offset()))


def test_views_slices_expansions_and_storage_offsets_are_read_through_their_strides(
        interpreted):
    _views_case("cpu")
    # collapsed layouts: a transpose keeps two dimensions, a slice of rows one stride
    assert kernel.layout((3, 4), (1, 3)) == (0, 1, 3, 4, 0, 0, 1, 3)
    assert kernel.layout((2, 1, 6), (6, 6, 1)) == (1, 1, 1, 1, 0, 0, 0, 1)
    assert kernel.layout((2, 3, 2, 2, 2), (100, 20, 7, 3, 1)) is None


@pytest.mark.slow
def test_results_are_identical_run_to_run_and_for_any_split_into_programs(interpreted):
    """Partials combine in a fixed order: the bits are the same each run; a record spread over
    more programs than another layout gives (for counts, min, max, checksum, sketch) the same."""
    x = sample(torch.float32, 60_000, False)
    first = batched([x])[0]
    again = batched([x])[0]
    assert_same(again, first, "again")
    assert again["mean"] == first["mean"] and again["norm"] == first["norm"]  # to the bit
    small = batched([x], block=64, turns=1)[0]  # 938 chunks over 512 programs
    assert_same(small, reference(x), "small blocks")


def test_records_of_interleaved_dtypes_decode_to_their_own_rows(interpreted):
    """The table is written in record order and launched grouped by dtype: each record's slab
    row is still its own, and a reused table (`clear`) keeps no row of the batch before."""
    tensors = [sample(d, n, True) for n in (3, 300, 9000) for d in
               (torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.float16)]
    tab = kernel.Table(len(tensors))
    for t in reversed(tensors):  # something else first
        assert tab.append(t, tuple(t.shape))
    tab.clear()
    for t in tensors:
        assert tab.append(t, tuple(t.shape))
    assert tab.dtypes() == [t.dtype for t in tensors]
    grouped, groups, _ = tab.grouped()
    assert [g[0] for g in groups] == sorted({t.dtype for t in tensors}, key=kernel._CODES.get)
    slab = kernel.launch(tab, torch.device("cpu"), True)
    for t, got in zip(tensors, kernel.decode(slab.numpy(), tab.dtypes())):
        assert_same(got, reference(t), (t.dtype, t.numel()))
    assert not tab.append(torch.zeros(2, 3, 2, 5, 2, 2).transpose(1, 3)[:, :, :, :, :, 1],
                          (2, 5, 2, 3, 2))  # five dimensions left: the caller copies it


def test_empty_table_and_decode_of_narrow_checksums():
    assert kernel.table([])[2] == 0
    wrapped = kernel._wrap(np.array([255, 1 << 15, -1, 1 << 40]), np.array([8, 16, 32, 64]))
    assert wrapped.tolist() == [-1, -(1 << 15), -1, 1 << 40]


@pytest.mark.slow
def test_tens_of_millions_of_elements(interpreted):
    """Sizes where float32 sums would drift (here float64 partials): 20M float32 and 12M
    bfloat16 elements; large blocks keep the interpreter's time down (the kernel is the same)."""
    for dtype, n in ((torch.float32, 20_000_000), (torch.bfloat16, 12_000_003)):
        x = (torch.rand(n, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
        x[123_456] = 0
        got = batched([x], block=1 << 16, turns=4)[0]
        assert_same(got, reference(x), (dtype, n))


# -- the batched records -------------------------------------------------------------------------

class InPlace(torch.nn.Module):
    """Recorded tensors written in place later in the step: an in-place ReLU's input, an output
    that a residual is added to in place, and the weights (by the optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU(inplace=True)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.fc1(x)
        h += x
        return self.fc2(self.act(h))


def _dump(tmp_path, name, monkeypatch, batched_records: bool, **config):
    from tests.tracer.models import train_and_dump

    monkeypatch.setenv("SLEUTH_BATCHED_STATS", "1")
    if batched_records:
        monkeypatch.setattr(Deferred, "device_type", "cpu")
    else:
        monkeypatch.setattr(Deferred, "device_type", "none")
    dump = train_and_dump(InPlace, lambda: (torch.randn(4, 8),), tmp_path / name, **config)
    return dump.stats(0, 0)


def _same_tables(a, b) -> None:
    assert list(a["name"]) == list(b["name"]) and len(a) > 10
    for col in ("min", "max", "nan", "posinf", "neginf", "zeros", "checksum", "numel"):
        np.testing.assert_array_equal(a[col].to_numpy(), b[col].to_numpy(), err_msg=col)
    for col in ("mean", "norm"):
        np.testing.assert_allclose(a[col].to_numpy(), b[col].to_numpy(), rtol=1e-6, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["sync", "async"])
@pytest.mark.parametrize("level", ["module", "op"])
def test_a_dump_of_batched_records_equals_one_of_records_made_one_by_one(
        tmp_path, monkeypatch, interpreted, writer, level):
    """The records that take the batch (here CPU tensors, as CUDA ones do on a GPU) give the
    same rows, names and order as records measured one by one, and their sketches; tensors
    written in place after their record (an in-place ReLU, a residual added in place, the
    optimizer's step) are measured as they were when recorded."""
    import tracer

    monkeypatch.setattr("tracer.storage._batcher.MAX_RECORDS", 7)  # several flushes a step
    config = dict(level=level, mode="statistics", writer=writer)
    one = _dump(tmp_path, "one", monkeypatch, False, **config)
    many = _dump(tmp_path, "many", monkeypatch, True, **config)
    _same_tables(many, one)
    a, b = tracer.open_dump(tmp_path / "one"), tracer.open_dump(tmp_path / "many")
    np.testing.assert_array_equal(a.sketches(0, 0), b.sketches(0, 0))


def test_a_batch_flushes_at_its_record_and_byte_bounds(interpreted):
    deferred = Deferred(False, max_records=3, max_bytes=1 << 20)
    deferred.device_type = "cpu"

    def plan(t, stable, version):
        return None, None, False

    flushed = [deferred.add(plan, i, None, torch.ones(10), True, None) for i in range(3)]
    assert flushed[:2] == [None, None] and len(flushed[2].records) == 3
    big = torch.ones(1 << 18)  # 1 MiB: the batch is full with it
    batch = deferred.add(plan, 3, None, big, True, None)
    assert [r.seq for r in batch.records] == [3]
    assert deferred.flush() is None  # nothing pending
    empty = deferred.add(plan, 4, None, torch.ones(0), True, None)
    assert empty is None and [s for _, s in deferred.flush().resolve()][0]["nan"] == 0


# -- on a device ----------------------------------------------------------------------------------

@pytest.mark.cuda
@CUDA
def test_cuda_every_dtype_and_size_equals_the_torch_ops():
    _every_dtype_case("cuda")
    _views_case("cuda")


@pytest.mark.cuda
@CUDA
def test_cuda_tens_of_millions_identical_run_to_run():
    x = (torch.rand(30_000_001, device="cuda") + 0.5)
    x[5], x[77] = math.nan, 0
    first, again = batched([x])[0], batched([x])[0]
    assert_same(first, reference(x), "30M")
    assert first["checksum"] == again["checksum"]
    np.testing.assert_array_equal(first["sketch"], again["sketch"])


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("writer", ["sync", "async"])
def test_cuda_dump_of_batched_records_equals_the_records_one_by_one(tmp_path, monkeypatch,
                                                                    writer):
    import tracer
    from tests.tracer.models import MLP

    monkeypatch.setenv("SLEUTH_BATCHED_STATS", "1")
    tables = []
    for name, device_type in (("one", "none"), ("many", "cuda")):
        monkeypatch.setattr(Deferred, "device_type", device_type)
        torch.manual_seed(0)
        model = MLP().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with tracer.Dumper(model, {"path": str(tmp_path / name), "level": "op",
                                   "writer": writer}):
            for _ in range(2):
                model(torch.randn(4, 8, device="cuda")).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        tables.append(tracer.open_dump(tmp_path / name).stats(0, 0))
    _same_tables(tables[1], tables[0])


def test_the_batch_is_opt_in(monkeypatch):
    from tracer.storage._batcher import make_deferred

    monkeypatch.delenv("SLEUTH_BATCHED_STATS", raising=False)
    assert make_deferred("statistics", "op", False) is None
    monkeypatch.setenv("SLEUTH_BATCHED_STATS", "1")
    assert make_deferred("statistics", "op", False) is not None
    assert make_deferred("tensor", "op", False) is None
