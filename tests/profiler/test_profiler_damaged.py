"""Damaged profile files (window metadata, summaries, traces, cached tables) end in one clear
ProfileFormatError naming the file, never a traceback, and `sleuth profile` exits 2 with it."""
from __future__ import annotations

import gzip
import json

import pytest

import profiler
from sleuth.cli import main

_EVENT = {"ph": "X", "name": "aten::mm", "ts": 1, "dur": 5, "tid": 1, "pid": 1, "cat": "cpu_op"}


def _window(tmp_path, *, meta=b'{"format_version": "1.0"}', trace=None, gz=False):
    d = tmp_path / "run" / "profile" / "rank0"
    d.mkdir(parents=True)
    (d / "window0.json").write_bytes(meta)
    body = trace if trace is not None else json.dumps({"traceEvents": [_EVENT]}).encode()
    if gz:
        (d / "window0.trace.json.gz").write_bytes(body)
    else:
        (d / "window0.trace.json").write_bytes(body)
    return tmp_path / "run", d


def test_an_intact_window_reads(tmp_path):
    run, _ = _window(tmp_path)
    assert list(profiler.read_profile(run).ops["name"]) == ["aten::mm"]


@pytest.mark.parametrize("case", ["meta_bytes", "meta_list", "meta_truncated", "meta_deep",
                                  "trace_bytes", "trace_deep", "trace_gz_garbage",
                                  "trace_gz_truncated", "trace_gz_bomb", "event_garbage"])
def test_damaged_window_names_the_file(tmp_path, capsys, monkeypatch, case):
    monkeypatch.setattr("profiler._trace.MAX_TRACE_BYTES", 64 * 1024, raising=False)  # the bomb, scaled down
    good = json.dumps({"traceEvents": [_EVENT]}).encode()
    kw = {
        "meta_bytes": {"meta": b"\xff\xfe\x00garbage"},
        "meta_list": {"meta": b"[1, 2]"},
        "meta_truncated": {"meta": b'{"format_vers'},
        "meta_deep": {"meta": b'{"a":' * 100_000 + b"1" + b"}" * 100_000},
        "trace_bytes": {"trace": b"\xff\xfe\x00"},
        "trace_deep": {"trace": b"[" * 200_000 + b"]" * 200_000},
        "trace_gz_bomb": {"trace": gzip.compress(good + b" " * (64 * 1024)), "gz": True},
        "trace_gz_garbage": {"trace": b"\x1f\x8b\x08\x00" + b"\x07" * 64, "gz": True},
        "trace_gz_truncated": {"trace": gzip.compress(good)[:-12], "gz": True},
        "event_garbage": {"trace": json.dumps({"traceEvents": [{**_EVENT, "ts": "soon"}]}).encode()},
    }[case]
    run, d = _window(tmp_path, **kw)
    with pytest.raises(profiler.ProfileFormatError) as e:
        profiler.read_profile(run)
    assert str(d) in str(e.value)
    assert main(["profile", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(d) in err and "Traceback" not in err


def test_a_damaged_table_cache_is_rebuilt_from_the_trace(tmp_path):
    run, d = _window(tmp_path)
    for t in ("ops", "modules", "steps", "memory"):
        (d / f"window0.{t}.parquet").write_bytes(b"PAR1 damaged")
    (d / "window0.summary.json").write_bytes(b"\xff")
    assert list(profiler.read_profile(run).ops["name"]) == ["aten::mm"]
