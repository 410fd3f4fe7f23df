"""A statistics dump whose record was forged where the sketch cannot see it: the maximum grown
25,000-fold, the sampled elements, the checksum and the table's CRC left as they were. The diff
was `same` (the equal checksum cleared every statistic's difference, and the agreeing sketch
had the last word); a statistic beyond tolerance is a divergence whatever the sketch and the
checksum say (docs/diff.md, "Sketches")."""
from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import pytest


def _statistics_dump(run: Path) -> Path:
    import torch

    from tracer._config import DumpConfig
    from tracer.storage import RecordMeta, make_writer

    w = make_writer(DumpConfig(path=str(run), writer="sync", mode="statistics"), rank=0,
                    world_size=1)
    w.begin_step(0)
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        w.add(RecordMeta(f"fc{i}.forward.0.output.0", f"fc{i}", "", "forward", "output", 0, 0,
                         "m.py:1"), torch.randn(4096, generator=gen))
    w.end_step()
    w.close()
    return run / "dump" / "rank0" / "step0.h5"


@pytest.mark.parametrize("also_checksum", [False, True])
def test_forged_maximum_is_never_same(tmp_path, also_checksum, capsys):
    from sleuth.cli import main
    from tracer.storage._format import records_crc32

    good = tmp_path / "good"
    path = _statistics_dump(good)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    with h5py.File(bad / path.relative_to(good), "r+") as f:
        assert "sketches" in f
        table = f["records"][...]
        table["max"][1] *= 25_000
        if also_checksum:
            table["checksum"][1] ^= 1
        f["records"][...] = table
        f.attrs["records_crc32"] = records_crc32(table)
    code = main(["diff", str(good), str(bad)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "DIVERGED" in out and "fc1.forward.0.output.0" in out and "max" in out, out
    if not also_checksum:
        assert "the checksums are equal" in out, out
