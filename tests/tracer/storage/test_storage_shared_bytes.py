"""Records that reuse an unchanged tensor's statistics share its stored bytes (one byte range
for several records, docs/dump-format.md; a transpose reads them with its own strides), slices
point into the bytes of a record that holds their elements (format 3.0), and all still read back
exactly."""
from __future__ import annotations

import functools

import h5py
import numpy as np
import pytest
import torch
import torch.nn as nn

import tracer
import tracer._dumper as dumper_module
from tracer.storage import _step_file
from tracer._config import DumpConfig
from tracer.analysis._diff import diff
from tracer.storage._reader import open_dump
from tracer.storage import RecordMeta, make_writer

from models import stranger_models


def meta(name: str) -> RecordMeta:
    return RecordMeta(f"{name}.forward.0.output.0", name, "", "forward", "output", 0, 0,
                      "model.py:7")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality, NaNs included."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def keep(w, refs: dict, name: str, t: torch.Tensor) -> None:
    """Record `t` as `name` and keep a copy of its values as they are now."""
    w.add(meta(name), t)
    refs[name] = t.resolve_conj().clone()


def write_views(run, writer: str):
    """Writes records of views and copies of one tensor; returns the reference tensors as they
    were when recorded."""
    w = make_writer(DumpConfig(path=str(run), writer=writer, mode="tensor"), rank=0,
                    world_size=1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    x[0, 0] = float("nan")
    items = [("x", x), ("again", x), ("flat", x.view(-1)), ("reshaped", x.view(2, 12)),
             ("t", x.t()), ("t_again", x.t()), ("head", x[:2]), ("tail", x[2:]),
             ("clone", x.clone()), ("bf16", x.bfloat16())]
    c = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    # a conjugate view shares the memory but not the values
    items += [("c", c), ("c_conj", c.conj())]
    refs: dict[str, torch.Tensor] = {}
    w.begin_step(0)
    for name, t in items:
        keep(w, refs, name, t)
    x.mul_(2)  # bumps the version: a record after this must store its own bytes
    keep(w, refs, "after", x)
    keep(w, refs, "after_view", x.view(-1))
    w.end_step()
    w.close()
    return refs


def read_back(run, refs: dict[str, torch.Tensor]):
    """Open the dump, check every record of step 0 reads back as the tensor it was (torch and
    numpy), and return the dump and its table indexed by module."""
    d = open_dump(run)
    for name, ref in refs.items():
        got = d.tensor_torch(0, 0, f"{name}.forward.0.output.0")
        assert got.is_contiguous() and same(got, ref.contiguous()), name
        if not ref.is_complex():
            plain = ref.float() if ref.dtype == torch.bfloat16 else ref  # numpy: no bfloat16
            assert np.array_equal(d.tensor(0, 0, f"{name}.forward.0.output.0"),
                                  plain.numpy(), equal_nan=True), name
    return d, d.stats(0, 0).set_index("module")


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_shared_records_read_back_exactly(tmp_path, writer):
    d, df = read_back(tmp_path, write_views(tmp_path, writer))
    loc = {m: (int(r.data_offset), int(r.data_nbytes)) for m, r in df.iterrows()}
    # same span, same dtype: one byte range; the transposes read it with their strides
    assert loc["again"] == loc["flat"] == loc["reshaped"] == loc["x"] == loc["t"] \
        == loc["t_again"]
    assert loc["after_view"] == loc["after"]
    strides = df["strides"].to_dict()
    assert strides["t"] == strides["t_again"] == "1,6"
    assert all(strides[k] == "" for k in strides if k not in ("t", "t_again"))
    assert d.tensor_strides(0, 0, "t.forward.0.output.0") == (1, 6)
    assert d.tensor_strides(0, 0, "x.forward.0.output.0") is None
    # other elements, or changed values: bytes of their own
    others = [loc[k] for k in ("x", "head", "tail", "clone", "bf16", "after", "c", "c_conj")]
    # (head and x share their start, not their length: different ranges)
    assert len(set(others)) == len(others)
    # dense pieces inside x's span (format 3.0) point into x's bytes, the head at offset 0 too
    assert loc["tail"] == (loc["x"][0] + 2 * 6 * 4, 2 * 6 * 4)
    assert loc["head"] == (loc["x"][0], 2 * 6 * 4)
    # the file holds each distinct range once
    distinct = {v for k, v in loc.items() if k not in ("tail", "head")}
    assert d.summary().tensor_bytes.iloc[0] == sum(n for _, n in distinct)


def test_sync_and_async_write_the_same_content(tmp_path):
    write_views(tmp_path / "s", "sync")
    write_views(tmp_path / "a", "async")
    ds, da = open_dump(tmp_path / "s"), open_dump(tmp_path / "a")
    ss, sa = ds.stats(0, 0), da.stats(0, 0)
    assert ss.equals(sa)
    for name in ss.name:
        assert same(ds.tensor_torch(0, 0, name), da.tensor_torch(0, 0, name)), name
    assert diff(tmp_path / "s", tmp_path / "a").status == "same"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h.view(-1, 16)).sum()


