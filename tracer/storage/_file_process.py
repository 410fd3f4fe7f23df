"""A helper process that writes the HDF5 part of the async writer's step files.

h5py holds the GIL while it writes, so an HDF5 file written by a thread stalls the training
thread for as long (3-5 ms a step here, half of a small model's step; with a 700-record step
of tensor bytes, 4.5 ms of a 50 ms step). A step's HDF5 part is fully described by its root
attributes, its /records, /hits, /sketches and /calls tables and the size of /tensors, so the async
writer sends those to this process (`StepFile`, the same code as in-process). A step without
tensor bytes is written, fsynced and renamed here, and the answer is its path. For a step with
tensor bytes this process writes the partial file's metadata and allocates /tensors, and
answers with its offset; the writer's thread then writes the bytes there (os.pwrite releases
the GIL), fsyncs and renames.

Protocol, over the child's stdin and stdout (no pickle): a request is five length-prefixed
parts (8-byte little-endian lengths): a JSON header {"path", "attrs", "complete"}, plus
"nbytes" and "spilled" for a step with tensor bytes, the records table as a .npy array, the
hits table, the sketches and the calls table as .npy arrays (each of length 0 when none). The answer is one
JSON line: {"ok": path}, {"offset": offset of /tensors} or {"error": message}. Once its imports are done the helper
says {"ready": true}; until then the writer writes its files itself instead of waiting (the
start takes ~0.4 s, longer than a short run's first steps). End of input ends the process, so
it exits with its parent even when the parent is killed.

Started as `python -m tracer.storage._file_process` (`sleuth.common.start_helper`).
"""
from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import numpy as np

from sleuth.common import start_helper, warn
from tracer.storage._step_file import StepFile

_LEN = struct.Struct("<Q")
_READY = b'{"ready": true}'


def _npy(arr: np.ndarray | None) -> bytes:
    if arr is None:
        return b""
    # .npy keeps no dtype metadata (h5py's string encoding): plain fields, re-marked in _utf8
    plain = arr if arr.dtype.names is None else arr.view(
        np.dtype([(n, arr.dtype[n].str) for n in arr.dtype.names]))
    buf = io.BytesIO()
    np.lib.format.write_array(buf, plain, allow_pickle=False)
    return buf.getvalue()


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    data = stream.read(n)
    if data is None or len(data) < n:
        return None
    return data


