"""The tracer's public API: pinned, every name resolvable, and `import tracer` stays free."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tracer

EXPECTED = [
    "ConfigError", "DiffResult", "Dump", "DumpConfig", "DumpFormatError", "DumpWriteError",
    "Dumper", "RawTensor", "RecordNotFoundError", "Tolerance", "TracerError", "WatchConfig",
    "WatchpointHit", "attach_from_env", "check", "diff", "export_parquet",
    "first_nan_origin", "open_dump", "read_export",
]


def test_all_is_pinned_and_sorted():
    assert tracer.__all__ == EXPECTED


def test_every_public_name_resolves():
    for name in tracer.__all__:
        assert getattr(tracer, name) is not None, name


def test_unknown_name_is_an_attribute_error():
    try:
        tracer.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_import_tracer_imports_nothing_heavy():
    code = ("import sys, tracer; "
            "print(sorted(m for m in ('torch', 'h5py', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert out == "[]"
