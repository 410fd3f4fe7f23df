"""The readers fuzzed as a class: a property-based harness (Hypothesis) that forges one file of a
real run (step files, summaries, profiles, run.json, metrics.jsonl, IR texts and SVGs,
checkpoints' meta.json) at a time, and points every reader of that file at the run: the CLI
commands, the Python readers, and the dashboard (its data functions, pages and file routes:
dashboard_readers).

Forgeries: truncated, bytes flipped, a JSON field given a hostile value (paths out of the run,
control characters, huge and negative numbers, deep nesting), an HDF5 attribute forged or a
dataset resized past what is stored, the file swapped for a FIFO, a folder, a soft link out of
the run or a loop, a look-alike name beside it, a bomb (gzip, or a file as large as a reader
takes whole). For every reader the property is:
an answer, or the project's own error with a message (an OSError naming the path, for the
Python readers; the CLI: exit 1 or 2, no traceback; the dashboard: its own errors from a data
function, an HTTP 2xx or 4xx, never a 5xx, and no traceback in a page);
never a hang (an alarm stops the reader), never a byte read outside the run (the file a link
points to keeps its access time), never more memory than MEMORY_BOUND (the peak resident size
over each reader).

A small seeded budget runs in the quick lane; `slow` runs many more. A failure it finds is kept
as a regular test beside the class it belongs to (tests/faults/test_fault_*.py)."""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import signal
import time
import traceback
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dashboard_readers  # noqa: E402
from dashboard_readers import Http  # noqa: E402

HANG_SECONDS = 20
"""A reader still busy after this long is taken as hung (a FIFO waited on, a bomb read)."""

TARGETS = {
    "step": "dump/rank0/step0.h5",
    "dump_json": "dump/dump.json",
    "summary": "summary/rank0.h5",
    "window": "profile/rank0/window0.json",
    "trace": "profile/rank0/window0.trace.json.gz",
    "ir": "ir/00_forward.ir",
    "svg": "ir/00_forward.svg",
    "run_json": "run.json",
    "metrics": "metrics.jsonl",
    "meta": "checkpoints/step3/meta.json",
}

HOSTILE = st.one_of(
    st.sampled_from(["../../../outside/secret.json", "/etc/passwd", "", "\x1b[31mred\x07",
                     "\udcff", "step00.h5", "nan", "1e999", "0" * 300]),
    st.integers(min_value=-2**63, max_value=2**63 - 1), st.floats(allow_nan=True),
    st.booleans(), st.none(),
    st.just({"a": [[[[[[[[[[1]]]]]]]]]]}), st.text(max_size=40))

FORGERIES = ["truncate", "flip", "fifo", "folder", "link_out", "link_loop", "lookalike", "field",
             "attr", "resize", "bomb"]


MEMORY_BOUND = 512 << 20
"""The most a reader's resident memory may grow while it reads a forged run. The largest file a
forgery puts in the run is 32 MiB (the IR bomb; the trace bomb inflates to as much; the SVG bomb
is 31 MiB, which the SVG route reads whole to highlight), and the pristine run's files are a few
MiB: a reader that reads what is there, even whole and several times over, stays far below this;
one that allocates what a forged size claims (a dataset resized to 10^8 rows, a histogram index
claiming 160 million bins) goes past it."""


class _Peak:
    """The growth of the process's resident memory over a `with` block: Linux resets the peak
    (VmHWM) when 5 is written to /proc/self/clear_refs, so the peak after the block, less the
    resident size before it, is the most the block held at once. `grown` stays 0 where the
    system offers no such reset (the bound is then not measured)."""

    grown = 0

    def __enter__(self) -> _Peak:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._before = _status_kib("VmRSS")
        except OSError:
            self._before = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._before is not None:
            self.grown = (_status_kib("VmHWM") - self._before) << 10


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class Hang(Exception):
    """The reader did not answer within HANG_SECONDS."""


def _hang(signum, frame):  # noqa: ARG001
    raise Hang(f"no answer after {HANG_SECONDS} s")