def record_adds(monkeypatch) -> dict[str, torch.Tensor]:
    """Make the Dumper's writers keep a copy of each record's tensor as it was when recorded;
    returns where (record name -> tensor)."""
    refs: dict[str, torch.Tensor] = {}
    real = dumper_module._make_writer

    def recording_writer(config, rank, world_size):
        w = real(config, rank, world_size)
        add = w.add

        def add_and_keep(m, t, stable=True, version=None, stats=None):
            refs[m.name] = t.detach().resolve_conj().resolve_neg().clone()
            add(m, t, stable, version, stats)

        w.add = add_and_keep
        return w

    monkeypatch.setattr(dumper_module, "_make_writer", recording_writer)
    return refs


def dump_model(run, writer: str, monkeypatch) -> dict[str, torch.Tensor]:
    """An op-level tensor dump of one training step; returns each record's tensor as it was
    when recorded."""
    refs = record_adds(monkeypatch)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 8)
    with tracer.Dumper(model, {"path": str(run), "level": "op", "mode": "tensor",
                               "writer": writer}):
        model(x).backward()
        opt.step()
        opt.zero_grad()
    return refs


@pytest.mark.parametrize("kernel", ["built", "off"])
@pytest.mark.parametrize("writer", ["sync", "async"])
def test_op_dump_with_shared_bytes_reads_back_exactly(tmp_path, writer, kernel, monkeypatch):
    if kernel == "off":  # as an install without a C compiler
        import tracer.storage._stats as stats_module

        monkeypatch.setattr(stats_module, "_kernel", None)
    refs = dump_model(tmp_path, writer, monkeypatch)
    d = open_dump(tmp_path)
    step = d.steps(0)[0]
    df = d.stats(0, step)
    assert len(df) == len(refs) > 10
    for name in df.name:
        assert same(d.tensor_torch(0, step, name), refs[name]), name
    stored = df[df.data_offset >= 0]
    ranges = stored.groupby(["data_offset", "data_nbytes"]).size()
    assert (ranges > 1).any(), "no record shared another's bytes"
    assert d.summary().tensor_bytes.iloc[0] == int(
        stored.drop_duplicates("data_offset").data_nbytes.sum())
    assert np.all(stored.data_offset.to_numpy() + stored.data_nbytes.to_numpy()
                  <= d.summary().tensor_bytes.iloc[0])
    # a weight's param record (its value before the optimizer step, read back exactly above)
    # points at the bytes of the op record that read the weight in forward
    at = df.set_index("name").data_offset
    for layer in ("fc1", "fc2"):
        assert at[f"{layer}.weight.optimizer.0.param.0"] == \
            at[f"{layer}::aten.t.forward.0.input.0"], layer
    # the update is new values: bytes of its own
    assert at["fc1.weight.optimizer.0.update.0"] not in set(at.drop(
        "fc1.weight.optimizer.0.update.0"))


def test_a_snapshot_of_memory_no_record_holds_stores_its_own_bytes(tmp_path):
    """`same_bytes` only points a snapshot at bytes a record stores: for a parameter no record
    read, the snapshot's record stores its own, and a later record of the parameter's
    unchanged memory measures it (the look-up leaves nothing behind)."""
    w = make_writer(DumpConfig(path=str(tmp_path), writer="sync", mode="full"), rank=0,
                    world_size=1)
    p = torch.randn(5, 3, generator=torch.Generator().manual_seed(8))
    snap = p.clone()
    w.begin_step(0)
    w.add(meta("other"), torch.ones(2))
    w.same_bytes(snap, p)  # p has no record: nothing to point at
    w.add(meta("param"), snap, stats=None)
    w.add(meta("p"), p)
    x = torch.randn(4, generator=torch.Generator().manual_seed(9))
    w.add(meta("x"), x)
    x_snap = x.clone()
    w.same_bytes(x_snap, x)
    x_snap.add_(1.0)  # written after: its values are no longer x's
    from tracer.storage._stats import host_stats
    w.add(meta("x_changed"), x_snap, stats=host_stats(x_snap))
    w.end_step()
    w.close()
    d = open_dump(tmp_path)
    df = d.stats(0, 0).set_index("module")
    assert len(set(df.data_offset)) == 5
    assert df.loc["p", "max"] == float(p.max())
    for name, want in (("param", p), ("p", p), ("x_changed", x + 1.0)):
        assert same(d.tensor_torch(0, 0, f"{name}.forward.0.output.0"), want), name