def _read_part(stream: IO[bytes]) -> bytes | None:
    head = _read_exact(stream, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    return _read_exact(stream, n) if n else b""


class FileProcess:
    """The parent's end: starts the helper on first use and writes files through it.

    `finish` returns None when the helper cannot be used yet (still starting) or at all (it
    failed to start or died, warned once); the caller then writes the file itself, so no step
    is lost and none waits for the helper's start.
    """

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._proc: subprocess.Popen | None = None
        self._ready = False  # the helper said it has imported h5py
        self._owner = os.getpid()  # a forked child must neither use nor close this helper
        self._failed = False
        self._lock = threading.Lock()
        self.files = 0
        """Files written through the helper (for tests and benchmarks)."""

    def finish(self, file: StepFile, complete: bool) -> Path | None:
        """Write `file` (rows and hits only) through the helper; its final path, or None."""
        reply = self._request(file, {"complete": bool(complete)})
        return None if reply is None else Path(reply["ok"])

    def write_metadata(self, file: StepFile, complete: bool) -> int | None:
        """Write the HDF5 part of `file`, a step with tensor bytes, in its partial path
        (`StepFile.write_metadata`) through the helper, and return the offset of /tensors,
        where the caller writes the bytes; None when the helper cannot be used (the caller
        writes the metadata itself). Meant as `StepFile.write`'s `metadata`."""
        reply = self._request(file, {"complete": bool(complete), "nbytes": file.nbytes,
                                     "spilled": file.spilled})
        return None if reply is None else int(reply["offset"])

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Start the helper if needed and wait until it can take files; False when it failed
        to start or died (warned once)."""
        with self._lock:
            return self._started() is not None and self._check_ready(timeout)

    def _started(self) -> subprocess.Popen | None:
        """The helper, started if needed; None once it failed (warned once). Under the lock."""
        if self._failed:
            return None
        try:
            return self._start()
        except OSError as e:
            self._give_up(f"{type(e).__name__}: {e}")
            return None

    def _check_ready(self, timeout: float) -> bool:
        """True once the helper's "ready" line arrived (waiting up to `timeout` seconds)."""
        if self._ready:
            return True
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        if not select.select([proc.stdout], [], [], timeout)[0]:
            return False
        line = proc.stdout.readline()
        if line.strip() != _READY:
            self._give_up(f"it exited with {proc.poll()}" if not line
                          else f"unreadable greeting {line[:80]!r}")
            return False
        self._ready = True
        return True

    def _request(self, file: StepFile, fields: dict[str, Any]) -> dict | None:
        """Send one request (see the module docstring); the answer, or None when the helper
        is still starting (the caller writes this file itself rather than wait) or failed
        (after one warning). An error the helper met while writing is raised."""
        with self._lock:
            proc = self._started()
            if proc is None or not self._check_ready(0):
                return None
            header = json.dumps({"path": str(file.path), "attrs": file.attrs,
                                 **fields}).encode()
            table = file.records_table()
            parts = (header, _npy(table), _npy(file.hits_table()),
                     _npy(file.sketches_table(table)), _npy(file.calls_table()))
            payload = b"".join(_LEN.pack(len(p)) + p for p in parts)
            try:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(payload)
                proc.stdin.flush()
                line = proc.stdout.readline()
            except OSError as e:
                self._give_up(f"{type(e).__name__}: {e}")
                return None
            if not line:
                self._give_up(f"it exited with {proc.poll()}")
                return None
            try:
                reply = json.loads(line)
            except ValueError:
                self._give_up(f"unreadable answer {line[:80]!r}")
                return None
            if "error" in reply:  # the write itself failed (disk full, ...): the caller's error
                raise OSError(reply["error"])
            self.files += 1
            return reply

    def start(self) -> None:
        """Start the helper now, so its imports overlap the first step's capture; a failure
        shows at the first `finish` (which then falls back)."""
        with self._lock:
            if self._proc is None and not self._failed:
                try:
                    self._start()
                except OSError:
                    pass

    def close(self) -> None:
        """End the helper (it finishes the file in hand first; one still starting has none and
        is killed rather than waited for)."""
        with self._lock:
            proc, self._proc = self._proc, None
            ready = self._ready
        if proc is None:
            return
        if not ready:
            proc.kill()
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def _start(self) -> subprocess.Popen:
        if self._proc is not None:
            return self._proc
        self._proc = start_helper("tracer.storage._file_process")
        return self._proc

    def _give_up(self, why: str) -> None:
        self._failed = True
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:  # a write into the dead helper left unflushed bytes
                        pass
        warn(f"the dump's file-writer process failed (rank {self.rank}: {why}); the writer's "
             f"threads write the step files themselves from now on", stacklevel=3)


_shared: FileProcess | None = None
_shared_lock = threading.Lock()


def shared_file_process(rank: int = 0) -> FileProcess:
    """The process-wide helper: started once and kept for every later writer (its start costs
    ~0.4 s of CPU, which a Dumper made per epoch, or per benchmark block, would pay each time),
    ended at exit. A new one replaces it after it failed, and in a forked child (which must not
    write into its parent's pipes)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._failed or _shared._owner != os.getpid():
            _shared = FileProcess(rank)
            atexit.register(_close_at_exit, _shared)
        return _shared


def _close_at_exit(helper: FileProcess) -> None:
    # a forked child inherits the registration: only the process that started it closes it
    if os.getpid() == helper._owner:
        helper.close()


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The helper's loop: one request, one answer, until end of input."""
    import h5py

    stdout.write(_READY + b"\n")  # imports done: the parent sends files from now on
    stdout.flush()
    while True:
        header = _read_part(stdin)
        if header is None:
            return
        records, hits, sketches, calls = (_read_part(stdin), _read_part(stdin),
                                          _read_part(stdin), _read_part(stdin))
        if records is None or hits is None or sketches is None or calls is None:
            return
        try:
            request = json.loads(header)
            file = StepFile(Path(request["path"]), request["attrs"], spill_bytes=1 << 62)
            file.table = _utf8(np.lib.format.read_array(io.BytesIO(records),
                                                        allow_pickle=False), h5py)
            if hits:
                file.hit_table = _utf8(np.lib.format.read_array(io.BytesIO(hits),
                                                                allow_pickle=False), h5py)
            if sketches:
                file.sketch_table = np.lib.format.read_array(io.BytesIO(sketches),
                                                             allow_pickle=False)
            if calls:
                file.call_table = _utf8(np.lib.format.read_array(io.BytesIO(calls),
                                                                 allow_pickle=False), h5py)
            answer: dict[str, Any]
            if "nbytes" in request:  # a step with tensor bytes: metadata only, not committed
                file.nbytes = int(request["nbytes"])
                answer = {"offset": file.write_metadata(request["complete"],
                                                        spilled=bool(request["spilled"]))}
            else:
                answer = {"ok": str(file.finish(complete=request["complete"]))}
        except Exception as e:  # noqa: BLE001 - answered, raised in the parent
            answer = {"error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(answer).encode() + b"\n")
        stdout.flush()


def _utf8(arr: np.ndarray, h5py: Any) -> np.ndarray:
    """.npy drops h5py's string encoding: mark the byte-string fields UTF-8 again."""
    fields = [(n, h5py.string_dtype("utf-8", arr.dtype[n].itemsize) if arr.dtype[n].kind == "S"
               else arr.dtype[n]) for n in arr.dtype.names or ()]
    return arr.view(np.dtype(fields))


if __name__ == "__main__":
    # Ctrl-C goes to the parent, which closes our input when it is done
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # answers go to the original stdout; anything a library prints goes to stderr
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    try:
        _serve(sys.stdin.buffer, answers)
    except BrokenPipeError:
        # the training process is gone (a signal killed it while this wrote its step): nobody
        # is left to answer, and a traceback here would land on the user's terminal
        os._exit(0)
