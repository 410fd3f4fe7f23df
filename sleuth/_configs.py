"""Config options of the commands: a JSON file, or inline JSON where the tool's environment
variable takes it.

`--dump` takes what `SLEUTH_DUMP_CONFIG` takes: a path, or inline JSON (`'{"steps": "0"}'`);
`check --watch` takes a path or inline JSON. A path must name a regular file of bounded size:
`/dev/zero` would be read until memory runs out and a FIFO would block forever, so both are
refused with one line (`tracer.storage.read_text_bounded`).
"""
from __future__ import annotations

from typing import Any

from sleuth.cli import CliError


def is_inline(value: str) -> bool:
    """Whether an option's value is inline JSON (an object or an array), not a path."""
    return value.lstrip().startswith(("{", "["))


def dump_config(value: str, flag: str = "--dump") -> Any:
    """The `tracer.DumpConfig` an option names: inline JSON or a JSON file. CliError naming
    `flag` when it cannot be read or is not a valid config."""
    import tracer

    try:
        if is_inline(value):
            return tracer.DumpConfig.from_text(value, "inline JSON")
        return tracer.DumpConfig.from_json(value)
    except tracer.TracerError as e:
        raise CliError(f"{flag}: {e}") from e


def collector_config(value: str, flag: str = "--profile") -> Any:
    """The `profiler.CollectorConfig` in the JSON file an option names (CliError naming `flag`)."""
    import profiler

    try:
        return profiler.CollectorConfig.from_json(value)
    except profiler.ProfilerError as e:
        raise CliError(f"{flag}: {e}") from e


def json_option(value: str, flag: str) -> Any:
    """The JSON an option gives inline or in a file (read bounded, regular files only)."""
    from tracer.storage import JsonLimitError, load_bounded, loads_bounded

    try:
        if is_inline(value):
            return loads_bounded(value, "inline JSON")
        return load_bounded(value)
    except JsonLimitError as e:
        raise CliError(f"{flag}: {e}") from e
