"""The tracer's public API: pinned, every name resolvable, and `import tracer` stays free."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import tracer
import tracer.analysis
import tracer.storage

EXPECTED = [
    "ConfigError", "DiffResult", "Dump", "DumpConfig", "DumpFormatError", "DumpWriteError",
    "Dumper", "LiveReference", "OtherRunError", "RankDiffResult", "RawTensor",
    "RecordNotFoundError", "ReferenceDiverged", "SleuthWarning", "Tolerance",
    "TracerError", "UntrustedFileError", "WatchConfig", "WatchpointHit", "attach_from_env", "check",
    "diff", "diff_ranks",
    "export_parquet", "first_nan_origin", "headroom_trend", "map_modules", "open_dump",
    "read_export", "read_live_reference", "strict",
]


FACES = {
    "capture": ["CallNames", "EagerWhileDumped", "KERNEL_OP", "Kernels", "ModuleTracker",
                "OpMode", "ParamRecords", "SetupRecorder", "Site", "compiled_inner", "encode_call",
                "fingerprint", "in_graph_capture", "local_shard", "on_clip", "on_region",
                "on_scaler_scale", "on_scaler_unscale", "on_scaler_update", "recording_closure",
                "rewrap",
                "tool_range", "user_source"],
    "storage": ["DUMP_JSON", "Dump", "ExportedDump", "FlightRecorder",
                "JsonLimitError", "RANK_DIR", "READ_ERRORS", "RECORD_FIELDS",
                "RawTensor", "ReadError", "RecordMeta", "RecordRow", "SKETCH_SIZE",
                "STEP_FILE", "TensorReader", "UNREAD_STATES", "Watcher", "Writer",
                "atomic_file", "c_order_bytes", "check_h5", "config_of", "copy_stats", "damaged_files",
                "decode_bits", "dense_strides", "difference_sketch",
                "difference_stats", "disarm_flight_recorder", "dump_folder",
                "element_size", "export_parquet", "file_rows", "inside_run",
                "install_flight_recorder", "install_watch", "is_export",
                "kind_problem", "load_bounded", "loads_bounded", "make_writer",
                "number_of", "numbered", "op_capture_of", "open_dump", "open_h5",
                "open_regular", "parse_shape", "path_problem", "printable",
                "read_bounded", "read_export", "read_flight_recorder", "read_sketches",
                "read_text_bounded", "sketch_positions",
                "sketch_row", "step_path", "step_status", "stored_extent"],
    "analysis": ["AuditResult", "Coverage", "DiffResult", "Explanation", "HeadroomReport",
                 "LiveReference", "ModuleMap",
                 "NotReplayable", "RankDiffResult",
                 "TABLE_READ_ERRORS", "Tolerance", "WatchConfig", "audit", "check",
                 "check_ranks",
                 "describe_origin", "diff", "diff_ranks",
                 "dump_ranks", "explain", "find_first_nan", "first_nan_origin",
                 "headroom_trend", "map_modules",
                 "read_flight_recorder", "read_live_reference", "read_module_map",
                 "record_headroom", "replay",
                 "write_repro"],
}


def test_all_is_pinned_and_sorted():
    assert tracer.__all__ == EXPECTED


def test_each_face_is_pinned_and_resolves():
    """What the subpackages offer each other, the Dumper and the CLI (docs/architecture.md)."""
    for sub, names in FACES.items():
        face = importlib.import_module(f"tracer.{sub}")
        assert face.__all__ == names, sub
        for name in names:
            assert getattr(face, name) is not None, (sub, name)
        assert set(names) <= set(dir(face))


def test_public_names_are_the_faces_objects():
    assert tracer.open_dump is tracer.storage.open_dump
    assert tracer.diff is tracer.analysis.diff
    assert tracer.WatchConfig is tracer.analysis.WatchConfig
    assert tracer.headroom_trend is tracer.analysis.headroom_trend


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
