"""The statistics-mode fast path (tracer.storage._fastpath) against the general path it
shortcuts."""
from __future__ import annotations

import pytest
import torch

import tracer.storage._fastpath as fastpath
import tracer.storage._writer as writer_module
from models import stranger_models, train_and_dump
from tracer._config import DumpConfig
from tracer.storage import RecordMeta, make_writer
from tracer.storage._stats import fused_available

pytestmark = pytest.mark.skipif(not fused_available(),
                                reason="the fast path needs the C kernel "
                                "(tracer/storage/_fused.c)")


def general_only(monkeypatch) -> None:
    """Writers made from now on take every record the general way."""
    monkeypatch.setattr(writer_module, "lean_available", lambda writer: False)


@pytest.mark.parametrize("writer", ["sync", "async"])
@pytest.mark.parametrize("index", range(8), ids=[m[0] for m in stranger_models()])
def test_fast_and_general_paths_write_the_same_rows(tmp_path, monkeypatch, writer, index):
    """Module and op records of models we did not write, forward, backward and parameters,
    over two steps: every column of every row is the same with and without the fast path,
    to the bit (one kernel computes both)."""
    _, model_fn, batch_fn = stranger_models()[index]
    fast = train_and_dump(model_fn, batch_fn, tmp_path / "fast", steps=2, level="mix",
                          mode="statistics", writer=writer)
    general_only(monkeypatch)
    slow = train_and_dump(model_fn, batch_fn, tmp_path / "slow", steps=2, level="mix",
                          mode="statistics", writer=writer)
    for step in (0, 1):
        a, b = fast.stats(0, step), slow.stats(0, step)
        assert len(a) == len(b) > 0
        assert a.drop(columns=["source"]).equals(b.drop(columns=["source"])), step
        assert list(a.source) == list(b.source)


def test_fast_path_takes_plain_records_and_leaves_the_rest(tmp_path, monkeypatch):
    """Contiguous CPU tensors of the kernel's dtypes take the fast path; float64, complex,
    strided views, empty and meta tensors go the general way, and the rows are the same either
    way."""
    taken: list[str] = []
    real = fastpath.stats_row

    def spy(writer, target, step, seq, meta, t, *rest):
        out = real(writer, target, step, seq, meta, t, *rest)
        if out is not fastpath.NOT_HERE:
            taken.append(meta.name)
        return out

    monkeypatch.setattr(writer_module, "stats_row", spy)
    x = torch.randn(6, 5)
    cases = {"f32": x, "ids": torch.arange(10), "mask": x > 0, "bf16": x.bfloat16(),
             "f64": x.double(), "complex": torch.randn(3, dtype=torch.complex64),
             "strided": x[:, ::2], "transpose": x.t(), "empty": torch.empty(0),
             "meta": torch.empty(3, device="meta")}
    w = make_writer(DumpConfig(path=str(tmp_path), mode="statistics", writer="sync"), rank=0,
                    world_size=1)
    rows = []
    w.observers.append(rows.append)
    w.begin_step(0)
    for name, t in cases.items():
        w.add(RecordMeta(name, "m", "", "forward", "output", 0, 0, "x.py:1"), t)
    w.end_step()
    w.close()
    assert taken == ["f32", "ids", "mask", "bf16"]
    by_name = {r["name"]: r for r in rows}
    assert by_name["ids"]["max"] == 9.0 and by_name["ids"]["checksum"] == 45
    assert by_name["mask"]["zeros"] == int((x <= 0).sum())
    assert by_name["transpose"]["checksum"] == by_name["f32"]["checksum"]
