"""Reading a step file's tensor bytes in bounded chunks, for the diff: straight from the packed
`/tensors` dataset at its file offset (`os.preadv`: no h5py call per chunk, the GIL released
while the kernel reads), opened through `open_h5` like every reader of a step file. What the
bytes mean (metrics, checksums) is the diff's (tracer.analysis._diff_bytes). numpy and h5py.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tracer._errors import DumpFormatError
from tracer.storage._h5open import open_h5
from tracer.storage._sketch import row_of
from tracer.storage._step_reader import READ_ERRORS, read_sketches


class ReadError(DumpFormatError):
    """A side's step file failed while it was being compared: which side, file and state
    ("damaged" for bytes that do not match their checksum, else "read_error")."""

    def __init__(self, side: str, path: Path, message: str, state: str = "read_error") -> None:
        super().__init__(message)
        self.side, self.path, self.state = side, path, state


class TensorReader:
    """Reads byte ranges of one step file's packed tensor dataset, in bounded chunks.

    The writer lays `/tensors` out contiguously, so its bytes are read with `os.preadv` at the
    dataset's file offset: no h5py call per chunk, no copy, and the GIL is released while the
    kernel reads. A chunked or compressed dataset falls back to h5py slicing.
    """

    def __init__(self, path: Path, side: str = "A") -> None:
        self.path, self.side = path, side
        self.fd: int | None = None
        try:
            # refuses links out of the file and datasets that claim more than it stores
            # (UntrustedFileError is no read error: it stops the diff)
            self.file = open_h5(path)
            self.data = self.file["tensors"] if "tensors" in self.file else None
            self.attrs = {k: self.file.attrs[k] for k in ("level", "mode", "config", "setup",
                                                          "status") if k in self.file.attrs}
            # files without the column cannot be checked (every format so far has it)
            self.checksums = "checksum" in (self.file["records"].dtype.names or ())
        except READ_ERRORS as e:
            raise ReadError(side, path, f"unreadable: {e}") from e
        self.base: int | None = None
        if self.data is not None and self.data.size:
            try:
                offset = self.data.id.get_offset()
            except Exception:  # noqa: BLE001 - any h5py refusal means: use slicing
                offset = None
            if offset is not None and self.data.compression is None and hasattr(os, "preadv"):
                self.base = int(offset)
                self.fd = os.open(path, os.O_RDONLY)
        self._bufs: dict[int, np.ndarray] = {}
        self._sketches: tuple[np.ndarray | None, str] | None = None

    def read(self, offset: int, nbytes: int, slot: int = 0) -> np.ndarray:
        """`nbytes` bytes at `offset` of /tensors as uint8; the array is reused by the next call
        with the same `slot`."""
        if self.data is None:
            raise ReadError(self.side, self.path, "damaged: records point at tensor bytes but "
                             "the file has no /tensors dataset", "damaged")
        if offset < 0 or offset + nbytes > self.data.shape[0]:
            raise ReadError(self.side, self.path, f"damaged: a record points at bytes "
                             f"{offset}..{offset + nbytes} of /tensors, which holds "
                             f"{self.data.shape[0]}: the /records table is damaged", "damaged")
        if self.fd is None:
            try:
                return self.data[offset:offset + nbytes]
            except READ_ERRORS as e:
                raise ReadError(self.side, self.path, f"read error: {e}") from e
        buf = self._bufs.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[slot] = np.empty(max(nbytes, 4096), np.uint8)
        view = buf[:nbytes]
        got = 0
        while got < nbytes:
            try:
                n = os.preadv(self.fd, [memoryview(view[got:])], self.base + offset + got)
            except OSError as e:
                raise ReadError(self.side, self.path, f"read error: {e}") from e
            if n <= 0:
                raise ReadError(self.side, self.path, "read error: the file ends inside a "
                                 "tensor (truncated while it was read?)")
            got += n
        return view

    def sketch(self, row: int) -> tuple[np.ndarray | None, str]:
        """(the sketch of the record in /records row `row`, the file's sketch scheme), or
        (None, scheme) when that record has none; the file's /sketches is read once."""
        if self._sketches is None:
            try:
                self._sketches = read_sketches(self.file, self.path)
            except DumpFormatError as e:
                raise ReadError(self.side, self.path, f"damaged: {e}", "damaged") from e
        table, scheme = self._sketches
        return row_of(table, row), scheme

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self.file.close()
        except Exception:  # noqa: BLE001 - closing a damaged file is best effort
            pass
