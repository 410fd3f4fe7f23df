"""The async writer's step files are written by a helper process (tracer.storage._file_process): whole
statistics-only files, and the HDF5 part of files with tensor bytes (the bytes are written by
the parent); the parent falls back from it without losing a step."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tracer._config import DumpConfig
from tracer._errors import DumpWriteError
from tracer.storage._reader import open_dump
from tracer.storage import RecordMeta, make_writer


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
    assert w._file_process.wait_ready()
    before = w._file_process.files  # the helper is shared by the process's writers
    write_steps(w, 3)
    w.close()
    assert w._file_process.files == before + 3 and len(w.files_written) == 3
    s = make_writer(DumpConfig(path=str(tmp_path / "s"), writer="sync", mode="statistics"),
                    rank=0, world_size=1)
    write_steps(s, 3)
    s.close()
    for step in range(3):
        assert open_dump(tmp_path / "a").stats(0, step).equals(
            open_dump(tmp_path / "s").stats(0, step))
    # kept for the next writer: its start is paid once a process
    again = make_writer(DumpConfig(path=str(tmp_path / "b"), writer="async",
                                   mode="statistics"), rank=0, world_size=1)
    assert again._file_process is w._file_process and w._file_process._proc is not None
    again.close()


@pytest.mark.slow
def test_a_dead_helper_falls_back_without_losing_a_step(tmp_path):
    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", mode="statistics"), rank=0,
                    world_size=1)
    assert w._file_process.wait_ready()
    before = w._file_process.files
    write_steps(w, 1)
    w.flush()
    assert w._file_process.files == before + 1
    w._file_process._proc.kill()
    w._file_process._proc.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_steps(w, 2, start=1)
        w.close()
    assert any("file-writer process failed" in str(c.message) for c in caught)
    assert open_dump(tmp_path).steps(0) == [0, 1, 2]
    assert w._file_process.files == before + 1  # the later steps: by the writer's own threads
    # the next writer gets a new helper
    again = make_writer(DumpConfig(path=str(tmp_path / "b"), writer="async",
                                   mode="statistics"), rank=0, world_size=1)
    assert again._file_process is not w._file_process and again._file_process.wait_ready()
    again.close()


def test_a_failed_write_in_the_helper_is_the_writers_error(tmp_path):
    (tmp_path / "dump").write_text("a file where the dump folder should be")
    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", mode="statistics",
                               on_error="raise"), rank=0, world_size=1)
    with pytest.raises(DumpWriteError, match="writing step 0 .* failed: .*Not a directory"):
        write_steps(w, 1)
        w.close()


@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_while_the_helper_starts_the_threads_write_the_files(tmp_path, monkeypatch, mode):
    """A step ending before the helper has imported h5py is written by the writer's threads
    at once (no waiting for the start, no warning, no lost step)."""
    from tracer.storage._file_process import FileProcess

    monkeypatch.setattr(FileProcess, "_check_ready", lambda self, timeout: False)
    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", mode=mode), rank=0,
                    world_size=1)
    before = w._file_process.files
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_steps(w, 2)
        w.close()
    assert w._file_process.files == before
    assert open_dump(tmp_path).steps(0) == [0, 1]


def test_without_the_helper_process_the_threads_write_the_files(tmp_path, monkeypatch):
    w = make_writer(DumpConfig(path=str(tmp_path), writer="async", mode="statistics",
                               file_process=False), rank=0, world_size=1)
    assert w._file_process is None
    write_steps(w, 2)
    w.close()
    assert open_dump(tmp_path).steps(0) == [0, 1]


def tensor_items() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"f32": torch.randn(300, 70, generator=g), "bf16": torch.randn(999, generator=g).bfloat16(),
            "i64": torch.arange(12).reshape(3, 4), "t": torch.randn(40, 30, generator=g).t(),
            "big": torch.randn(200_000, generator=g)}


def write_tensor_steps(run, writer: str, mb: int):
    """Two steps of tensor_items() in mode full; returns the writer and the record names."""
    w = make_writer(DumpConfig(path=str(run), writer=writer, mode="full",
                               async_max_queued_mb=mb), rank=0, world_size=1)
    if writer == "async":
        assert w._file_process.wait_ready()
        w.files_before = w._file_process.files
    names = [f"{name}.forward.0.output.0" for name in tensor_items()]
    for step in range(2):
        w.begin_step(step)
        for name, (module, t) in zip(names, tensor_items().items()):
            m = RecordMeta(name, module, "", "forward", "output", 0, 0, "x.py:1")
            w.add(m, t * (step + 1) if t.is_floating_point() else t)
        w.end_step()
    w.close()
    return w, names


@pytest.mark.parametrize("mb", [64, 1])  # 1 MiB: the bytes spill to the side file first
def test_tensor_files_get_their_metadata_from_the_helper_and_match_sync(tmp_path, mb):
    a, names = write_tensor_steps(tmp_path / "a", "async", mb)
    assert a._file_process.files == a.files_before + 2
    write_tensor_steps(tmp_path / "s", "sync", mb)
    da, ds = open_dump(tmp_path / "a"), open_dump(tmp_path / "s")
    for step in range(2):
        sa, ss = da.stats(0, step), ds.stats(0, step)
        cols = [c for c in ss.columns if c not in ("data_offset",)]
        assert sa[cols].equals(ss[cols])
        for name in names:
            ta, ts = da.tensor_torch(0, step, name), ds.tensor_torch(0, step, name)
            assert ta.dtype == ts.dtype and ta.shape == ts.shape and ta.stride() == ts.stride()
            assert torch.equal(ta.contiguous().view(torch.uint8), ts.contiguous().view(torch.uint8))




_FORK_SCRIPT = """
import os, sys
from tracer.storage._file_process import shared_file_process
helper = shared_file_process()
helper.start()
pid = os.fork()  # while the helper starts: closing it then would kill it
if pid == 0:  # the child exits the normal way: its exit handlers run
    sys.exit(0 if shared_file_process() is not helper else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), helper.wait_ready(), shared_file_process() is helper)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_neither_shares_nor_ends_the_parents_helper():
    """A child forked from a training process (a DataLoader worker, say) gets its own helper,
    and its normal exit does not end the parent's (the exit handler is the parent's only)."""
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True,
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "True", "True"]
