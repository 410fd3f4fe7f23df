"""Zero-code attach: dump a script nobody edited, configured by $SLEUTH_DUMP_CONFIG.

``SLEUTH_DUMP_CONFIG`` holds a JSON config path, inline JSON (``{...}``) or ``1`` (defaults).
The Dumper attaches to every top-level module that runs (global module hooks), counts steps
with the global optimizer hook, takes rank and world size from ``RANK``/``WORLD_SIZE`` and the
run directory from the config's ``path`` or ``SLEUTH_RUN_DIR``, and is closed at interpreter
exit so the last step is written. When the variable is unset nothing is imported or installed.
"""
from __future__ import annotations

import atexit
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tracer._dumper import Dumper

ENV_VAR = "SLEUTH_DUMP_CONFIG"
_active: Dumper | None = None


def attach_from_env() -> Dumper | None:
    """Attach a global Dumper as $SLEUTH_DUMP_CONFIG says; None when it is unset or "0".

    Calling it again returns the Dumper already attached. Raises ConfigError when the config is
    unreadable or invalid (the message names the file and the key).
    """
    global _active
    value = os.environ.get(ENV_VAR, "").strip()
    if not value or value == "0":
        return None
    if _active is not None:
        return _active
    from tracer._config import DumpConfig
    from tracer._dumper import Dumper
    from tracer._errors import ConfigError

    if value.startswith("{"):
        try:
            config = DumpConfig.from_dict(json.loads(value))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{ENV_VAR} holds invalid inline JSON: {e}") from e
    elif value == "1":
        config = DumpConfig()
    else:
        config = DumpConfig.from_json(value)
    _active = Dumper(None, config)
    atexit.register(_close_at_exit)
    return _active


def _close_at_exit() -> None:
    global _active
    dumper, _active = _active, None
    if dumper is not None:
        dumper.close()
