"""The tracer's crash hooks: one chained `sys.excepthook` and one SIGTERM handler for the whole
process, which tell their listeners that the process is dying before the previous hook or
handler runs.

A Dumper listens to write its open step, marked interrupted (`on_crash`); the flight recorder
listens after every Dumper (`last=True`) to save the last steps' rows once the open step is on
disk. The hooks go in with the first listener and come out with the last, so they do not depend
on the flight recorder (which may be switched off, or fail to start) and a process with no
tracer attached keeps its own hooks untouched. The previous hook and handler are chained, not
replaced, and restored when the last listener goes if they are still ours.
"""
from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from typing import Any, Callable

_listeners: dict[int, tuple[bool, int, Callable[[str], None]]] = {}  # key -> last, pid, callback
_keys = itertools.count()
_installed: dict[str, Any] = {}  # the previous "excepthook" and "sigterm" while ours are in


class CrashListener:
    """Handle of an `on_crash` callback; `remove()` is idempotent."""

    def __init__(self, key: int) -> None:
        self._key = key

    def remove(self) -> None:
        if _listeners.pop(self._key, None) is not None and not _listeners:
            _uninstall()

    def __enter__(self) -> CrashListener:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def on_crash(callback: Callable[[str], None], *, last: bool = False) -> CrashListener:
    """Call `callback(reason)` when the process dies of an uncaught exception
    ("KeyError: 'x'") or SIGTERM ("SIGTERM"), before the previous hook or handler runs.
    Listeners with `last=True` run after the others (the flight recorder saves after the
    Dumpers wrote their open steps). Exceptions of a callback are printed, never raised: they
    must not hide the crash. Installs the hooks with the first listener (SIGTERM only from the
    main thread: Python allows signal handlers nowhere else)."""
    key = next(_keys)
    _listeners[key] = (last, os.getpid(), callback)
    _install()
    return CrashListener(key)


def describe_exception(value: BaseException) -> str:
    """ "ValueError: bad", or the type alone when the message is empty ("KeyboardInterrupt")."""
    text = str(value)
    return f"{type(value).__name__}: {text}" if text else type(value).__name__


def _notify(reason: str) -> None:
    # a forked child (a DataLoader worker) inherits the hooks and copies of its parent's
    # listeners: those are the parent's (its Dumpers' files), so only its own ones run
    pid = os.getpid()
    ordered = sorted(_listeners.items(), key=lambda kv: (kv[1][0], kv[0]))
    for _, (_, owner, callback) in ordered:
        if owner != pid:
            continue
        try:
            callback(reason)
        except Exception as e:  # noqa: BLE001 - never hide the original error
            print(f"sleuth: while the process died ({reason}): {e}", file=sys.stderr)


def _excepthook(etype: Any, value: Any, tb: Any) -> None:
    prev = _installed.get("excepthook")
    _notify(describe_exception(value) if isinstance(value, BaseException) else etype.__name__)
    (prev or sys.__excepthook__)(etype, value, tb)


def _sigterm(signum: int, frame: Any) -> None:
    prev = _installed.get("sigterm")
    _notify("SIGTERM")
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_IGN:
        return
    else:  # default action: die by the signal, as the run would have without us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install() -> None:
    if "excepthook" not in _installed:
        _installed["excepthook"] = sys.excepthook
        sys.excepthook = _excepthook
    # (a first listener in another thread could not set it: the next one in the main thread does)
    if "sigterm" not in _installed and threading.current_thread() is threading.main_thread():
        try:
            _installed["sigterm"] = signal.signal(signal.SIGTERM, _sigterm)
        except (ValueError, OSError):  # not allowed here (embedded interpreters)
            pass


def _uninstall() -> None:
    """Restore the previous hook and handler where they are still ours. One chained over ours
    stays, with what it chains to: with no listener left it passes straight through."""
    if sys.excepthook is _excepthook and "excepthook" in _installed:
        sys.excepthook = _installed.pop("excepthook")
    prev = _installed.get("sigterm")
    if prev is not None:  # (None: a handler not set from Python, which cannot be put back)
        try:
            if signal.getsignal(signal.SIGTERM) is _sigterm:
                signal.signal(signal.SIGTERM, prev)
                del _installed["sigterm"]
        except (ValueError, OSError):  # (not the main thread)
            pass
