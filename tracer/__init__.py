"""Tensor dump for any PyTorch training run: capture, HDF5 dump format, reader, diff and checks.

Public names are loaded lazily (PEP 562) so that `import tracer` costs nothing and the reader and
diff work without importing torch. Each entry maps a public name to the private module that
defines it; a test pins this list.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # config and errors
    "DumpConfig": "tracer._config",
    "TracerError": "tracer._errors",
    "ConfigError": "tracer._errors",
    "DumpFormatError": "tracer._errors",
    "WatchpointHit": "tracer._errors",
    "DumpWriteError": "tracer._errors",
    "RecordNotFoundError": "tracer._errors",
    # capture
    "Dumper": "tracer._dumper",
    "attach_from_env": "tracer._attach",
    # reading
    "open_dump": "tracer.storage._reader",
    "Dump": "tracer.storage._reader",
    "RawTensor": "tracer.storage._reader",
    "export_parquet": "tracer.storage._export",
    "read_export": "tracer.storage._export",
    # diff and checks
    "diff": "tracer.analysis._diff",
    "DiffResult": "tracer.analysis._diff",
    "Tolerance": "tracer.analysis._compare",
    "check": "tracer.analysis._check",
    "first_nan_origin": "tracer.analysis._check",
    "WatchConfig": "tracer.analysis._watch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tracer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
