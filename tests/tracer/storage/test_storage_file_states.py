"""The reader's classification of step files (`Dump.file_states`, `Dump.problems`): what `diff`,
`check` and `dump ls` name when a step was not fully read."""
from __future__ import annotations

import warnings

import h5py
import numpy as np
import pytest

from tracer._errors import DumpFormatError
from tracer.storage._reader import open_dump
from tests.tracer.analysis.test_diff_synthetic import rec, write_step


def _run(tmp_path, steps=(0, 1, 2, 3, 4, 5)):
    x = np.arange(6, dtype=np.float32)
    for s in steps:
        write_step(tmp_path, [rec("m", "forward", "output", x)], step=s)
    return tmp_path / "dump" / "rank0"


def test_every_step_file_is_classified(tmp_path):
    rank0 = _run(tmp_path)
    with open(rank0 / "step1.h5", "r+b") as f:
        f.truncate(700)
    (rank0 / "step2.h5").write_bytes(b"not HDF5 at all")
    with h5py.File(rank0 / "step3.h5", "r+") as f:
        f.attrs["status"] = "interrupted"
        f.attrs["status_reason"] = "KeyboardInterrupt"
    with h5py.File(rank0 / "step4.h5", "r+") as f:
        f.attrs["complete"] = 0  # written before the `status` attribute existed
        if "status" in f.attrs:
            del f.attrs["status"], f.attrs["status_reason"]
    (rank0 / "step5.h5").rename(rank0 / "step5.h5.partial")
    (rank0 / "step0.h5.partial").write_bytes(b"")  # a leftover beside a complete file
    (tmp_path / "dump" / "rank1").mkdir()
    with pytest.warns(RuntimeWarning, match="skipped 4 partial, unreadable or other-run"):
        d = open_dump(tmp_path)
    states = {(s.rank, s.step, s.state) for s in d.file_states}
    assert states == {(0, 0, "complete"), (0, 0, "partial"), (0, 1, "truncated"),
                      (0, 2, "unreadable"), (0, 3, "interrupted"), (0, 4, "interrupted"),
                      (0, 5, "partial_only"), (1, None, "empty")}
    assert {(s.step, s.state) for s in d.problems} == {
        (1, "truncated"), (2, "unreadable"), (3, "interrupted"), (4, "interrupted"),
        (5, "partial_only"), (None, "empty")}
    assert d.steps(0) == [0, 3, 4]  # interrupted steps stay readable
    assert "700 bytes" in d.state(0, 1).reason and d.state(0, 1).path == str(rank0 / "step1.h5")
    assert d.state(0, 3).reason == "interrupted: KeyboardInterrupt"
    assert "complete=0" in d.state(0, 4).reason
    assert d.state(0, 0).state == "complete" and d.state(0, 9) is None
    # Dump.skipped keeps its form: (path, reason) of each file left out
    assert {p for p, _ in d.skipped} == {str(rank0 / n) for n in (
        "step1.h5", "step2.h5", "step5.h5.partial", "step0.h5.partial")}


def test_damaged_format_version_is_unreadable_but_a_newer_one_is_refused(tmp_path):
    rank0 = _run(tmp_path, steps=(0, 1))
    with h5py.File(rank0 / "step1.h5", "r+") as f:
        del f.attrs["format_version"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = open_dump(tmp_path)
    assert d.state(0, 1).state == "unreadable" and "format_version" in d.state(0, 1).reason
    with h5py.File(rank0 / "step1.h5", "r+") as f:
        f.attrs["format_version"] = "9.0"
    with pytest.raises(DumpFormatError, match="format_version 9.0"):
        open_dump(tmp_path)