def spill_items() -> dict[str, torch.Tensor]:
    return {f"m{i}": torch.arange(300_000, dtype=torch.float32) * (i + 1) for i in range(8)}


def write_spilled(run, writer: str) -> None:
    w = make_writer(DumpConfig(path=str(run), writer=writer, mode="tensor",
                               async_max_queued_mb=1), rank=0, world_size=1)
    w.begin_step(0)
    for name, t in spill_items().items():
        w.add(meta(name), t)
    w.end_step()
    w.close()


def tensors_offset(run) -> int:
    with h5py.File(run / "dump" / "rank0" / "step0.h5", "r") as f:
        return int(f["tensors"].id.get_offset())


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_spilled_bytes_are_written_in_place(tmp_path, writer):
    write_spilled(tmp_path, writer)
    d = open_dump(tmp_path)
    for name, ref in spill_items().items():
        assert same(d.tensor_torch(0, 0, f"{name}.forward.0.output.0"), ref), name
    assert tensors_offset(tmp_path) == _step_file.SPILL_OFFSET
    assert sorted(p.name for p in (tmp_path / "dump" / "rank0").iterdir()) == ["step0.h5"]


def test_spilled_bytes_are_copied_when_the_metadata_does_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(_step_file, "SPILL_OFFSET", 4096)  # the records table alone is larger
    write_spilled(tmp_path, "sync")
    d = open_dump(tmp_path)
    for name, ref in spill_items().items():
        assert same(d.tensor_torch(0, 0, f"{name}.forward.0.output.0"), ref), name
    assert tensors_offset(tmp_path) != 4096
    assert sorted(p.name for p in (tmp_path / "dump" / "rank0").iterdir()) == ["step0.h5"]


def test_spilled_sync_and_async_dumps_diff_the_same(tmp_path):
    write_spilled(tmp_path / "s", "sync")
    write_spilled(tmp_path / "a", "async")
    assert open_dump(tmp_path / "s").stats(0, 0).equals(open_dump(tmp_path / "a").stats(0, 0))
    assert diff(tmp_path / "s", tmp_path / "a").status == "same"


def test_a_transpose_recorded_first_is_stored_in_memory_order(tmp_path):
    w = make_writer(DumpConfig(path=str(tmp_path), writer="sync", mode="tensor"), rank=0,
                    world_size=1)
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(2))
    p = x.permute(2, 0, 1)
    w.begin_step(0)
    w.add(meta("p"), p)  # no copy to C order: its memory-order bytes and strides
    w.add(meta("x"), x)  # the same span, C order: shares them
    w.add(meta("odd"), x[:, ::2])  # not a dense span, but inside x's: points into its bytes
    w.end_step()
    w.close()
    d = open_dump(tmp_path)
    df = d.stats(0, 0).set_index("module")
    assert df.loc["p", "strides"] == "1,20,5" and df.loc["x", "strides"] == ""
    assert df.loc["odd", "strides"] == "20,10,1"
    assert df.loc["p", "data_offset"] == df.loc["x", "data_offset"] == df.loc["odd", "data_offset"]
    assert d.summary().tensor_bytes.iloc[0] == 60 * 4
    for name, ref in (("p", p), ("x", x), ("odd", x[:, ::2])):
        got = d.tensor_torch(0, 0, f"{name}.forward.0.output.0")
        assert got.is_contiguous() and same(got, ref.contiguous()), name
        assert np.array_equal(d.tensor(0, 0, f"{name}.forward.0.output.0"), ref.numpy())
    assert d.tensor_strides(0, 0, "p.forward.0.output.0") == (1, 20, 5)


