"""Sync and async writers: exact round trip, same content, back-pressure, errors, hits."""
from __future__ import annotations

import threading
import time
import warnings

import h5py
import numpy as np
import pytest
import torch

import tracer
from tracer._config import DumpConfig
from tracer._errors import DumpWriteError, TracerError
from tracer.storage._reader import open_dump
from tracer.storage import RecordMeta, make_writer


def meta(name: str, i: int = 0) -> RecordMeta:
    return RecordMeta(f"{name}.forward.0.output.{i}", name, "", "forward", "output", i, 0,
                      "model.py:7")


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g)
    return {
        "f32": x, "f64": x.double(), "f16": x.half(), "bf16": (x * 1e3).bfloat16(),
        "e4m3": x.to(torch.float8_e4m3fn), "e5m2": x.to(torch.float8_e5m2),
        "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0, 7]),
        "bool": torch.tensor([[True, False], [False, True]]),
        "c64": torch.randn(4, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16), "empty": torch.zeros(0, 3),
        "strided": x.t()[1:, ::2], "nan": torch.tensor([float("nan"), -float("inf"), 1.0]),
    }


def write(run, writer: str, mode: str = "full", steps=(0,), items=None, **kw):
    w = make_writer(DumpConfig(path=str(run), writer=writer, mode=mode, **kw), rank=0,
                    world_size=1)
    rows: list[dict] = []
    w.observers.append(rows.append)
    for s in steps:
        w.begin_step(s)
        for name, t in (items or tensors()).items():
            w.add(meta(name), t)
        w.end_step()
    w.close()
    return w, rows


@pytest.mark.parametrize("writer", ["sync", "async"])
@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_the_reader_gives_back_each_row_as_the_writer_made_it(tmp_path, writer, mode):
    """One typed row from the writer to the reader: what the row sinks saw (strides, byte
    ranges and statistics of shared and sliced records included) is what `Dump.row` reads
    back, column for column."""
    w = make_writer(DumpConfig(path=str(tmp_path), writer=writer, mode=mode), rank=0,
                    world_size=1)
    made: list = []
    w.row_sinks.append(lambda row, step: made.append((step, row)))
    items = tensors()
    base = items["f32"]
    for step in (0, 1):
        w.begin_step(step)
        for name, t in items.items():
            w.add(meta(name), t)
        w.add(meta("again"), base)  # the same memory again: a shared record
        w.add(meta("rows"), base[2:4])  # a piece of a recorded tensor
        w.end_step()
    w.close()
    d = open_dump(tmp_path)
    assert len(made) == 2 * (len(items) + 2)

    def cells(row):  # NaN statistics (the empty tensor, the NaN tensor) compare as equal
        return [("nan" if isinstance(v, float) and v != v else v, type(v)) for v in row]

    for step, row in made:
        assert type(row).__name__ == "RecordRow"
        assert cells(d.row(0, step, row.name)) == cells(row)
        assert list(d.record(0, step, row.name)) == list(row._fields)


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_bit_exact_round_trip(tmp_path, writer):
    write(tmp_path, writer)
    d = open_dump(tmp_path)
    assert d.ranks == [0] and d.steps(0) == [0]
    df = d.stats(0, 0)
    assert list(df.seq) == list(range(len(tensors())))
    for name, t in tensors().items():
        rec = f"{name}.forward.0.output.0"
        back = d.tensor_torch(0, 0, rec)
        assert back.dtype == t.dtype and back.shape == t.shape
        if t.numel():
            assert torch.equal(back.reshape(-1).view(torch.uint8),
                               t.contiguous().reshape(-1).view(torch.uint8)), name
        arr = d.tensor(0, 0, rec)
        assert arr.shape == tuple(t.shape)
        if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16):
            assert arr.dtype.name in ("float32", "float16")
            assert torch.equal(torch.from_numpy(arr).float(), t.float())  # exact upcast
        raw = d.tensor(0, 0, rec, raw=True)
        assert raw.dtype == str(t.dtype).removeprefix("torch.")
        assert raw.bits.dtype.kind == "u"
    row = df.set_index("name").loc["bf16.forward.0.output.0"]
    assert row["dtype"] == "bfloat16" and row["shape"] == "6,5" and row["numel"] == 30
    assert row["source"] == "model.py:7" and row["data_nbytes"] == 60
    assert df.set_index("name").loc["scalar.forward.0.output.0", "shape"] == ""
    attrs = d.attrs(0, 0)
    assert attrs["format_version"] == "3.5" and attrs["mode"] == "full"
    assert attrs["complete"] == 1 and attrs["step"] == 0 and attrs["world_size"] == 1
    assert (attrs["status"], attrs["status_reason"]) == ("complete", "")


