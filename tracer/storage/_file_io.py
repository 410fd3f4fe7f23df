"""A step file's bytes through the OS, outside h5py and so outside the GIL: tensor bytes
written back to back with `os.pwritev`, ranges copied with `os.copy_file_range`, the holes of a
sparse file skipped, and `PendingFile`, a step file fully written under its temporary name until
`commit` fsyncs and renames it (tracer.storage._step_file writes through these).
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

_IOV_MAX = 1024


class PendingFile:
    """A step file whose bytes are all written under a temporary name, not yet durable."""

    def __init__(self, fd: int, temp: Path, final: Path) -> None:
        self._fd: int | None = fd
        self.temp = temp
        self.path = final

    def commit(self) -> Path:
        """fsync and rename to the final name (a file without `.partial` is complete)."""
        fd, self._fd = self._fd, None
        if fd is None:
            raise RuntimeError(f"{self.path}: committed or aborted already")
        try:
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self._unlink()
            raise
        os.close(fd)
        # no fsync of the directory: the rename is atomic either way, and on ext4 a directory
        # fsync waits for a journal commit (tens of ms per step when other processes write)
        os.replace(self.temp, self.path)
        return self.path

    def abort(self) -> None:
        """Close and remove the temporary file."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            self._unlink()

    def _unlink(self) -> None:
        try:
            self.temp.unlink()
        except OSError:
            pass


def _pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Write `buffers` back to back at `offset` (GIL released in the syscalls)."""
    written = 0
    pending = [b for b in buffers if b.nbytes]
    while pending:
        batch = pending[:_IOV_MAX]
        n = os.pwritev(fd, batch, offset + written)
        written += n
        # a short write (rare: signals, huge batches) resumes where it stopped
        while batch and n >= batch[0].nbytes:
            n -= batch[0].nbytes
            batch.pop(0)
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]
    return written


def _data_extents(fd: int, start: int, stop: int) -> list[tuple[int, int]]:
    """The ranges of [start, stop) of `fd` that hold data (not holes); all of it where the
    filesystem cannot tell."""
    out = []
    pos = start
    try:
        while pos < stop:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            if data >= stop:
                break
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), stop)
            out.append((data, hole))
            pos = hole
    except (AttributeError, OSError):
        return [(start, stop)] if stop > start else []
    return out


def _copy_range(src: int, dst: int, nbytes: int, dst_offset: int, src_offset: int = 0) -> None:
    """Copy `nbytes` from `src_offset` of `src` to `dst_offset` of `dst`, in the kernel if it
    can."""
    done = 0
    try:
        while done < nbytes:
            n = os.copy_file_range(src, dst, nbytes - done, src_offset + done,
                                   dst_offset + done)
            if n == 0:
                break
            done += n
    except OSError:  # not supported across these filesystems: copy through user space
        pass
    while done < nbytes:
        chunk = os.pread(src, min(64 << 20, nbytes - done), src_offset + done)
        if not chunk:
            raise OSError(f"spill file ended after {done} of {nbytes} bytes")
        _pwrite_all(dst, [memoryview(chunk)], dst_offset + done)
        done += len(chunk)
