"""The dump reader: path forms, partial and unreadable files, version refusal, no torch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tracer._config import DumpConfig
from tracer._errors import DumpFormatError, RecordNotFoundError
from tracer.storage import decode_bits, open_dump
from tracer.storage import RecordMeta, make_writer

REPO = Path(__file__).resolve().parents[3]


def make_run(run: Path, ranks=(0,), steps=(0, 2), mode="full") -> None:
    for rank in ranks:
        w = make_writer(DumpConfig(path=str(run), writer="sync", mode=mode), rank=rank,
                        world_size=len(ranks))
        for step in steps:
            w.begin_step(step)
            for i in range(3):
                w.add(RecordMeta(f"layers.{i}.forward.0.output.0", f"layers.{i}", "", "forward",
                                 "output", 0, 0, "m.py:1"),
                      torch.full((2, 3), float(rank * 100 + step * 10 + i)))
            w.end_step()
        w.close()


def test_path_forms(tmp_path):
    make_run(tmp_path, ranks=(0, 1))
    for p in (tmp_path, tmp_path / "dump"):
        d = open_dump(p)
        assert d.ranks == [0, 1] and d.steps(1) == [0, 2]
    rank1 = open_dump(tmp_path / "dump" / "rank1")
    assert rank1.ranks == [1] and rank1.steps(1) == [0, 2]
    one = open_dump(tmp_path / "dump" / "rank1" / "step2.h5")
    assert one.ranks == [1] and one.steps(1) == [2]
    assert float(one.tensor(1, 2, "layers.2.forward.0.output.0")[0, 0]) == 122.0
    assert one.stats(1).shape[0] == 3  # the only step is the default


def test_stats_tables(tmp_path):
    make_run(tmp_path)
    d = open_dump(tmp_path)
    df = d.stats(0, 2)
    assert list(df.columns[:4]) == ["seq", "name", "module", "op"]
    assert list(df["max"]) == [20.0, 21.0, 22.0] and list(df["shape"]) == ["2,3"] * 3
    both = d.stats(0)
    assert list(both["step"]) == [0, 0, 0, 2, 2, 2]
    assert d.records(0, 0).equals(d.stats(0, 0))
    assert d.record(0, 2, "layers.1.forward.0.output.0")["mean"] == 21.0
    assert d.hits(0, 0).empty and list(d.hits(0, 0).columns)[:2] == ["seq", "name"]


def test_helpful_errors(tmp_path):
    make_run(tmp_path, mode="statistics")
    d = open_dump(tmp_path)
    with pytest.raises(RecordNotFoundError, match="did you mean 'layers.1.forward.0.output.0'"):
        d.tensor(0, 0, "layers.1.forward.0.output.1")
    with pytest.raises(DumpFormatError, match="no step 7 for rank 0 .* steps: 0, 2"):
        d.stats(0, 7)
    with pytest.raises(DumpFormatError, match=r"no rank 3 .* ranks: \[0\]"):
        d.stats(3, 0)
    with pytest.raises(DumpFormatError, match="mode 'statistics'; dump with mode 'tensor'"):
        d.tensor(0, 0, "layers.1.forward.0.output.0")
    with pytest.raises(DumpFormatError, match="pass step="):
        d.hits(0)
    with pytest.raises(DumpFormatError, match="no dump at"):
        open_dump(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpFormatError, match=r"expected RUN/dump/rank\{R\}/step\{S\}.h5"):
        open_dump(tmp_path / "empty")


def test_partial_and_unreadable_files_are_skipped_with_a_reason(tmp_path):
    make_run(tmp_path)
    rank0 = tmp_path / "dump" / "rank0"
    (rank0 / "step4.h5.partial").write_bytes(b"\x89HDF half written")
    (rank0 / "step5.h5").write_bytes(b"garbage, not HDF5")
    with pytest.warns(RuntimeWarning, match="skipped 2 partial, unreadable or other-run"):
        d = open_dump(tmp_path)
    assert d.steps(0) == [0, 2]
    reasons = dict(d.skipped)
    assert "partial file" in reasons[str(rank0 / "step4.h5.partial")]
    assert "unreadable" in reasons[str(rank0 / "step5.h5")]
    with pytest.raises(DumpFormatError, match="is a partial file"):
        open_dump(rank0 / "step4.h5.partial")


def test_newer_major_version_is_refused(tmp_path):
    make_run(tmp_path, steps=(0,))
    path = tmp_path / "dump" / "rank0" / "step0.h5"
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = "1.7"
    assert open_dump(tmp_path).steps(0) == [0]  # any 1.x reads
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = "2.4"
    assert open_dump(tmp_path).steps(0) == [0]  # and any 2.x
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = "3.2"
    assert open_dump(tmp_path).steps(0) == [0]  # and any 3.x
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = "4.0"
    with pytest.raises(DumpFormatError,
                       match="format_version 4.0; this sleuth reads formats 1.x to 3.x"):
        open_dump(tmp_path)
    with pytest.raises(DumpFormatError, match="4.0"):
        open_dump(path)


def test_bfloat16_decoding_is_exact():
    values = torch.tensor([1.0, -0.0, 3.140625, 1e-40, float("inf"), 65280.0]).bfloat16()
    raw = values.view(torch.int16).numpy().view(np.uint8)
    out = decode_bits(raw, "bfloat16", (6,))
    assert torch.equal(torch.from_numpy(out), values.float())


def test_reader_works_without_torch(tmp_path):
    make_run(tmp_path)
    code = (
        "import sys, tracer\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        f"d = tracer.open_dump({str(tmp_path)!r})\n"
        "df = d.stats(0, 2)\n"
        "t = d.tensor(0, 2, 'layers.1.forward.0.output.0')\n"
        "assert t.shape == (2, 3) and float(t.sum()) == 126.0, t\n"
        "print(len(df), d.steps(0))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SLEUTH_DUMP_CONFIG", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "3 [0, 2]"
