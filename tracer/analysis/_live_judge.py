"""The live reference's judge: a helper process that diffs each written step with the
reference's, off the training process.

A diff of one step costs tens to hundreds of milliseconds of Python (pairing, tolerances,
first-divergence order), as much as a GPU step or more; in the training process it would hold
the GIL that the step's host work needs. So `tracer.LiveReference` hands each step file to this
process and reads the answers at step boundaries (`Judge`); the comparison is `tracer.diff`
itself, here as in `sleuth diff`.

Protocol, over the child's stdin and stdout (no pickle), one JSON object a line: a request is
{"reference": step file, "path": step file, "tolerance": {"rtol", "atol", "cosine_min"},
"module_map": the map file or null}; the
answer {"status", "first_divergence": record or null, "unjudged": why or null, "setup": the
setup differences in words, likeliest cause first} (`judged`), or
{"error": one line} where either file did not read. Once its imports are done the helper says
{"ready": true}. End of input ends the process (`sleuth.common.start_helper`).
"""
from __future__ import annotations

import functools
import json
import os
import select
import sys
import time
from collections import deque
from typing import IO, Any

from sleuth.common import describe_error, start_helper
from tracer.analysis._diff_result import _jsonable

_READY = {"ready": True}


def judged(reference: str, path: str, tolerance: Any,
           module_map: str | None = None) -> dict[str, Any]:
    """What `tracer.diff` finds between the two step files (through the module map file
    `module_map`, the reference as A, where given), as a JSON-ready answer."""
    from tracer.analysis._diff import diff

    result = diff(reference, path, tolerance=tolerance, keep_records=False,
                  module_map=None if module_map is None else _map(module_map))
    unjudged = None
    if result.first_divergence is None and result.status != "same":
        unjudged = "; ".join([p.line() for p in result.problems[:2]] or result.notes[:1]) or \
            "see sleuth diff"
    fd = result.first_divergence
    setup = [str(d["text"]) for c in result.changes if c["kind"] == "setup"
             for d in c["differences"]]
    return {"status": result.status, "unjudged": unjudged, "setup": setup,
            "first_divergence": None if fd is None else _jsonable(fd)}


@functools.lru_cache(maxsize=None)
def _map(path: str) -> Any:
    """The module map in the file at `path`, read once a process."""
    from tracer.analysis._map_file import read_module_map

    return read_module_map(path, flag="module map")


class Judge:
    """The helper process, seen from the run: `send` a request, `answers` in the order sent.
    Raises OSError where the process cannot start or has died."""

    def __init__(self) -> None:
        self._proc = start_helper("tracer.analysis._live_judge")
        self._buf = b""
        self.waiting: deque[Any] = deque()
        """What each request sent and not yet answered was sent for, oldest first."""

    def send(self, request: dict[str, Any], about: Any) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(request).encode() + b"\n")
            stdin.flush()
        except (BrokenPipeError, ValueError) as e:  # ValueError: the pipe was closed
            raise OSError(f"the judge process is gone ({e})") from e
        self.waiting.append(about)

    def answers(self, keep: int, timeout: float) -> list[tuple[Any, dict[str, Any]]]:
        """(what it was sent for, answer) of every request answered so far, waiting (up to
        `timeout` seconds in all) until at most `keep` are still unanswered."""
        out = []
        end = time.monotonic() + timeout
        while self.waiting:
            try:
                line = self._line(max(0.0, end - time.monotonic())
                                  if len(self.waiting) > keep else 0.0)
            except OSError:
                if out:  # the answers in hand first; the next call meets the error again
                    return out
                raise
            if line is None:
                if len(self.waiting) > keep:
                    raise OSError(f"the judge process gave no answer in {timeout:.0f} s")
                break
            answer = json.loads(line)
            if answer == _READY:
                continue
            out.append((self.waiting.popleft(), answer))
        return out

    def _line(self, wait: float) -> bytes | None:
        """The next whole line the helper wrote, waiting up to `wait` seconds; None if none.
        Read from the pipe's descriptor: a buffered reader could hold lines a select on the
        descriptor does not see."""
        fd = self._proc.stdout.fileno()  # type: ignore[union-attr]
        end = time.monotonic() + wait
        while b"\n" not in self._buf:
            if not select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise OSError(f"the judge process exited with {self._proc.poll()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def close(self) -> None:
        proc = self._proc
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a judge that does not end is killed
            proc.kill()
            proc.wait()


def _serve(stdin: IO[str], stdout: IO[str]) -> None:
    """One request, one answer, until end of input."""
    from tracer._errors import TracerError
    from tracer.analysis._compare import Tolerance
    from tracer.analysis._diff import diff  # noqa: F401 - imported before the greeting
    from tracer.storage import READ_ERRORS

    stdout.write(json.dumps(_READY) + "\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)
        try:
            answer = judged(request["reference"], request["path"],
                            Tolerance(**request["tolerance"]), request.get("module_map"))
        except (TracerError, *READ_ERRORS) as e:
            answer = {"error": describe_error(e)}
        try:
            stdout.write(json.dumps(answer, default=str) + "\n")
            stdout.flush()
        except BrokenPipeError:  # the run no longer wants answers (it found its divergence)
            return


if __name__ == "__main__":
    # answers go to the pipe the parent reads; anything the diff prints goes to stderr
    answers = sys.stdout
    sys.stdout = sys.stderr
    try:
        _serve(sys.stdin, answers)
    except KeyboardInterrupt:
        pass
