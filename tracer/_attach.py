"""Zero-code attach: dump a script nobody edited, configured by $SLEUTH_DUMP_CONFIG.

``SLEUTH_DUMP_CONFIG`` holds a JSON config path, inline JSON (``{...}``) or ``1`` (defaults).
The Dumper attaches to every top-level module that runs (global module hooks), counts steps
with the global optimizer hook, takes rank and world size from ``RANK``/``WORLD_SIZE`` and the
run directory from the config's ``path`` or ``SLEUTH_RUN_DIR``, and is closed at interpreter
exit so the last step is written. When the variable is unset nothing is imported or installed.

Observing never stops the observed run: a config that cannot be used, or a Dumper that cannot
start, leaves the script running without a dump, with one ``sleuth:`` warning line, unless
``SLEUTH_STRICT=1`` (or the config's ``"on_error": "raise"``) asks for the error instead.
"""
from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING

from tracer._config import ENV_VAR

if TYPE_CHECKING:
    from tracer._dumper import Dumper, StepListener

_active: Dumper | None = None
_attaching = False


def attach_from_env(reference: StepListener | None = None) -> Dumper | None:
    """Attach a global Dumper as $SLEUTH_DUMP_CONFIG says; None when it is unset or "0".
    `reference`: the Dumper's live reference (`tracer.LiveReference`; the start-up hook makes
    it from $SLEUTH_REFERENCE).

    Calling it again returns the Dumper already attached. A config that is unreadable or
    invalid, or a Dumper that fails to start, warns once (``sleuth: the tensor dump is off for
    this run: ...``, the message naming the file and the key) and returns None: the script runs
    on without a dump. With $SLEUTH_STRICT=1 (or ``"on_error": "raise"`` in a config that
    reads) the error is raised instead: ConfigError, or the Dumper's.
    """
    global _attaching
    value = os.environ.get(ENV_VAR, "").strip()
    if not value or value == "0":
        return None
    if _active is not None:
        return _active
    if _attaching:
        # called again from inside this call: the first import of torch below runs the start-up
        # hook's attach (a script that calls this before importing torch); this call attaches
        return None
    _attaching = True
    try:
        return _attach(value, reference)
    finally:
        _attaching = False


def _attach(value: str, reference: StepListener | None = None) -> Dumper | None:
    global _active
    from sleuth.common import go_off, strict
    from tracer._config import DumpConfig
    from tracer._dumper import Dumper

    config = None
    try:
        config = DumpConfig.from_env(value)  # not None: attach_from_env returned for "" and "0"
        _active = Dumper(None, config, reference=reference)
    except Exception as e:
        if config.raises() if config is not None else strict():
            raise
        go_off(e, tool="tensor dump", off="the tensor dump is off for this run", raises=False,
               stacklevel=4)
        return None
    _register_exit(_close_at_exit)
    return _active


def _register_exit(fn) -> None:
    """Run `fn` at interpreter exit while the writer's machinery still works.

    Plain atexit is too late twice over: threading's exit hooks (which shut down the
    concurrent.futures pools the async writer uses) run before it, and h5py's own atexit handler,
    registered on first import, closes the HDF5 library before later-registered handlers run.
    threading's hooks run last-registered first, before either, once both modules are loaded.
    `fn` is registered with atexit too (it runs once; the second call finds nothing to close):
    a script that leaves with `atexit._run_exitfuncs()` and `os._exit()`, as a torchrun worker
    does to step past torch's gloo abort at exit (docs/frameworks.md), never runs threading's
    hooks, and its dump's last step would be lost. There atexit's handler, registered after
    h5py's, runs before it, while the writer's pools still run.
    """
    import concurrent.futures.thread  # noqa: F401  (registers its hook first)
    import threading

    import h5py  # noqa: F401
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(fn)
    atexit.register(fn)


def _close_at_exit() -> None:
    global _active
    dumper, _active = _active, None
    if dumper is not None:
        dumper.close()