@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_sync_and_async_write_the_same_content(tmp_path, mode):
    ws, rows_s = write(tmp_path / "s", "sync", mode, steps=(0, 3))
    wa, rows_a = write(tmp_path / "a", "async", mode, steps=(0, 3))
    assert rows_s == [dict(r) for r in rows_a] or _rows_equal(rows_s, rows_a)
    a, b = open_dump(tmp_path / "s"), open_dump(tmp_path / "a")
    assert a.steps(0) == b.steps(0) == [0, 3]
    for step in (0, 3):
        sa, sb = a.stats(0, step), b.stats(0, step)
        assert sa.equals(sb)
        if mode == "tensor":
            for name in sa.name:
                assert (a.tensor(0, step, name, raw=True).bits.tobytes()
                        == b.tensor(0, step, name, raw=True).bits.tobytes())
        else:
            assert (sa.data_offset == -1).all()
            with pytest.raises(TracerError, match="mode 'statistics'"):
                a.tensor(0, step, sa.name[0])


def _rows_equal(x: list[dict], y: list[dict]) -> bool:
    import math
    for r, s in zip(x, y, strict=True):
        for k in r:
            if isinstance(r[k], float) and math.isnan(r[k]):
                assert math.isnan(s[k])
            else:
                assert r[k] == s[k], k
    return True


def test_snapshot_survives_in_place_changes(tmp_path):
    for writer in ("sync", "async"):
        w = make_writer(DumpConfig(path=str(tmp_path / writer), writer=writer, mode="tensor"),
                        rank=0, world_size=1)
        t = torch.ones(1000)
        w.begin_step(0)
        w.add(meta("a"), t)
        t.mul_(5)  # an in-place op later in the step
        w.end_step()
        w.close()
        d = open_dump(tmp_path / writer)
        assert (d.tensor(0, 0, "a.forward.0.output.0") == 1).all()
        assert d.stats(0, 0).loc[0, "max"] == 1.0


def test_back_pressure_blocks_and_loses_nothing(tmp_path):
    # 1 MiB bound, 256 KiB records; the writer is held at its first record for 0.5 s
    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", mode="tensor",
                               async_max_queued_mb=1), rank=0, world_size=1)
    gate = threading.Event()
    process = w._process

    def held(item):  # the writer thread waits at each queue item until the gate opens
        gate.wait(30)
        process(item)

    w._process = held

    def release_when_full():  # hold the writer until the queue is full, then 0.5 s longer
        while w.queued_bytes < 1 << 20:
            time.sleep(0.005)
        time.sleep(0.5)
        gate.set()

    threading.Thread(target=release_when_full, daemon=True).start()
    peak = 0
    w.begin_step(0)
    for i in range(40):
        w.add(meta(f"m{i}"), torch.full((65536,), float(i)))
        peak = max(peak, w.queued_bytes)
    w.end_step()
    w.close()
    assert peak <= 1 << 20
    assert w.blocked_s > 0.3  # the producer really waited for the writer
    d = open_dump(tmp_path)
    df = d.stats(0, 0)
    assert len(df) == 40 and list(df.seq) == list(range(40))
    assert [float(d.tensor(0, 0, n)[0]) for n in df.name] == [float(i) for i in range(40)]


