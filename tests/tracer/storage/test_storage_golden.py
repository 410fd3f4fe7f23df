"""Step files written by formats 1.0, 2.0 and 3.0 (checked in) still read: pin the on-disk
format.

Files of earlier formats are frozen: the 1.0 file's script is in this file's history (a sync
writer, mode full, rank 1 of 2, step 7), the 2.0 file was made as `write_golden` makes the 3.0
one. Regenerate the current one (SLEUTH_UPDATE_GOLDEN=1) only when its format changes on
purpose, with a new format_version and a new file beside the old ones.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import torch

from tracer.storage._reader import open_dump

GOLDEN = Path(__file__).parents[1] / "data" / "dump_format_1_0_rank1_step7.h5"


def test_golden_1_0_file_reads(tmp_path):
    run = tmp_path / "dump" / "rank1"
    run.mkdir(parents=True)
    shutil.copy(GOLDEN, run / "step7.h5")
    for path in (GOLDEN, tmp_path):
        d = open_dump(path)
        assert d.ranks == [1] and d.steps(1) == [7]
    attrs = d.attrs(1, 7)
    assert attrs["format_version"] == "1.0" and attrs["world_size"] == 2 and attrs["mode"] == "full"
    df = d.stats(1, 7)
    assert list(df.name) == [f"{m}.forward.0.output.0"
                             for m in ("<root>", "emb", "attn", "mask", "fp8", "half")]
    assert list(df.dtype) == ["int64", "bfloat16", "float32", "bool", "float8_e4m3fn", "float16"]
    assert list(df["shape"]) == ["2,3", "3,4", "4", "2", "5", ""]
    assert list(df.source) == [f"golden.py:{i}" for i in range(1, 7)]
    attn = df.iloc[2]
    assert math.isnan(attn["max"]) and (attn.nan, attn.posinf, attn.zeros) == (1, 1, 1)
    assert df.iloc[0]["checksum"] == 15 and df.iloc[0]["mean"] == 2.5
    assert np.array_equal(d.tensor(1, 7, "<root>.forward.0.output.0"), np.arange(6).reshape(2, 3))
    emb = torch.linspace(-2, 2, 12).reshape(3, 4).bfloat16()
    assert torch.equal(d.tensor_torch(1, 7, "emb.forward.0.output.0"), emb)
    assert np.array_equal(d.tensor(1, 7, "emb.forward.0.output.0"), emb.float().numpy())
    fp8 = d.tensor_torch(1, 7, "fp8.forward.0.output.0")
    assert torch.equal(fp8.view(torch.uint8),
                       torch.linspace(-1, 1, 5).to(torch.float8_e4m3fn).view(torch.uint8))
    assert d.tensor(1, 7, "half.forward.0.output.0").item() == 0.5
    assert d.tensor(1, 7, "mask.forward.0.output.0").tolist() == [True, False]
    hits = d.hits(1, 7)
    assert hits.to_dict("records") == [dict(seq=2, name="attn.forward.0.output.0",
                                            condition="nan_inf", value=1.0, source="golden.py:3")]


GOLDEN_2_0 = Path(__file__).parents[1] / "data" / "dump_format_2_0_rank0_step3.h5"


def _golden_2_0_tensors() -> dict[str, torch.Tensor]:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5.5
    y = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).bfloat16()
    return {"x": x, "xt": x.t(), "yp": y.permute(2, 0, 1), "gap": x[:, ::2]}


def test_golden_2_0_file_reads():
    # written by format 2.0's writer, as `write_golden` writes the 3.0 file (from these
    # tensors, step 3); frozen since: today's writer makes 3.0 files
    d = open_dump(GOLDEN_2_0)
    assert d.attrs(0, 3)["format_version"] == "2.0"
    df = d.stats(0, 3).set_index("module")
    # the transpose shares x's bytes, the permutation is stored in memory order, the strided
    # slice with gaps is a C-order copy
    assert df.loc["xt", "strides"] == "1,4" and df.loc["xt", "data_offset"] == df.loc["x", "data_offset"]
    assert df.loc["yp", "strides"] == "1,12,4" and df.loc["gap", "strides"] == ""
    assert d.summary().tensor_bytes.iloc[0] == 48 + 48 + 24
    for name, ref in _golden_2_0_tensors().items():
        got = d.tensor_torch(0, 3, f"{name}.forward.0.output.0")
        assert got.dtype == ref.dtype and torch.equal(got, ref.contiguous()), name
        assert got.is_contiguous()


GOLDEN_3_0 = Path(__file__).parents[1] / "data" / "dump_format_3_0_rank0_step5.h5"


def _golden_3_0_tensors() -> dict[str, torch.Tensor]:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5.5
    y = torch.arange(8, dtype=torch.float32).reshape(2, 4).bfloat16()
    return {"x": x, "piece": x[:, 1::2], "row": x[1], "bcast": x[2, :1].expand(2, 3),
            "y": y, "y_col": y[:, 3]}


def write_golden(path: Path, tensors: dict[str, torch.Tensor], step: int) -> None:
    """How the checked-in file of the current format is made (SLEUTH_UPDATE_GOLDEN=1 rewrites
    it; files of earlier formats are frozen)."""
    import os
    import tempfile

    from tracer._config import DumpConfig
    from tracer.storage import RecordMeta, make_writer

    run = Path(tempfile.mkdtemp())
    w = make_writer(DumpConfig(path=str(run), writer="sync", mode="full"), rank=0,
                    world_size=1)
    w.begin_step(step)
    for i, (name, t) in enumerate(tensors.items()):
        w.add(RecordMeta(f"{name}.forward.0.output.0", name, "", "forward", "output", 0, 0,
                         f"golden.py:{i + 1}"), t)
    w.end_step()
    w.close()
    os.replace(run / "dump" / "rank0" / f"step{step}.h5", path)


def test_golden_3_0_file_reads():
    import os

    if os.environ.get("SLEUTH_UPDATE_GOLDEN") == "1":
        write_golden(GOLDEN_3_0, _golden_3_0_tensors(), 5)
    d = open_dump(GOLDEN_3_0)
    assert d.attrs(0, 5)["format_version"] == "3.0"
    df = d.stats(0, 5).set_index("module")
    # slices point into the bytes of the record holding their elements: x and y alone stored
    assert d.summary().tensor_bytes.iloc[0] == 48 + 16
    x_off = int(df.loc["x", "data_offset"])
    assert (df.loc["piece", "strides"], int(df.loc["piece", "data_offset"]),
            int(df.loc["piece", "data_nbytes"])) == ("4,2", x_off + 4, 4 * 11)
    assert (df.loc["row", "strides"], int(df.loc["row", "data_offset"])) == ("", x_off + 16)
    assert df.loc["bcast", "strides"] == "0,0" and int(df.loc["bcast", "data_nbytes"]) == 4
    assert df.loc["y_col", "strides"] == "4"
    for name, ref in _golden_3_0_tensors().items():
        got = d.tensor_torch(0, 5, f"{name}.forward.0.output.0")
        assert got.dtype == ref.dtype and torch.equal(got, ref.contiguous()), name
        assert got.is_contiguous()
    assert df.loc["bcast", "max"] == 2.5 and df.loc["bcast", "numel"] == 6
