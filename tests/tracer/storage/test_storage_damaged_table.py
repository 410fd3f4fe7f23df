"""A step file whose /records table is damaged (not a table, names that are not UTF-8, a column
missing, a scalar) reads as one DumpFormatError naming the file and how to go on, never a
UnicodeDecodeError or IndexError; `sleuth dump show` exits 2 with that line."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from sleuth.cli import main
from tracer._config import DumpConfig
from tracer._errors import DumpFormatError
from tracer.storage._reader import open_dump
from tracer.storage import RecordMeta, make_writer


def _one_step(run) -> None:
    w = make_writer(DumpConfig(path=str(run), writer="sync", mode="statistics"), rank=0,
                    world_size=1)
    w.begin_step(0)
    w.add(RecordMeta("fc.forward.0.output.0", "fc", "", "forward", "output", 0, 0, "m.py:1"),
          torch.ones(2, 3))
    w.end_step()
    w.close()


def _replace_records(f: h5py.File, case: str) -> None:
    table = f["records"][()]
    del f["records"]
    if case == "group":
        f.create_group("records")
    elif case == "scalar":
        f["records"] = np.float64(1.0)
    elif case == "no_name_column":
        keep = [n for n in table.dtype.names if n != "name"]
        f["records"] = table[keep]
    elif case == "names_not_utf8":
        width = max(table.dtype["name"].itemsize, 4)
        dt = [(n, f"S{width}" if n == "name" else table.dtype[n]) for n in table.dtype.names]
        bad = table.astype(dt)
        bad["name"] = b"\xff\xfe\xfd"
        f["records"] = bad
    elif case == "module_not_utf8":
        bad = table.copy()
        width = table.dtype["module"].itemsize
        bad["module"] = b"\xff" * width
        f["records"] = bad


@pytest.mark.parametrize("case", ["group", "scalar", "no_name_column", "names_not_utf8",
                                  "module_not_utf8"])
def test_damaged_records_table_is_one_clear_error(tmp_path, capsys, case):
    _one_step(tmp_path)
    path = tmp_path / "dump" / "rank0" / "step0.h5"
    assert len(open_dump(tmp_path).stats(0, 0)) == 1
    with h5py.File(path, "r+") as f:
        _replace_records(f, case)
    with pytest.raises(DumpFormatError) as e:
        open_dump(tmp_path).stats(0, 0)
    assert str(path) in str(e.value) and "/records table is damaged" in str(e.value)
    assert main(["dump", "show", str(tmp_path), "--step", "0"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