def test_bytes_from_both_threads_land_where_their_rows_say(tmp_path):
    # async tensor mode: records with the caller's statistics keep their bytes in the training
    # thread (handed over in chunks), the others (here: no kernel) are stored by the writer
    # thread; the training thread places both in /tensors, in record order
    from tracer.storage._stats import host_stats

    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", mode="tensor",
                               async_max_queued_mb=1), rank=0, world_size=1)
    w._kernel = False
    items = {f"m{i}": torch.full((40_000 + i,), float(i)) for i in range(12)}
    items["strided"] = torch.arange(12.0).reshape(3, 4).t()
    w.begin_step(0)
    for i, (name, t) in enumerate(items.items()):
        w.add(meta(name), t, stats=host_stats(t) if i % 3 else None)
    w.end_step()
    w.close()
    d = open_dump(tmp_path)
    df = d.stats(0, 0)
    assert list(df.seq) == list(range(len(items)))
    for name, t in items.items():
        assert torch.equal(d.tensor_torch(0, 0, meta(name).name), t), name


def test_one_record_larger_than_the_bound_goes_through(tmp_path):
    w, _ = write(tmp_path, "async", "tensor", items={"big": torch.ones(600_000)},
                 async_max_queued_mb=1)
    assert open_dump(tmp_path).tensor(0, 0, "big.forward.0.output.0").sum() == 600_000


def test_large_step_spills_to_a_side_file(tmp_path):
    items = {f"m{i}": torch.full((300_000,), float(i)) for i in range(8)}  # ~9.6 MB > 1 MiB
    for writer in ("sync", "async"):
        write(tmp_path / writer, writer, "tensor", items=items, async_max_queued_mb=1)
        d = open_dump(tmp_path / writer)
        for i in range(8):
            assert (d.tensor(0, 0, f"m{i}.forward.0.output.0") == i).all()
        left = sorted(p.name for p in (tmp_path / writer / "dump" / "rank0").iterdir())
        assert left == ["step0.h5"]