@contextlib.contextmanager
def _bounded_time():
    """SIGALRM stops a reader waiting in Python; one waiting inside C (HDF5 retrying a read
    with sleeps between) never returns to Python, so faulthandler's watchdog thread ends the
    process a while later with every thread's stack: a failed run, never a stalled one."""
    import faulthandler

    old = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(HANG_SECONDS)
    faulthandler.dump_traceback_later(3 * HANG_SECONDS, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _cli(argv: list[str]) -> tuple[int, str]:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from sleuth.cli import main

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


def _readers(good: Path, every_page: bool) -> dict[str, list]:
    """target -> the readers of that file: (name, call(run) raising only the project's errors,
    or returning a CLI's (exit code, output) or the dashboard's HTTP answers); the dashboard's
    pages that show that kind of file and the Runs page, or with `every_page` all of them."""
    import irdump
    import profiler
    import trainer
    from trainer._checkpoint import read_meta

    dump = [("dump ls", lambda r: _cli(["dump", "ls", str(r)])),
            ("dump show", lambda r: _cli(["dump", "show", str(r), "--step", "0"])),
            ("check", lambda r: _cli(["check", str(r)])),
            ("diff", lambda r: _cli(["diff", str(good), str(r)]))]
    claim = [("claim", lambda r: trainer.claim_run_dir(r, "another-run"))]
    summary = [("read_scalars", profiler.read_scalars),
               ("read_histograms", profiler.read_histograms)]
    profile = [("profile", lambda r: _cli(["profile", str(r)]))]
    ir = [("read_ir", lambda r: irdump.read_ir(r / TARGETS["ir"])),
          ("list_graphs", irdump.list_graphs)]
    tools = {"step": dump + claim, "dump_json": dump + claim, "summary": summary + claim,
             "window": profile + claim, "trace": profile, "ir": ir + claim, "svg": ir[1:] + claim,
             "run_json": claim + [("read_metrics", trainer.read_metrics)],
             "metrics": claim + [("read_metrics", trainer.read_metrics)],
             "meta": claim + [("read_meta", lambda r: read_meta(r / "checkpoints" / "step3"))]}
    board = dashboard_readers.readers(good, TARGETS, every_page=every_page)
    return {target: tools[target] + board[target] for target in TARGETS}


def _project_errors() -> tuple[type[BaseException], ...]:
    import irdump
    import profiler
    import tracer
    import trainer
    from sleuth.common import UntrustedFileError

    return (tracer.TracerError, profiler.ProfilerError, trainer.TrainerError,
            irdump.IrDumpError, UntrustedFileError, *dashboard_readers.errors())


def _forge(run: Path, target: str, forgery: str, data, outside: Path) -> None:
    """Apply `forgery` to the file `target` names in `run` (a copy of the pristine run whose
    files are hard links: the file forged is first made a copy of its own)."""
    path = run / TARGETS[target]
    copy = path.with_name(path.name + ".copy")
    shutil.copyfile(path, copy)
    os.replace(copy, path)  # break the hard link to the pristine run
    size = path.stat().st_size
    if forgery == "truncate":
        with open(path, "r+b") as f:
            f.truncate(data.draw(st.integers(0, max(0, size - 1)), label="keep"))
    elif forgery == "flip":
        with open(path, "r+b") as f:
            for _ in range(data.draw(st.integers(1, 8), label="flips")):
                f.seek(data.draw(st.integers(0, size - 1), label="at"))
                f.write(bytes([data.draw(st.integers(0, 255), label="byte")]))
    elif forgery in ("fifo", "folder", "link_out", "link_loop"):
        path.unlink()
        if forgery == "fifo":
            os.mkfifo(path)
        elif forgery == "folder":
            path.mkdir()
            (path / "inside").write_text("x")
        elif forgery == "link_out":
            secret = outside / ("secret.h5" if path.suffix == ".h5" else "secret.json")
            os.symlink(secret, path)
        else:
            os.symlink(path.name, path)
    elif forgery == "lookalike":  # another file of the run under a name that looks like this one
        name = data.draw(st.sampled_from(["00", "\u0660", "\u00b9", "0" * 30, "+0", " 0"]),
                         label="digits")
        if target == "metrics":  # another rank's metrics under a name that is no rank's
            stem = f"metrics.rank{name}.jsonl"
        else:
            stem = path.name.replace("0", name, 1) if "0" in path.name else path.name + name
        shutil.copyfile(path, path.with_name(stem))
        if target == "step":
            shutil.copyfile(run / "dump/rank0/step1.h5", path.with_name(stem))
    elif forgery == "field" and target in ("dump_json", "window", "run_json", "meta", "metrics"):
        lines = path.read_text().splitlines()
        i = data.draw(st.integers(0, len(lines) - 1), label="line") if target == "metrics" else 0
        try:
            obj = json.loads(lines[i] if target == "metrics" else path.read_text())
        except ValueError:
            return
        if not isinstance(obj, dict) or not obj:
            return
        key = data.draw(st.sampled_from(sorted(obj)), label="key")
        obj[key] = data.draw(HOSTILE, label="value")
        text = json.dumps(obj)
        if target == "metrics":
            lines[i] = text
            text = "\n".join(lines) + "\n"
        path.write_text(text, errors="surrogateescape")
    elif forgery in ("attr", "resize") and target in ("step", "summary"):
        import h5py
        import numpy as np

        with h5py.File(path, "a", libver="latest" if target == "summary" else "earliest") as f:
            if forgery == "attr":
                key = data.draw(st.sampled_from(sorted(f.attrs)), label="attr")
                value = data.draw(HOSTILE, label="value")
                f.attrs[key] = (np.bytes_(str(value).encode("utf-8", "surrogateescape"))
                                if not isinstance(value, (int, float)) or isinstance(value, bool)
                                else value)
            else:
                names = [n for n in f if isinstance(f[n], h5py.Dataset) and f[n].maxshape[0] is None]
                if not names:
                    return
                name = data.draw(st.sampled_from(sorted(names)), label="dataset")
                f[name].resize((data.draw(st.integers(0, 10**8), label="rows"),))
    elif forgery == "bomb" and target in ("trace", "ir"):
        body = b'{"traceEvents": [' + b" " * (32 << 20) + b"]}"
        path.write_bytes(gzip.compress(body, 9) if target == "trace" else body)
    elif forgery == "bomb" and target == "svg":  # just under the size the SVG route highlights
        node = b'<g id="n" class="node"><title>linear</title>'
        path.write_bytes(b"<svg>" + node * ((31 << 20) // len(node)) + b"</svg>")


def _check_answer(name: str, forged: str, answer: object) -> None:
    if isinstance(answer, list) and all(isinstance(a, Http) for a in answer):
        for status, text in answer:
            assert status < 500, f"{name} on {forged}: HTTP {status}: {text[:2000]}"
            assert "Traceback" not in text, f"{name} on {forged}: {text[:2000]}"
    elif isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], int):
        code, text = answer
        assert "Traceback" not in text, f"{name} on {forged}: {text}"
        assert code in (0, 1, 2), f"{name} on {forged}: exit {code}: {text}"
        if code == 2:
            assert text.strip(), f"{name} on {forged}: exit 2 without a word"


def _fuzz(pristine: Path, root: Path, data, *, every_page: bool = False) -> None:
    target = data.draw(st.sampled_from(sorted(TARGETS)), label="target")
    if not (pristine / TARGETS[target]).exists():
        return  # the SVG, where graphviz is not installed
    forgery = data.draw(st.sampled_from(FORGERIES), label="forgery")
    case = root / f"case{time.monotonic_ns()}"
    run, outside = case / "run", case / "outside"
    outside.mkdir(parents=True)
    shutil.copyfile(pristine / TARGETS["step"], outside / "secret.h5")
    (outside / "secret.json").write_text(json.dumps({"run_id": "outside", "trace": "x"}))
    shutil.copytree(pristine, run, copy_function=os.link)
    try:
        _forge(run, target, forgery, data, outside)
        forged = f"{forgery} of {TARGETS[target]}"
        errors = _project_errors()
        for name, read in _readers(pristine, every_page)[target]:
            for secret in outside.iterdir():
                os.utime(secret, (0, time.time()))
            peak = _Peak()
            try:
                with _bounded_time(), peak:
                    answer = read(run)
            except errors as e:
                assert str(e).strip(), f"{name} on {forged}: {type(e).__name__} without a word"
            except OSError as e:  # the OS's refusal of a path, as Python readers give it
                assert e.filename or str(run) in str(e), f"{name} on {forged}: {e!r} names no file"
            except Hang:
                pytest.fail(f"{name} hung on {forged}")
            except BaseException:  # noqa: BLE001 - a traceback is what the harness exists to find
                pytest.fail(f"{name} on {forged} raised:\n{traceback.format_exc()}")
            else:
                _check_answer(name, forged, answer)
            for secret in outside.iterdir():
                assert secret.stat().st_atime == 0, f"{name} read {secret}, outside the run, " \
                                                    f"on {forged}"
            assert peak.grown < MEMORY_BOUND, f"{name} grew by {peak.grown >> 20} MiB on {forged}"
    finally:
        dashboard_readers.forget(run)
        for fifo in run.rglob("*"):
            if fifo.is_fifo():
                fifo.unlink()
        shutil.rmtree(case, ignore_errors=True)


_SETTINGS = dict(deadline=None, database=None, derandomize=True, print_blob=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=4, **_SETTINGS)
@given(data=st.data())
def test_readers_answer_or_refuse_forged_files(pristine, tmp_path_factory, data):
    """A seeded handful of forgeries in the quick lane."""
    _fuzz(pristine, tmp_path_factory.getbasetemp(), data)


@pytest.mark.slow
# each example points every dashboard page at its forgery (about 1.5 s here): 40 fit the
# suite's time bound; a fresh draw each run adds up over runs
@settings(max_examples=40, **{**_SETTINGS, "derandomize": False})
@given(data=st.data())
def test_readers_answer_or_refuse_forged_files_many(pristine, tmp_path_factory, data):
    """Many more forgeries, a fresh draw each run (a failure prints its seed), each pointed at
    every page of the dashboard."""
    _fuzz(pristine, tmp_path_factory.getbasetemp(), data, every_page=True)
