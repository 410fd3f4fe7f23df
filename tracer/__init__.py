"""Tensor dump for any PyTorch training run: capture, HDF5 dump format, reader, diff and checks.

A record is made in `tracer.capture`, measured, written and read back in `tracer.storage`, and
compared and checked in `tracer.analysis`; `Dumper` drives the three, `DumpConfig` and the
errors are shared by all. Public names are loaded lazily (PEP 562, sleuth.common.lazy_exports) so that
`import tracer` costs nothing and the reader and diff work without importing torch. Each entry
maps a public name to the module or subpackage face that provides it; a test pins this list.
"""
from __future__ import annotations

from sleuth.common import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    # config and errors
    "DumpConfig": "tracer._config",
    "TracerError": "tracer._errors",
    "ConfigError": "tracer._errors",
    "DumpFormatError": "tracer._errors",
    "WatchpointHit": "tracer._errors",
    "ReferenceDiverged": "tracer._errors",
    "DumpWriteError": "tracer._errors",
    "RecordNotFoundError": "tracer._errors",
    "OtherRunError": "tracer._errors",
    "SleuthWarning": "sleuth.common",
    "UntrustedFileError": "tracer._errors",
    # the one switch of every tool that observes a run: raise (SLEUTH_STRICT=1) or warn and go off
    "strict": "sleuth.common",
    # capture
    "Dumper": "tracer._dumper",
    "attach_from_env": "tracer._attach",
    # reading
    "open_dump": "tracer.storage",
    "Dump": "tracer.storage",
    "RawTensor": "tracer.storage",
    "export_parquet": "tracer.storage",
    "read_export": "tracer.storage",
    # diff and checks
    "diff": "tracer.analysis",
    "DiffResult": "tracer.analysis",
    "diff_ranks": "tracer.analysis",
    "RankDiffResult": "tracer.analysis",
    "Tolerance": "tracer.analysis",
    "LiveReference": "tracer.analysis",
    "read_live_reference": "tracer.analysis",
    "check": "tracer.analysis",
    "first_nan_origin": "tracer.analysis",
    "headroom_trend": "tracer.analysis",
    "map_modules": "tracer.analysis",
    "WatchConfig": "tracer._watch_config",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