@pytest.mark.parametrize("writer", ["sync", "async"])
@pytest.mark.parametrize("how", ["on_error", "strict"])
def test_write_error_raises_once(tmp_path, writer, how, monkeypatch):
    """Where asked to ("on_error": "raise", or SLEUTH_STRICT=1 whatever the config says)."""
    (tmp_path / "dump").write_text("a file where the dump folder should be")
    if how == "strict":
        monkeypatch.setenv("SLEUTH_STRICT", "1")
    config = DumpConfig(path=str(tmp_path), writer=writer,
                        on_error="raise" if how == "on_error" else "warn")
    w = make_writer(config, rank=0, world_size=1)
    w.begin_step(0)
    w.add(meta("a"), torch.ones(3))
    with pytest.raises(DumpWriteError, match="failed") as e:
        w.end_step()
        w.close()
    assert isinstance(e.value.__cause__, OSError)
    w.close()  # idempotent: the error was already raised
    assert not w.enabled


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_a_write_error_warns_once_and_stops_by_default(tmp_path, writer, monkeypatch):
    monkeypatch.delenv("SLEUTH_STRICT", raising=False)
    (tmp_path / "dump").write_text("not a folder")
    assert DumpConfig().on_error == "warn"
    w = make_writer(DumpConfig(path=str(tmp_path), writer=writer), rank=0, world_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            w.begin_step(step)
            w.add(meta("a"), torch.ones(3))
            w.end_step()
            w.flush()
        w.close()
    ours = [c for c in caught if issubclass(c.category, tracer.SleuthWarning)]
    assert len(ours) == 1 and "is off for the rest of the run" in str(ours[0].message)
    assert not w.enabled


def test_async_error_surfaces_at_next_call(tmp_path):
    (tmp_path / "dump").write_text("not a folder")
    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", on_error="raise"), rank=0,
                    world_size=1)
    w.begin_step(0)
    w.add(meta("a"), torch.ones(3))
    w.end_step()
    with pytest.raises(DumpWriteError):
        w.flush()
    w.begin_step(1)  # off now: no further error, no exception
    w.add(meta("a"), torch.ones(3))
    with pytest.raises(DumpWriteError, match="incomplete: writing step 0"):
        w.close()  # the dump is incomplete: close() must not return as if it were fine


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_observer_errors_reach_the_training_thread(tmp_path, writer):
    w = make_writer(DumpConfig(path=str(tmp_path), writer=writer), rank=0, world_size=1)

    def stop(row):
        if row["name"].startswith("b."):
            raise ValueError(f"hit {row['name']}")

    w.observers.append(stop)
    w.begin_step(0)
    w.add(meta("a"), torch.ones(3))
    with pytest.raises(ValueError, match="hit b.forward"):
        w.add(meta("b"), torch.ones(3))
        w.flush()
    w.end_step()
    w.close()
    assert open_dump(tmp_path).steps(0) == [0]  # dumping went on


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_hits_from_observers_and_callers(tmp_path, writer):
    w = make_writer(DumpConfig(path=str(tmp_path), writer=writer), rank=0, world_size=1)

    def watch(row):
        if row["nan"]:
            w.add_hit(dict(seq=row["seq"], name=row["name"], condition="nan_inf",
                           value=float(row["nan"]), source=row["source"]))

    w.observers.append(watch)
    w.begin_step(0)
    w.add(meta("a"), torch.ones(3))
    w.add(meta("b"), torch.tensor([float("nan"), 1.0]))
    w.add_hit(dict(seq=0, name="a.forward.0.output.0", condition="all_zero", value=0.0,
                   source="x.py:1"))
    w.end_step()
    w.close()
    hits = open_dump(tmp_path).hits(0, 0)
    assert sorted(hits.condition) == ["all_zero", "nan_inf"]
    nan_hit = hits[hits.condition == "nan_inf"].iloc[0]
    assert nan_hit["seq"] == 1 and nan_hit["name"] == "b.forward.0.output.0"
    assert nan_hit["source"] == "model.py:7" and nan_hit["value"] == 1.0


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_close_writes_an_unfinished_step_marked_incomplete(tmp_path, writer):
    w = make_writer(DumpConfig(path=str(tmp_path), writer=writer), rank=0, world_size=1)
    w.begin_step(5)
    w.add(meta("a"), torch.ones(3))
    w.close()
    d = open_dump(tmp_path)
    assert d.steps(0) == [5] and d.attrs(0, 5)["complete"] == 0 and len(d.stats(0, 5)) == 1
    with pytest.raises(TracerError, match="begin_step"):
        make_writer(DumpConfig(path=str(tmp_path), writer=writer), rank=0,
                    world_size=1).add(meta("a"), torch.ones(1))


def test_step_file_layout(tmp_path):
    write(tmp_path, "async", "full", items={"a": torch.ones(4), "b": torch.zeros(2)})
    with h5py.File(tmp_path / "dump" / "rank0" / "step0.h5") as f:
        assert set(f) == {"records", "tensors"}
        assert f["tensors"].dtype == "uint8" and f["tensors"].shape == (24,)
        assert f["records"].dtype.names[:3] == ("seq", "name", "module")
        assert f.attrs["level"] == "module" and '"writer": "async"' in f.attrs["config"]