def test_diff_compares_a_permutation_with_its_c_order_copy(tmp_path):
    """Two runs that recorded the same values in different layouts compare element by element
    in logical order."""
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(3))
    for run, t in (("a", x.t()), ("b", x.t().contiguous())):
        w = make_writer(DumpConfig(path=str(tmp_path / run), writer="sync", mode="tensor"),
                        rank=0, world_size=1)
        w.begin_step(0)
        w.add(meta("t"), t)
        w.end_step()
        w.close()
    assert open_dump(tmp_path / "a").stats(0, 0).strides.tolist() == ["1,7"]
    assert open_dump(tmp_path / "b").stats(0, 0).strides.tolist() == [""]
    assert diff(tmp_path / "a", tmp_path / "b").status == "same"
    # and a real difference in one element is found in the permuted layout too
    y = x.t().contiguous()
    y[2, 3] += 1.0
    w = make_writer(DumpConfig(path=str(tmp_path / "c"), writer="sync", mode="tensor"),
                    rank=0, world_size=1)
    w.begin_step(0)
    w.add(meta("t"), y)
    w.end_step()
    w.close()
    result = diff(tmp_path / "a", tmp_path / "c")
    assert result.status != "same"


def test_strides_that_reach_past_the_bytes_are_refused(tmp_path):
    """A damaged `strides` cell is a clear format error, not a read out of bounds."""
    from tracer._errors import DumpFormatError
    from tracer.storage._format import RECORD_FIELDS, root_attrs, step_path
    from tracer.storage._step_file import StepFile

    f = StepFile(step_path(tmp_path, 0, 0), root_attrs(rank=0, world_size=1, step=0,
                                                       level="module", mode="tensor", config={}),
                 spill_bytes=1 << 30)
    data = np.arange(12, dtype=np.float32)
    off = f.add_bytes(data.view(np.uint8))
    row = dict(seq=0, name="t.forward.0.output.0", module="t", op="", phase="forward",
               direction="output", index=0, call=0, dtype="float32", shape="3,4", numel=12,
               min=0.0, max=11.0, mean=5.5, norm=1.0, nan=0, posinf=0, neginf=0, zeros=1,
               checksum=0, source="x.py:1", data_offset=off, data_nbytes=48, strides="1,5",
               caller="")
    f.add_row(tuple(row[k] for k in RECORD_FIELDS))
    f.finish()
    with pytest.raises(DumpFormatError, match="reach past the stored bytes"):
        open_dump(tmp_path).tensor(0, 0, "t.forward.0.output.0")


def write_slices(run, writer: str) -> dict[str, torch.Tensor]:
    """Records a tensor, then slices and views of it (which store no bytes of their own), then
    slices that must store their own; returns the tensors as they were when recorded."""
    w = make_writer(DumpConfig(path=str(run), writer=writer, mode="full"), rank=0,
                    world_size=1)
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(4))
    x[1, 2, 5] = float("nan")  # in v and in the select
    q, k, v = x.split([2, 2, 4], dim=-1)
    within = {"split_q": q, "split_v": v, "head_t": k.transpose(0, 1), "narrow": x.narrow(1, 2, 3),
              "select": x[:, 2], "steps": x[:, ::2, 1::3], "last": x[-1, -1, -2:],
              "expand": x[0, 0].expand(5, 8), "column": x[..., 7], "first": x[0]}
    other = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))
    refs: dict[str, torch.Tensor] = {}
    w.begin_step(0)
    keep(w, refs, "x", x)
    for name, t in within.items():
        keep(w, refs, name, t)
    keep(w, refs, "unrecorded_base", other[:, ::2])  # its base has no record: a copy
    keep(w, refs, "x_bf16_slice", x.bfloat16()[:, 1])  # another dtype, another tensor: a copy
    x.mul_(2)  # the version changes: x's bytes no longer hold these values
    keep(w, refs, "changed_slice", x[:, ::2])
    keep(w, refs, "x_after", x)
    keep(w, refs, "slice_after", x[:, 1::2])  # inside the record just made
    w.end_step()
    w.close()
    return refs


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_slices_point_into_the_bytes_that_hold_them(tmp_path, writer):
    d, df = read_back(tmp_path, write_slices(tmp_path, writer))
    x_off, x_n = int(df.loc["x", "data_offset"]), int(df.loc["x", "data_nbytes"])
    inside = ["split_q", "split_v", "head_t", "narrow", "select", "steps", "last", "expand",
              "column", "first"]
    for name in inside:
        off, n = int(df.loc[name, "data_offset"]), int(df.loc[name, "data_nbytes"])
        assert x_off <= off and off + n <= x_off + x_n, name
    # strides over x's bytes, and the byte range from the first element to the last
    assert df.loc["split_v", "strides"] == "48,8,1"
    assert int(df.loc["split_v", "data_offset"]) == x_off + 4 * 4
    assert int(df.loc["split_v", "data_nbytes"]) == 4 * (3 * 48 + 5 * 8 + 3 + 1)
    assert df.loc["expand", "strides"] == "0,1" and int(df.loc["expand", "data_nbytes"]) == 32
    assert df.loc["head_t", "strides"] == "8,48,1"
    assert int(df.loc["first", "data_offset"]) == x_off and df.loc["first", "strides"] == ""
    # the statistics are each record's own
    assert int(df.loc["select", "nan"]) == 1 and int(df.loc["split_v", "nan"]) == 1
    assert int(df.loc["split_q", "nan"]) == 0
    assert df.loc["expand", "numel"] == 40
    # copies: a base with no record, another dtype, a changed base; then a new base
    own = ["x", "unrecorded_base", "x_bf16_slice", "changed_slice", "x_after"]
    assert len({int(df.loc[k, "data_offset"]) for k in own}) == len(own)
    assert df.loc["unrecorded_base", "strides"] == df.loc["changed_slice", "strides"] == ""
    after = int(df.loc["x_after", "data_offset"])
    assert after <= int(df.loc["slice_after", "data_offset"]) < after + x_n
    assert d.summary().tensor_bytes.iloc[0] == sum(int(df.loc[k, "data_nbytes"]) for k in own)


