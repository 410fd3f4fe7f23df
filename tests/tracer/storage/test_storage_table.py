"""The step file's tables packed in C (`pack_rows`, tracer/storage/_table.c) against numpy's
packing.

`table_array` takes the C kernel's packing where it is built and numpy's otherwise; the two
must give the same array, byte for byte and dtype metadata included, for every row the writers
make, and the C side must step aside (answer None) wherever numpy would convert a value."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from tracer.storage import _h5_objects
from tracer.storage._format import HIT_COLUMNS, RECORD_COLUMNS
from tracer.storage._h5_objects import table_array
from tracer.storage._step_file import StepFile

pytestmark = pytest.mark.skipif(_h5_objects._pack_rows is None, reason="C kernel not built")


def _numpy_table(rows, columns):
    packer, _h5_objects._pack_rows = _h5_objects._pack_rows, None
    try:
        return table_array(rows, columns)
    finally:
        _h5_objects._pack_rows = packer


def _row(i: int, **changes):
    row = dict(seq=i, name=f"h.{i}.mlp::aten.addmm.forward.{i}.output.0", module=f"h.{i}.mlp",
               op="aten.addmm", phase="forward", direction="output", index=0, call=i,
               dtype="float32", shape="[8, 64]", numel=512, min=-1.5, max=2.5, mean=0.25,
               norm=12.5, nan=0, posinf=0, neginf=0, zeros=3, checksum=-(1 << 62) + i,
               source="train.py:12 in step", data_offset=-1, data_nbytes=0, strides="",
               caller="")
    row.update(changes)
    return tuple(row[name] for name, _ in RECORD_COLUMNS)


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    for name in a.dtype.names:
        assert a.dtype[name].metadata == b.dtype[name].metadata, name
    assert a.flags.writeable and a.flags.c_contiguous


def test_records_packed_in_c_equal_numpy_s():
    rows = [_row(i) for i in range(40)]
    rows[3] = _row(3, name="é.forward.0.output.0", source="", strides="[1, 8]",
                   min=float("nan"), max=float("inf"), mean=float("-inf"))
    rows[5] = _row(5, module="", op="", nan=True, min=3, index=np.int64(2),
                   checksum=np.int64(-7), norm=np.float64(0.5))
    rows[7] = _row(7, name="中文.forward.0.input.0", index=(1 << 31) - 1, call=-(1 << 31))
    packed = table_array(rows, RECORD_COLUMNS)
    _same(packed, _numpy_table(rows, RECORD_COLUMNS))
    assert packed["name"][3].decode() == "é.forward.0.output.0"
    assert packed["name"].dtype.itemsize == max(len(r[1].encode()) for r in rows)
    assert packed["index"][5] == 2 and packed["nan"][5] == 1 and packed["min"][5] == 3.0


def test_all_empty_strings_and_hits():
    rows = [_row(i, op="", strides="") for i in range(3)]
    packed = table_array(rows, RECORD_COLUMNS)
    _same(packed, _numpy_table(rows, RECORD_COLUMNS))
    assert packed.dtype["op"].itemsize == 1
    hits = [(4, "a.forward.0.output.0", "nan", float("nan"), "train.py:3"),
            (9, "b", "max > 10", 11.5, "")]
    _same(table_array(hits, HIT_COLUMNS), _numpy_table(hits, HIT_COLUMNS))


@pytest.mark.parametrize("changes", [
    {"numel": 4.0},                        # a float where an int goes: numpy truncates
    {"min": np.float32(0.1)},              # a numpy float that is not a Python float
    {"name": None},                        # not a str
    {"source": "bad \udc80 surrogate"},    # not encodable as UTF-8
    {"call": 1 << 31},                     # outside int32
])
def test_what_numpy_converts_is_left_to_numpy(changes):
    rows = [_row(0), _row(1, **changes)]
    assert _h5_objects._pack_rows(rows, _h5_objects._column_kinds(RECORD_COLUMNS)) is None
    try:
        expected = _numpy_table(rows, RECORD_COLUMNS)
    except (OverflowError, UnicodeEncodeError) as e:
        with pytest.raises(type(e)):
            table_array(rows, RECORD_COLUMNS)
        return
    _same(table_array(rows, RECORD_COLUMNS), expected)


def test_rows_of_the_wrong_shape_are_left_to_numpy():
    rows = [_row(0), _row(1)[:-1]]
    assert _h5_objects._pack_rows(rows, _h5_objects._column_kinds(RECORD_COLUMNS)) is None
    assert _h5_objects._pack_rows([list(_row(0))], _h5_objects._column_kinds(RECORD_COLUMNS)) is None
    with pytest.raises(ValueError, match="unknown column kind"):
        _h5_objects._pack_rows([(1,)], b"x")


def test_a_packed_table_round_trips_through_a_step_file(tmp_path):
    rows = [_row(i) for i in range(5)] + [_row(5, name="ü.forward.0.output.0")]
    file = StepFile(tmp_path / "step0.h5", {"step": 0}, spill_bytes=1 << 20)
    for row in rows:
        file.add_row(row)
    path = file.finish()
    with h5py.File(path) as f:
        got = f["records"][()]
        assert f["records"].id.get_type().get_member_type(1).get_cset() == h5py.h5t.CSET_UTF8
    assert got.tobytes() == _numpy_table(rows, RECORD_COLUMNS).tobytes()
    assert got["name"][5].decode() == "ü.forward.0.output.0"