def test_step_file_objects_are_those_h5py_would_make(tmp_path):
    """StepFile writes through h5py's low-level API; a reader must see what h5py's File,
    attrs and create_dataset make of the same values."""
    from tracer.storage._format import RECORD_COLUMNS, records_crc32
    from tracer.storage._h5_objects import table_array
    from tracer.storage._step_file import StepFile

    row = (0, "a.forward.0.output.0", "a", "", "forward", "output", 0, 0, "float32", "4", 4,
           -1.0, 1.0, 0.5, 2.0, 0, 0, 0, 1, 7, "model.py:7", -1, 0, "")
    attrs = {"format_version": "2.0", "step": 3, "scale": 0.5, "config": "{\"é\": 1}"}
    file = StepFile(tmp_path / "step3.h5", attrs, spill_bytes=1 << 20)
    file.add_row(row)
    file.finish()
    with h5py.File(tmp_path / "ref.h5", "w") as ref:
        for key, value in attrs.items():
            ref.attrs[key] = value
        ref.attrs["complete"] = 1
        ref.attrs["records_crc32"] = records_crc32(table_array([row], RECORD_COLUMNS))
        ref.create_dataset("records", data=table_array([row], RECORD_COLUMNS))
        ref.create_dataset("tensors", shape=(0,), dtype="uint8")
    with h5py.File(tmp_path / "step3.h5") as ours, h5py.File(tmp_path / "ref.h5") as ref:
        assert set(ours) == set(ref) and set(ours.attrs) == set(ref.attrs)
        for key in ref.attrs:
            assert ours.attrs[key] == ref.attrs[key]
            assert type(ours.attrs[key]) is type(ref.attrs[key]), key
            assert ours.attrs.get_id(key).get_type().get_class() == \
                ref.attrs.get_id(key).get_type().get_class(), key
        for name in ref:
            assert ours[name].dtype == ref[name].dtype and ours[name].shape == ref[name].shape
            assert ours[name].id.get_type().get_class() == ref[name].id.get_type().get_class()
        assert ours["records"][()].tobytes() == ref["records"][()].tobytes()
        # the table read back has the bytes its stored CRC was taken of
        assert records_crc32(ours["records"][()]) == ours.attrs["records_crc32"]
    bad = StepFile(tmp_path / "step4.h5", {"when": [1, 2]}, spill_bytes=1 << 20)
    with pytest.raises(TypeError, match="'when'"):
        bad.finish()
    # numpy calls a table of plain byte strings equal to the same table marked UTF-8; the
    # cached HDF5 types must still tell them apart
    plain = file.records_table()
    plain = plain.view(np.dtype([(n, plain.dtype[n].str) for n in plain.dtype.names]))
    assert plain.dtype == file.records_table().dtype
    for name, table in (("ascii.h5", plain), ("utf8.h5", file.records_table())):
        other = StepFile(tmp_path / name, attrs, spill_bytes=1 << 20)
        other.table = table
        other.finish()
    with h5py.File(tmp_path / "ascii.h5") as a, h5py.File(tmp_path / "utf8.h5") as u:
        name_type = [f["records"].id.get_type().get_member_type(1).get_cset() for f in (a, u)]
        assert name_type == [h5py.h5t.CSET_ASCII, h5py.h5t.CSET_UTF8]


def test_async_add_does_not_wait_for_the_disk(tmp_path):
    gate = threading.Event()
    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", mode="tensor"), rank=0,
                    world_size=1)
    process = w._process
    w._process = lambda item: (gate.wait(5), process(item))  # the writer thread is held
    start = time.perf_counter()
    w.begin_step(0)
    for i in range(20):
        w.add(meta(f"m{i}"), torch.ones(1000))
    w.end_step()
    took = time.perf_counter() - start
    gate.set()
    w.close()
    assert took < 2.0 and len(open_dump(tmp_path).stats(0, 0)) == 20


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_side_stream_matches_cpu(tmp_path):
    items = {k: v for k, v in tensors().items() if k not in ("c64",)}
    write(tmp_path / "cpu", "sync", "full", items=items)
    cuda_items = {k: v.cuda() for k, v in items.items()}
    write(tmp_path / "gs", "sync", "full", items=cuda_items)
    write(tmp_path / "ga", "async", "full", items=cuda_items)
    c, s, a = (open_dump(tmp_path / x) for x in ("cpu", "gs", "ga"))
    ss, sa = s.stats(0, 0), a.stats(0, 0)
    assert ss.equals(sa)
    assert (ss.checksum == c.stats(0, 0).checksum).all()
    for name in ss.name:
        assert (s.tensor(0, 0, name, raw=True).bits.tobytes()
                == a.tensor(0, 0, name, raw=True).bits.tobytes()
                == c.tensor(0, 0, name, raw=True).bits.tobytes())


