"""The tracer's crash hooks (tracer/_crash.py): one chained excepthook and SIGTERM handler,
in while anyone listens, listeners in order (the Dumpers' open steps before the flight
recorder), the previous hook always run, a failing listener never hiding the crash."""
from __future__ import annotations

import signal
import sys

import pytest

import tracer._crash
from tracer._crash import describe_exception, on_crash


@pytest.fixture(autouse=True)
def _no_listeners_yet(monkeypatch):
    """A process with no tracer attached: earlier tests leave flight recorders armed (a Dumper
    closed by an exception keeps its recorder for the excepthook), so the state starts fresh,
    and the SIGTERM handler is put back whatever happens."""
    monkeypatch.setattr(tracer._crash, "_installed", {})
    monkeypatch.setattr(tracer._crash, "_listeners", {})
    real = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGTERM, real)


def test_hooks_go_in_with_the_first_listener_and_out_with_the_last(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(("prev", a[0].__name__)))
    before_hook, before_sig = sys.excepthook, signal.getsignal(signal.SIGTERM)
    first = on_crash(lambda reason: seen.append(("flight", reason)), last=True)
    second = on_crash(lambda reason: seen.append(("dumper", reason)))
    assert sys.excepthook is not before_hook
    assert signal.getsignal(signal.SIGTERM) is not before_sig
    sys.excepthook(KeyError, KeyError("x"), None)
    assert seen == [("dumper", "KeyError: 'x'"), ("flight", "KeyError: 'x'"),
                    ("prev", "KeyError")]
    second.remove()
    assert sys.excepthook is not before_hook  # one listener is left
    first.remove()
    first.remove()  # idempotent
    assert sys.excepthook is before_hook and signal.getsignal(signal.SIGTERM) is before_sig


def test_a_failing_listener_is_printed_and_the_crash_goes_on(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append("prev"))

    def broken(reason: str) -> None:
        raise OSError("disk full")

    with on_crash(broken), on_crash(lambda reason: seen.append(reason)):
        sys.excepthook(ValueError, ValueError("bad"), None)
    assert seen == ["ValueError: bad", "prev"]
    assert "while the process died (ValueError: bad): disk full" in capsys.readouterr().err


def test_describe_exception():
    assert describe_exception(ValueError("bad")) == "ValueError: bad"
    assert describe_exception(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_a_forked_child_runs_only_its_own_listeners(monkeypatch, tmp_path):
    """A DataLoader worker forked from the run inherits the hooks and copies of the parent's
    listeners; its crash must not write the parent's files."""
    import os

    monkeypatch.setattr(sys, "excepthook", lambda *a: None)
    seen = tmp_path / "seen"

    def mark(who: str):
        return lambda reason: seen.open("a").write(f"{who} {os.getpid()}\n")

    with on_crash(mark("parent")):
        pid = os.fork()
        if pid == 0:  # the child
            try:
                on_crash(mark("child"))
                sys.excepthook(RuntimeError, RuntimeError("worker"), None)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    assert seen.read_text() == f"child {pid}\n"