def test_sync_and_async_write_the_same_slices(tmp_path):
    write_slices(tmp_path / "s", "sync")
    write_slices(tmp_path / "a", "async")
    ds, da = open_dump(tmp_path / "s"), open_dump(tmp_path / "a")
    assert ds.stats(0, 0).equals(da.stats(0, 0))
    assert diff(tmp_path / "s", tmp_path / "a").status == "same"


def write_step(run, tensors: dict[str, torch.Tensor]) -> None:
    """One sync tensor-mode step 0 under `run` with a record of each tensor, in order."""
    w = make_writer(DumpConfig(path=str(run), writer="sync", mode="tensor"), rank=0,
                    world_size=1)
    w.begin_step(0)
    for name, t in tensors.items():
        w.add(meta(name), t)
    w.end_step()
    w.close()


def write_slice_runs(tmp_path, x: torch.Tensor, at: tuple[int, int]) -> None:
    """Runs a, b, c of records `x` and `piece` = x[:, ::3]: a slice pointing into x's bytes
    (a), the same values as a C-order copy (b), that copy with element `at` changed (c)."""
    changed = x[:, ::3].contiguous()
    changed[at] += 1.0
    for run, base, piece in (("a", x, x[:, ::3]), ("b", x.clone(), x[:, ::3].contiguous()),
                             ("c", x.clone(), changed)):
        write_step(tmp_path / run, {"x": base, "piece": piece})


def test_diff_compares_a_slice_with_its_copy(tmp_path):
    """A slice pointing into its base's bytes and the same values stored as a C-order copy
    (another run, or a 2.x writer) compare element by element; a changed element is found."""
    write_slice_runs(tmp_path, torch.randn(6, 10, generator=torch.Generator().manual_seed(6)),
                     (4, 1))
    assert open_dump(tmp_path / "a").stats(0, 0).strides.tolist() == ["", "10,3"]
    assert open_dump(tmp_path / "b").stats(0, 0).strides.tolist() == ["", ""]
    assert diff(tmp_path / "a", tmp_path / "b").status == "same"
    assert diff(tmp_path / "a", tmp_path / "a").status == "same"
    result = diff(tmp_path / "a", tmp_path / "c")
    assert result.status != "same" and result.first_divergence["name"] == "piece.forward.0.output.0"


