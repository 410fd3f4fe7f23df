"""The async writer's buffer in the training thread: the rows (and sketches) of the records it
makes on the spot, which reach the writer thread in one queue item when the step ends, and their
tensor bytes, handed over in chunks. The training thread assigns every record's place in
/tensors here, for the records the writer thread stores as well (tracer.storage._async).
"""
from __future__ import annotations

from typing import Any


class RowBuffer:
    """Where `Writer._record` puts what it makes in the training thread: rows and sketches,
    which reach the step file in one queue item when the step ends (StepFile orders rows by
    `seq`), and tensor
    bytes, handed to the writer thread in chunks of about `chunk` bytes (`take`). The training
    thread assigns every record's offset in /tensors: `nbytes` also counts the bytes of records
    the writer thread stores (`reserve`), which are queued after the chunks before them."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.rows: list[tuple] = []
        self.sketches: list[tuple[int, Any]] = []
        self.nbytes = 0  # offset of the step's next tensor bytes
        self.pending: list[tuple[memoryview, Any]] = []  # (bytes, on_written) not handed over
        self.pending_bytes = 0

    def add_row(self, row: tuple) -> None:
        self.rows.append(row)

    def add_sketch(self, seq: int, sketch: Any) -> None:
        self.sketches.append((seq, sketch))

    def add_bytes(self, data: Any, on_written: Any = None) -> int:
        view = memoryview(data).cast("B")
        offset = self.nbytes
        if view.nbytes:
            self.pending.append((view, on_written))
            self.pending_bytes += view.nbytes
            self.nbytes += view.nbytes
        elif on_written is not None:
            on_written()
        return offset

    def reserve(self, nbytes: int) -> None:
        """Count bytes that a record made in the writer thread stores."""
        self.nbytes += nbytes

    def take(self) -> tuple[tuple, int]:
        """The pending bytes as a ("bytes", first offset, [(bytes, on_written)]) queue item and
        their size (the caller checks that some are pending)."""
        pending, size = self.pending, self.pending_bytes
        self.pending, self.pending_bytes = [], 0
        return ("bytes", self.nbytes - size, pending), size

    def reset(self) -> None:
        """Forget the step: rows dropped, pending bytes' buffers handed back."""
        self.rows, self.sketches = [], []
        for _, on_written in self.pending:
            if on_written is not None:
                on_written()
        self.pending, self.pending_bytes, self.nbytes = [], 0, 0
