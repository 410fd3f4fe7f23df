"""The writers' one-call record of a plain CPU tensor (`Writer._plain`) against the general
path it stands in for: the same step file, byte for byte, and the same rows to the sinks."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from tracer._config import DumpConfig
from tracer.storage import RecordMeta, make_writer
from tracer.storage import _writer
from tracer.storage._stats import kernel_available


def meta(name: str) -> RecordMeta:
    return RecordMeta(f"{name}.forward.0.output.0", name, "", "forward", "output", 0, 0,
                      "model.py:7")


def records() -> list[tuple]:
    """(name, tensor, stable, stats) of a step: plain tensors first seen, seen again, read
    through a transpose or a view, changed in place, of every dtype the kernel reads; and the
    records the general path keeps (strided slices, float64, empty, inference, given stats)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 7, generator=g)
    w = torch.randn(16, 16, generator=g)
    with torch.inference_mode():
        frozen = torch.randn(5, generator=g)
    given = {"min": -1.0, "max": 2.0, "mean": 0.5, "norm": 3.0, "nan": 0, "posinf": 0,
             "neginf": 0, "zeros": 1, "checksum": 77}
    return [("x", x, True, None), ("x_again", x, True, None), ("x_t", x.t(), True, None),
            ("x_view", x.view(-1), True, None), ("w_t", w.t(), True, None),
            ("w", w, True, None), ("w_t_again", w.t(), True, None),
            ("unstable", x, False, None), ("slice", x[:, 2:5], True, None),
            ("row", x[3], True, None),
            ("bf16", (x * 100).bfloat16(), True, None), ("f16", x.half(), True, None),
            ("i64", torch.arange(-5, 40), True, None),
            ("i8", torch.randint(-128, 127, (33,), dtype=torch.int8, generator=g), True, None),
            ("bool", torch.rand(9, generator=g) > 0.5, True, None),
            ("f64", x.double(), True, None), ("empty", torch.zeros(0, 4), True, None),
            ("nan", torch.tensor([float("nan"), float("inf"), 1.0]), True, None),
            ("frozen", frozen, True, None), ("frozen_unstable", frozen, False, None),
            ("perm", torch.randn(2, 3, 4, generator=g).permute(2, 0, 1), True, None),
            ("given", w.clone(), True, dict(given)),
            ("given_sketch", w.clone(), True, {**given, "sketch": np.arange(128.0)})]


def write_step(path, general: bool, writer: str, monkeypatch) -> tuple[list, dict]:
    if general:
        monkeypatch.setattr(_writer.Writer, "_plain",
                            lambda self, *a: _writer._NOT_PLAIN)
    w = make_writer(DumpConfig(path=str(path), writer=writer, mode="statistics"), rank=0,
                    world_size=1)
    made: list = []
    w.row_sinks.append(lambda row, step: made.append((step, row)))
    seen: list = []
    w.observers.append(seen.append)
    w.begin_step(0)
    items = records()
    for name, t, stable, stats in items[:-4]:
        w.add(meta(name), t, stable, None, stats)
    items[0][1].mul_(2)  # changed in place: measured again
    w.add(meta("x_changed"), items[0][1])
    for name, t, stable, stats in items[-4:]:
        w.add(meta(name), t, stable, None, stats)
    w.end_step()
    w.close()
    monkeypatch.undo()
    with h5py.File(path / "dump" / "rank0" / "step0.h5", "r") as f:
        tables = {key: f[key][()] for key in ("records", "sketches")}
    return made, {"tables": tables, "observed": seen}


def same(a, b) -> bool:
    """Equal, NaN equal to NaN (an empty tensor's statistics)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_the_plain_record_writes_what_the_general_path_writes(tmp_path, writer, monkeypatch):
    if not kernel_available():
        pytest.skip("the one-call record needs the C kernel, which is not built here")
    plain_rows, plain = write_step(tmp_path / "plain", False, writer, monkeypatch)
    general_rows, general = write_step(tmp_path / "general", True, writer, monkeypatch)
    assert len(plain_rows) == len(general_rows) == 24
    for (s1, r1), (s2, r2) in zip(plain_rows, general_rows):
        assert s1 == s2 and type(r1) is type(r2)
        assert all(same(a, b) for a, b in zip(r1, r2)), (r1, r2)
    for key in ("records", "sketches"):
        assert plain["tables"][key].tobytes() == general["tables"][key].tobytes(), key
    assert len(plain["observed"]) == len(general["observed"]) == 24
    for d1, d2 in zip(plain["observed"], general["observed"]):
        assert d1.keys() == d2.keys() and all(same(d1[k], d2[k]) for k in d1)
    # the transposes' sketches are their own (another order than the memory's first record)
    sketches = plain["tables"]["sketches"]
    names = [r[1] for _, r in plain_rows]
    assert not np.array_equal(sketches[names.index("w_t.forward.0.output.0")],
                              sketches[names.index("w.forward.0.output.0")])
    assert np.array_equal(sketches[names.index("w_t.forward.0.output.0")],
                          sketches[names.index("w_t_again.forward.0.output.0")])