def test_op_level_slices_share_their_base_bytes(tmp_path, monkeypatch):
    """A model splitting one projection into three heads (as attention does) stores the
    projection once; every record still reads back exactly."""

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.qkv(x).split(8, dim=-1)
            return (q.view(3, 2, 4).transpose(0, 1) * k.view(3, 2, 4).transpose(0, 1)
                    + v.view(3, 2, 4).transpose(0, 1)).sum()

    refs = record_adds(monkeypatch)
    torch.manual_seed(0)
    model = Heads()
    with tracer.Dumper(model, {"path": str(tmp_path), "level": "op", "mode": "tensor",
                               "writer": "sync", "phases": "forward", "params": False}):
        model(torch.randn(3, 8)).backward()
    d = open_dump(tmp_path)
    df = d.stats(0, 0)
    for name in df.name:
        assert same(d.tensor_torch(0, 0, name), refs[name]), name
    splits = df[(df.op == "aten.split") & (df.direction == "output")]
    assert len(splits) == 3 and (splits.strides != "").all()
    # q, k and v, their views and transposes store nothing of their own
    assert d.summary().tensor_bytes.iloc[0] < df.data_nbytes.sum() / 2


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_bytes_stay_shared_while_the_storage_lives(tmp_path, writer):
    """A record's memory stays reusable while its storage lives, after the tensor that made the
    record is gone: p.grad (a backward op's output, detach()ed), an output autograd saved for
    backward, matmul's result (an _unsafe_view of an mm output that dies at once)."""
    w = make_writer(DumpConfig(path=str(tmp_path), writer=writer, mode="tensor"), rank=0,
                    world_size=1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(7))
    ref = x.clone()
    w.begin_step(0)
    w.add(meta("first"), x)
    kept = x.detach()  # the same storage and version counter, not a view: x can die
    del x
    w.add(meta("second"), kept)
    w.add(meta("third"), kept.view(24))
    w.add(meta("piece"), kept[1:, ::2])
    w.end_step()
    w.close()
    d = open_dump(tmp_path)
    df = d.stats(0, 0).set_index("module")
    assert len(set(df.data_offset.loc[["first", "second", "third"]])) == 1
    assert int(df.loc["piece", "data_offset"]) == int(df.loc["first", "data_offset"]) + 6 * 4
    assert d.summary().tensor_bytes.iloc[0] == 24 * 4
    for name, want in (("first", ref), ("third", ref.view(24)), ("piece", ref[1:, ::2])):
        assert same(d.tensor_torch(0, 0, f"{name}.forward.0.output.0"), want.contiguous()), name


@pytest.mark.parametrize("mode", ["statistics", "tensor"])
@pytest.mark.parametrize("first_alive", [False, True])
def test_another_storage_at_the_same_address_is_not_reused(tmp_path, mode, first_alive):
    """A tensor at the address, size, dtype and version of a record, but on another storage,
    gets statistics (and bytes) of its own: the record's storage was freed and its memory given
    to a new one, or two storages wrap the same memory (torch.from_numpy twice) and the values
    changed without either version counter seeing it."""
    memory = np.arange(4096, dtype=np.float32)
    w = make_writer(DumpConfig(path=str(tmp_path), writer="sync", mode=mode), rank=0,
                    world_size=1)
    w.begin_step(0)
    old = torch.from_numpy(memory)
    w.add(meta("old"), old)
    if not first_alive:
        del old  # its storage goes: the memory is the array's
    memory[:] = -1.0  # behind every version counter
    new = torch.from_numpy(memory)
    assert new.data_ptr() == memory.ctypes.data and new._version == 0
    w.add(meta("new"), new)
    w.end_step()
    w.close()
    d = open_dump(tmp_path)
    df = d.stats(0, 0).set_index("module")
    assert df.loc["old", "max"] == 4095.0 and df.loc["new", "max"] == -1.0
    if mode == "tensor":
        assert df.loc["new", "data_offset"] != df.loc["old", "data_offset"]
        assert same(d.tensor_torch(0, 0, "new.forward.0.output.0"), torch.full((4096,), -1.0))


