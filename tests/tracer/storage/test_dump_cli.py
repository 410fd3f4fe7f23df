"""`sleuth dump ls` and `sleuth dump show` on a small dump."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from sleuth.cli import main
from tracer._config import DumpConfig
from tracer.storage import RecordMeta, make_writer


@pytest.fixture
def run(tmp_path: Path) -> Path:
    for rank in (0, 1):
        w = make_writer(DumpConfig(path=str(tmp_path), writer="sync", mode="full"), rank=rank,
                        world_size=2)
        for step in (0, 5):
            w.begin_step(step)
            for i in range(3):
                w.add(RecordMeta(f"layers.{i}.forward.0.output.0", f"layers.{i}", "", "forward",
                                 "output", 0, 0, "train.py:42"),
                      torch.full((8, 8), float(i + step)))
            if step == 5:
                w.add_hit(dict(seq=1, name="layers.1.forward.0.output.0",
                               condition="max_abs_gt", value=6.0, source="train.py:42"))
            w.end_step()
        w.close()
    (tmp_path / "dump" / "rank0" / "step9.h5.partial").write_bytes(b"")
    return tmp_path


def test_ls(run, capsys):
    # the partial file left by a crash is a row of its own, marked, and the exit code says so
    assert main(["dump", "ls", str(run)]) == 1
    out = capsys.readouterr().out
    assert "2 rank(s), 5 step file(s)" in out
    assert "captured: level module, mode full, writer sync" in out
    assert "step9.h5.partial: partial file" in out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith(("0", "1"))]
    assert [(r[0], r[1], r[2], r[-1]) for r in lines] == [
        ("0", "0", "3", "complete"), ("0", "5", "3", "complete"), ("0", "9", "?", "partial"),
        ("1", "0", "3", "complete"), ("1", "5", "3", "complete")]
    (run / "dump" / "rank0" / "step9.h5.partial").unlink()
    assert main(["dump", "ls", str(run)]) == 0


def test_ls_json(run, capsys):
    assert main(["dump", "ls", str(run / "dump"), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"] == [0, 1] and len(data["files"]) == 5 and data["not_complete"] == 1
    assert data["files"][0]["tensor_bytes"] == 3 * 64 * 4
    assert data["files"][0]["status"] == "complete"
    assert [f["status"] for f in data["files"] if f["path"].endswith(".partial")] == ["partial"]
    assert data["skipped"][0]["path"].endswith("step9.h5.partial")


def damage_records(path: Path) -> None:
    """Flip bytes inside the /records table's data: the file opens, its names do not decode."""
    import h5py

    with h5py.File(path, "r") as f:
        offset, size = f["records"].id.get_offset(), f["records"].id.get_storage_size()
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + size, 7):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_ls_marks_damaged_interrupted_and_truncated(run, capsys):
    import h5py

    rank0 = run / "dump" / "rank0"
    damage_records(rank0 / "step0.h5")
    with h5py.File(rank0 / "step5.h5", "r+") as f:  # as the writer marks a step cut short
        f.attrs["status"] = "interrupted"
        f.attrs["status_reason"] = "KeyboardInterrupt"
    rank1 = run / "dump" / "rank1" / "step5.h5"
    rank1.write_bytes(rank1.read_bytes()[:3000])
    assert main(["dump", "ls", str(run)]) == 1
    out = capsys.readouterr().out
    rows = {(r[0], r[1]): r[-1] for r in (line.split() for line in out.splitlines())
            if len(r) >= 6 and r[0] in ("0", "1")}
    assert rows == {("0", "0"): "damaged", ("0", "5"): "interrupted", ("0", "9"): "partial",
                    ("1", "0"): "complete", ("1", "5"): "unreadable"}
    assert f"{rank0 / 'step5.h5'}: interrupted: KeyboardInterrupt" in out
    assert f"{rank0 / 'step0.h5'}: damaged: " in out and "CRC-32" in out
    assert "truncated" in out
    assert main(["dump", "show", str(run), "--step", "0"]) == 2
    err = capsys.readouterr().err
    assert str(rank0 / "step0.h5") in err and "damaged" in err


def test_show_filter_and_hits(run, capsys):
    assert main(["dump", "show", str(run), "--step", "5", "--filter", "layers.[12]*"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 step 5: 2 record(s), 1 watchpoint hit(s)" in out
    assert "layers.1.forward.0.output.0" in out and "layers.0.forward" not in out.split("hits")[0]
    assert "max_abs_gt" in out and "train.py:42" in out


def test_show_json_and_csv(run, capsys, tmp_path):
    csv = tmp_path / "out.csv"
    assert main(["dump", "show", str(run), "--step", "0", "--rank", "1", "--json",
                 "--filter", "re:layers\\.2", "--csv", str(csv)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["name"] == "layers.2.forward.0.output.0"
    assert rows[0]["max"] == 2.0 and rows[0]["numel"] == 64
    df = pd.read_csv(csv)
    assert list(df.name) == ["layers.2.forward.0.output.0"] and "checksum" in df.columns


def test_errors_exit_2(run, capsys, tmp_path):
    assert main(["dump", "show", str(run)]) == 2
    assert "choose one with --step" in capsys.readouterr().err
    assert main(["dump", "show", str(run), "--step", "0", "--filter", "nope*"]) == 2
    assert "matches none of the 3 records" in capsys.readouterr().err
    assert main(["dump", "show", str(run), "--step", "3"]) == 2
    assert "no step 3 for rank 0" in capsys.readouterr().err
    assert main(["dump", "ls", str(tmp_path / "missing")]) == 2
    assert "no dump at" in capsys.readouterr().err


def test_subprocess(run, sleuth_cli):
    r = sleuth_cli("dump", "show", str(run / "dump" / "rank1" / "step5.h5"))
    assert r.returncode == 0, r.stderr
    assert "rank 1 step 5: 3 record(s)" in r.stdout


def test_a_dump_of_the_compiled_op_observer_is_named(tmp_path, capsys):
    """Step files written through the compiled op observer (their config says
    "op_capture": "observer") record a few ops differently from the dispatch mode: `dump ls`
    says how they were captured, and a diff against a dispatch dump says why records differ."""
    import h5py
    import tracer
    from models import MLP, train_and_dump

    for name in ("a", "b"):
        train_and_dump(MLP, lambda: (torch.randn(2, 8),), tmp_path / name, steps=1,
                       level="op", writer="sync")
    step_file = tmp_path / "b" / "dump" / "rank0" / "step0.h5"
    with h5py.File(step_file, "a") as f:
        config = json.loads(f.attrs["config"])
        assert "op_capture" not in config  # one capture: files do not name it
        f.attrs["config"] = json.dumps({**config, "op_capture": "observer"})
    assert main(["dump", "ls", str(tmp_path / "b")]) == 0
    assert "captured: level op, mode statistics, op capture observer, writer sync" in \
        capsys.readouterr().out
    result = tracer.diff(tmp_path / "a", tmp_path / "b")
    assert any("op captures differ: A used dispatch, B observer" in n for n in result.notes)
    assert not any("op captures" in n for n in tracer.diff(tmp_path / "a", tmp_path / "a").notes)