@pytest.mark.parametrize("writer", ["sync", "async"])
@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_reused_staging_buffers_never_mix_records(tmp_path, writer, mode):
    # 100 KiB and 300 KiB records come from the staging pool and go back after each write
    w = make_writer(DumpConfig(path=str(tmp_path), writer=writer, mode=mode,
                               async_max_queued_mb=1), rank=0, world_size=1)
    for step in range(4):
        w.begin_step(step)
        for i in range(6):
            w.add(meta(f"m{i}"), torch.full((25_600 * (1 + 2 * (i % 2)),), step * 10.0 + i))
        w.end_step()
    w.close()
    d = open_dump(tmp_path)
    for step in range(4):
        df = d.stats(0, step)
        assert list(df["max"]) == list(df["min"]) == [step * 10.0 + i for i in range(6)]
        if mode == "tensor":
            for i, name in enumerate(df.name):
                assert (d.tensor(0, step, name) == step * 10.0 + i).all()


def test_non_ascii_names_round_trip(tmp_path):
    # format 2.0 stores strings as fixed-length UTF-8: a name numpy cannot encode as ASCII
    # takes the per-value path
    w = make_writer(DumpConfig(path=str(tmp_path), writer="sync", mode="statistics"), rank=0,
                    world_size=1)
    w.begin_step(0)
    for name in ("blöck.forward.0.output.0", "a.forward.0.output.0", "注意.forward.0.output.0"):
        w.add(RecordMeta(name, name.split(".")[0], "", "forward", "output", 0, 0, "módel.py:3"),
              torch.ones(2))
    w.end_step()
    w.close()
    df = open_dump(tmp_path).stats(0, 0)
    assert list(df.name) == ["blöck.forward.0.output.0", "a.forward.0.output.0",
                             "注意.forward.0.output.0"]
    assert list(df.module) == ["blöck", "a", "注意"] and set(df.source) == {"módel.py:3"}
    assert open_dump(tmp_path).record(0, 0, "注意.forward.0.output.0")["module"] == "注意"


_FULL_DISK = """
import resource, sys, torch
from tracer._config import DumpConfig
from tracer.storage import RecordMeta, make_writer

resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))  # writes past it fail: EFBIG
w = make_writer(DumpConfig(path="run", writer=sys.argv[1], file_process=sys.argv[2] == "1"),
                rank=0, world_size=1)
for step in range(2):
    w.begin_step(step)
    for i in range(200):
        w.add(RecordMeta(f"m{i}.forward.0.output.0", f"m{i}", "", "forward", "output", 0, 0,
                         "model.py:7", ""), torch.randn(100))
    w.end_step()
w.close()
print("closed")
"""


@pytest.mark.slow
@pytest.mark.parametrize("writer,helper", [("sync", "0"), ("async", "0"), ("async", "1")])
def test_a_full_disk_while_the_tables_are_written_is_a_warning_not_a_crash(tmp_path, writer,
                                                                            helper):
    """A step file's tables that cannot be written (the file may not grow: as a full disk):
    one warning and the dump off. HDF5 crashed the process with SIGSEGV when such a write
    failed at the dataset's close, the user's run with it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env["PYTHONPATH"] = str(repo)
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK, writer, helper], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "sleuth: the tensor dump of rank 0 is off for the rest of the run, and the run goes on "
        "without it: writing "), proc.stderr
    assert "File too large" in lines[0]
    assert not list((tmp_path / "run" / "dump" / "rank0").iterdir())