def test_two_op_tensor_dumps_of_the_trainer_gpt_diff_record_by_record(tmp_path):
    """Real dumps whose attention slices point into the projection's bytes: two seeded runs
    diff the same, and one weight changed in layer 1 is found there."""
    from trainer import GPT, config

    def run(path, perturb: bool = False):
        torch.manual_seed(0)
        cfg = config.tiny()
        model = GPT(cfg.model)
        if perturb:
            with torch.no_grad():
                model.transformer.h[1].attn.c_attn.weight[0, 0] += 0.5
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(0, cfg.model.vocab_size, (2, 16),
                            generator=torch.Generator().manual_seed(1))
        with tracer.Dumper(model, {"path": str(path), "level": "op", "mode": "tensor",
                                   "writer": "async"}):
            _, loss = model(ids, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return path

    a, b, c = run(tmp_path / "a"), run(tmp_path / "b"), run(tmp_path / "c", perturb=True)
    df = open_dump(a).stats(0, 0)
    splits = df[(df.op == "aten.split") & (df.direction == "output")]
    assert len(splits) == 6 and (splits.strides != "").all()
    assert diff(a, b).status == "same"
    result = diff(a, c)
    assert result.status == "diverged"
    assert result.first_divergence["module"].startswith("transformer.h.1.attn")


# the async writer of each model under `slow`: its bytes are the sync writer's (the diff of
# the two, below, holds that in the quick lane)
@pytest.mark.parametrize("writer", ["sync", pytest.param("async", marks=pytest.mark.slow)])
@pytest.mark.parametrize("level", ["op", "mix"])
@pytest.mark.parametrize("index", range(8), ids=[m[0] for m in stranger_models()])
def test_models_we_did_not_write_read_back_exactly(tmp_path, monkeypatch, writer, level, index):
    """Every record of a tensor dump of models we did not write (attention slices, BatchNorm
    and in-place ReLU, channels_last, LSTM gates, a custom Function, recomputation, a layer
    called twice, in-place ops) reads back bit for bit as the tensor was when recorded, however
    its bytes are shared."""
    from models import train_and_dump

    _, model_fn, batch_fn = stranger_models()[index]
    refs = record_adds(monkeypatch)
    d = train_and_dump(model_fn, batch_fn, tmp_path, steps=1, level=level, mode="tensor",
                       writer=writer)
    df = d.stats(0, 0)
    assert len(df) == len(refs) > 10
    for name in df.name:
        assert same(d.tensor_torch(0, 0, name), refs[name].contiguous()), name


@pytest.mark.parametrize("level", ["op", pytest.param("mix", marks=pytest.mark.slow)])
@pytest.mark.parametrize("index", range(8), ids=[m[0] for m in stranger_models()])
def test_sync_and_async_dumps_of_models_we_did_not_write_diff_the_same(tmp_path, level, index):
    """Two seeded steps of each model, one dumped by each writer, diff the same record by
    record (tensor mode): nothing differs between runs of the same code, scratch memory
    included (oneDNN's LSTM workspace is no record)."""
    from models import train_and_dump

    _, model_fn, batch_fn = stranger_models()[index]
    for run, writer in (("a", "sync"), ("b", "async")):
        train_and_dump(model_fn, batch_fn, tmp_path / run, steps=2, level=level, mode="tensor",
                       writer=writer)
    result = diff(tmp_path / "a", tmp_path / "b")
    assert result.status == "same", result.first_divergence


def test_slices_in_a_spilled_step_diff_the_same(tmp_path):
    """A step larger than half the queue cap is spilled to a side file as it runs: records
    pointing into other records' bytes still read the same as in a step kept in memory."""
    from trainer import GPT, config

    def run(path, **extra):
        torch.manual_seed(0)
        cfg = config.tiny()
        model = GPT(cfg.model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(0, cfg.model.vocab_size, (8, 64),
                            generator=torch.Generator().manual_seed(1))
        with tracer.Dumper(model, {"path": str(path), "level": "op", "mode": "tensor",
                                   "phases": "forward", **extra}):
            _, loss = model(ids, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return path

    kept = run(tmp_path / "kept", writer="sync")
    for writer in ("sync", "async"):
        spilled = run(tmp_path / writer, writer=writer, async_max_queued_mb=1)
        summary = open_dump(spilled).summary()
        # /tensors starts at the 16 MiB alignment of a spilled step
        assert int(summary.file_bytes.iloc[0]) > (16 << 20)
        assert diff(kept, spilled).status == "same", writer


@pytest.mark.slow
@pytest.mark.parametrize("index", range(8), ids=[m[0] for m in stranger_models()])
def test_statistics_do_not_depend_on_the_mode_or_the_steps_dumped(tmp_path, index):
    """The same seeded run gives the same records and statistics whether tensors are kept
    (statistics of copies, slices measured where they point) or not, and a step dumped alone
    (`steps: "2"`) equals that step of a run dumping every step: no reuse or sharing state
    changes a value, and none leaks from one step into the next."""
    from models import train_and_dump

    _, model_fn, batch_fn = stranger_models()[index]
    run = functools.partial(train_and_dump, model_fn, batch_fn, steps=3, level="mix",
                            writer="async")
    stats = run(tmp_path / "s", mode="statistics")
    tensors = run(tmp_path / "t", mode="tensor")
    alone = run(tmp_path / "one", mode="tensor", dump_steps="2")
    exact = ["name", "dtype", "shape", "numel", "min", "max", "nan", "posinf", "neginf",
             "zeros", "checksum"]
    for step in (0, 1, 2):
        a, b = stats.stats(0, step), tensors.stats(0, step)
        assert a[exact].equals(b[exact]), step
        assert np.allclose(a[["mean", "norm"]], b[["mean", "norm"]], rtol=1e-6, equal_nan=True)
    assert alone.steps(0) == [2]
    assert diff(tmp_path / "t", tmp_path / "one", step=2).status == "same"
    assert list(alone.stats(0, 2).name) == list(tensors.stats(0, 2).name)


def test_diff_reads_a_large_slice_in_bounded_chunks(tmp_path, monkeypatch):
    """A slice pointing into its base's bytes is compared a few rows at a time, never read
    whole (its extent can be nearly the whole base: q of an attention split); it still
    compares equal to a C-order copy and finds one changed element."""
    import tracer.analysis._diff_record as diff_module

    write_slice_runs(tmp_path, torch.randn(40, 30, generator=torch.Generator().manual_seed(10)),
                     (31, 4))
    reads: list[int] = []
    real_read = diff_module.TensorReader.read

    def spy(self, offset, nbytes, slot=0):
        reads.append(nbytes)
        return real_read(self, offset, nbytes, slot)

    monkeypatch.setattr(diff_module.TensorReader, "read", spy)
    monkeypatch.setattr(diff_module, "CHUNK_ELEMENTS", 25)  # 2.5 rows of the slice a chunk
    assert diff(tmp_path / "a", tmp_path / "b").status == "same"
    # no read of the slice spans more than the chunk's rows (4 rows of 30 elements, float32)
    assert max(reads) <= 4 * 30 * 4
    result = diff(tmp_path / "a", tmp_path / "c")
    assert result.status != "same" and result.first_divergence["name"] == "piece.forward.0.output.0"


def test_diff_reads_a_permutation_by_rows_of_its_first_dimension(tmp_path, monkeypatch):
    """A permutation that keeps its first dimension outermost (heads moved in front of the
    sequence, say) is stored in memory order and compared in chunks of rows against its
    C-order copy; a change is found in either layout."""
    import tracer.analysis._diff_record as diff_module

    z = torch.randn(6, 5, 7, generator=torch.Generator().manual_seed(11))
    p = z.permute(0, 2, 1)  # strides (35, 1, 7): the first dimension is still outermost
    changed = p.contiguous()
    changed[4, 6, 2] -= 1.0
    for run, t in (("a", p), ("b", p.contiguous()), ("c", changed)):
        write_step(tmp_path / run, {"p": t})
    assert open_dump(tmp_path / "a").stats(0, 0).strides.tolist() == ["35,1,7"]
    monkeypatch.setattr(diff_module, "CHUNK_ELEMENTS", 12)
    assert diff(tmp_path / "a", tmp_path / "b").status == "same"
    assert diff(tmp_path / "c", tmp_path / "a").status != "same"


def test_a_damaged_byte_length_is_a_clear_error(tmp_path):
    """A record whose data_nbytes does not match what its dtype, shape and strides read is
    named, with the dump it is in and what to do, by the API and by `sleuth diff` (exit 2)."""
    import re
    import shutil

    from sleuth.cli import main

    write_slice_runs(tmp_path, torch.randn(6, 10, generator=torch.Generator().manual_seed(12)),
                     (0, 0))
    shutil.copytree(tmp_path / "a", tmp_path / "damaged")
    with h5py.File(tmp_path / "damaged" / "dump" / "rank0" / "step0.h5", "r+") as f:
        table = f["records"][()]
        table["data_nbytes"][1] += 4  # the slice's byte range
        f["records"][...] = table
        # as a writer with this bug would store it: the table's CRC agrees with its bytes
        from tracer.storage._format import records_crc32

        f.attrs["records_crc32"] = records_crc32(table)
    res = diff(tmp_path / "a", tmp_path / "damaged")
    (problem,) = res.problems
    assert res.status == "incomplete" and (problem.side, problem.state) == ("B", "damaged")
    assert problem.path.endswith("damaged/dump/rank0/step0.h5")
    assert re.search(r"piece\.forward\.0\.output\.0\b.* 244 bytes\b.*\b240\b.*dump that step again",
                     problem.reason), problem.reason
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "damaged")]) == 2
