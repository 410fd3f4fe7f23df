"""A step file written by format 1.0 (checked in) still reads: pins the on-disk format.

Regenerate only when the format changes on purpose (and bump format_version): see the
script in this file's history (a sync writer, mode full, rank 1 of 2, step 7).
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import torch

from tracer._reader import open_dump

GOLDEN = Path(__file__).parent / "data" / "dump_format_1_0_rank1_step7.h5"


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
