"""Statistics-only step files of the async writer are written by a helper process
(tracer._filer), which the parent falls back from without losing a step."""
from __future__ import annotations

import warnings

import pytest
import torch

from tracer._config import DumpConfig
from tracer._errors import DumpWriteError
from tracer._reader import open_dump
from tracer._writer import RecordMeta, make_writer


def meta(i: int) -> RecordMeta:
    return RecordMeta(f"m{i}.forward.0.output.0", f"m{i}", "", "forward", "output", 0, 0,
                      "x.py:1")


def write_steps(w, steps, start: int = 0) -> None:
    g = torch.Generator().manual_seed(0)
    for step in range(start, start + steps):
        w.begin_step(step)
        for i in range(4):
            w.add(meta(i), torch.randn(64, generator=g))
        w.end_step()


def test_statistics_files_go_through_the_helper_and_match_sync(tmp_path):
    w = make_writer(DumpConfig(path=str(tmp_path / "a"), writer="async", mode="statistics"),
                    rank=0, world_size=1)
    write_steps(w, 3)
    w.close()
    assert w._filer.files == 3 and len(w.files_written) == 3
    s = make_writer(DumpConfig(path=str(tmp_path / "s"), writer="sync", mode="statistics"),
                    rank=0, world_size=1)
    write_steps(s, 3)
    s.close()
    for step in range(3):
        assert open_dump(tmp_path / "a").stats(0, step).equals(
            open_dump(tmp_path / "s").stats(0, step))
    assert w._filer._proc is None  # ended at close


def test_a_dead_helper_falls_back_without_losing_a_step(tmp_path):
    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", mode="statistics"), rank=0,
                    world_size=1)
    write_steps(w, 1)
    w.flush()
    assert w._filer.files == 1
    w._filer._proc.kill()
    w._filer._proc.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_steps(w, 2, start=1)
        w.close()
    assert any("file-writer process failed" in str(c.message) for c in caught)
    assert open_dump(tmp_path).steps(0) == [0, 1, 2]
    assert w._filer.files == 1  # the later steps were written by the writer's own threads


def test_a_failed_write_in_the_helper_is_the_writers_error(tmp_path):
    (tmp_path / "dump").write_text("a file where the dump folder should be")
    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", mode="statistics"), rank=0,
                    world_size=1)
    with pytest.raises(DumpWriteError, match="writer thread"):
        write_steps(w, 1)
        w.close()


def test_without_the_helper_process_the_threads_write_the_files(tmp_path, monkeypatch):
    import tracer._async as async_module

    monkeypatch.setattr(async_module, "_USE_FILER", False)  # SLEUTH_FILE_PROCESS=0
    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", mode="statistics"), rank=0,
                    world_size=1)
    assert w._filer is None
    write_steps(w, 2)
    w.close()
    assert open_dump(tmp_path).steps(0) == [0, 1]
