"""The async writer's step files after the writer thread has filled them: written, fsynced and
renamed on two threads, and the step barriers that keep them at most one step behind.

`FilePipeline.finish(file)` hands a filled step file to the flusher thread, which writes its
metadata and bytes while the writer thread goes on with the next step (I/O and CPU overlap), and
then queues its fsync and rename on the syncer thread, which runs while the flusher writes the
next file (disk waits overlap writes). One file at a time is being written, so memory stays
bounded; at most `MAX_UNSYNCED` written files wait for their fsync. A failure names the step
and the file (`FileFailure`).

A `Barrier` marks the end of a step in the writer's queue; the writer thread fills it with the
future of the step's file (`FilePipeline.mark`), and the training thread waits on it at the
next step's end, so a failure to write step S (disk full) is raised at step S+1's end at the
latest, not many queued steps later.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from tracer.storage._file_io import PendingFile
from tracer.storage._step_file import StepFile

MAX_UNSYNCED = 4  # written step files waiting for fsync (each holds an open descriptor)


class FileFailure(Exception):
    """Writing step `step`'s file `path` failed with `cause` (reported as the writer's error)."""

    def __init__(self, step: int, path: Path, cause: BaseException) -> None:
        super().__init__(f"step {step} ({path}): {type(cause).__name__}: {cause}")
        self.step, self.path, self.cause = step, path, cause


class Barrier:
    """The end of step `step` in the writer's queue: `event` is set when the writer thread
    reaches it, `written` is then the future of the step's file (its result: the future of its
    fsync and rename), or None when the step has no file (dropped after an error)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.event = threading.Event()
        self.written: Future | None = None

    def wait(self) -> None:
        """Wait until the step's file is on disk; raises its FileFailure (training thread)."""
        self.event.wait()
        if self.written is not None:
            self.written.result().result()


class FilePipeline:
    """The flusher and syncer threads of one async writer; driven by its writer thread."""

    def __init__(self, rank: int, file_process: Any, files_written: list[Path]) -> None:
        self.rank = rank
        self.file_process = file_process  # the file-writer process (tracer.storage._file_process), or None
        self.files_written = files_written
        self._flusher: ThreadPoolExecutor | None = None
        self._syncer: ThreadPoolExecutor | None = None
        self._finishing: Future | None = None  # the file being written
        self._commits: deque[Future] = deque()

    def finish(self, file: StepFile, complete: bool) -> None:
        """Hand `file` over once the one before it is written (raising its error)."""
        try:
            self.wait_written()
            self.collect(keep=MAX_UNSYNCED - 1)
        except BaseException:
            file.abort()
            raise
        if self._flusher is None:
            self._flusher = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"sleuth-dump-flush-rank{self.rank}")
            self._syncer = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"sleuth-dump-sync-rank{self.rank}")
        self._finishing = self._flusher.submit(self._write_and_queue_commit, file, complete)

    def mark(self, barrier: Barrier) -> None:
        """The step whose file was handed over last ends at `barrier`."""
        barrier.written = self._finishing
        barrier.event.set()

    def _write_and_queue_commit(self, file: StepFile, complete: bool) -> Future:
        """On the flusher thread: write `file`, then queue its fsync and rename on the syncer
        (files are written one at a time, so their commits queue in step order); returns the
        commit's future."""
        pending = self._write(file, complete)
        assert self._syncer is not None
        return self._syncer.submit(_commit_or_abort, pending)

    def _write(self, file: StepFile, complete: bool) -> _Step | _Committed:
        """On the flusher thread, with the file-writer process (h5py there does not hold this
        process's GIL): a file without tensor bytes is written there entirely; of any other,
        the HDF5 part is written there and the bytes here. Without that process, all is
        written here. The file is aborted (its partial removed) on error."""
        step = file.attrs["step"]
        try:
            if self.file_process is None:
                pending = file.write(complete=complete)
            elif not file.nbytes and not file.spilled and \
                    (path := self.file_process.finish(file, complete)) is not None:
                return _Committed(path, step)
            else:
                pending = file.write(complete=complete, metadata=self.file_process.write_metadata)
        except Exception as e:
            file.abort()
            raise FileFailure(step, file.path, e) from e
        except BaseException:
            file.abort()
            raise
        return _Step(pending, step)

    def wait_written(self) -> None:
        """Wait for the file being written; its error is raised here."""
        future, self._finishing = self._finishing, None
        if future is not None:
            self._commits.append(future.result())

    def collect(self, keep: int = 0) -> None:
        """Take finished commits in order (raising the first error), waiting until at most
        `keep` are left."""
        while self._commits and (len(self._commits) > keep or self._commits[0].done()):
            self.files_written.append(self._commits.popleft().result())

    def wait_all(self) -> None:
        """Wait until every file handed over is written, fsynced and renamed."""
        try:
            self.wait_written()
        finally:
            self.collect()

    def shutdown(self) -> None:
        for pool in (self._flusher, self._syncer):  # the flusher queues work on the syncer
            if pool is not None:
                pool.shutdown(wait=True)


class _Step(NamedTuple):
    """A written step file waiting for its commit, and its step."""

    pending: PendingFile
    step: int

    def commit(self) -> Path:
        return self.pending.commit()

    def abort(self) -> None:
        self.pending.abort()

    @property
    def path(self) -> Path:
        return self.pending.path


class _Committed:
    """What the file-writer process returns: a file already fsynced and renamed."""

    def __init__(self, path: Path, step: int) -> None:
        self.path = path
        self.step = step

    def commit(self) -> Path:
        return self.path

    def abort(self) -> None:
        pass


def _commit_or_abort(pending: _Step | _Committed) -> Path:
    try:
        return pending.commit()
    except Exception as e:
        pending.abort()
        raise FileFailure(pending.step, pending.path, e) from e
    except BaseException:
        pending.abort()
        raise
