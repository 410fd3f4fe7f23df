"""Where a record is measured, written and read back: tensor statistics (and their C kernel), the
HDF5 step file, the synchronous and asynchronous writers, the rank lock, and the reader; beside
the writer, the live watch observer and the flight recorder (written on a crash, read back here).

The reader side (`open_dump`, `Dump`, the decoding helpers) never imports torch. Names load
lazily (sleuth.common.lazy_exports); a test pins this list.
"""
from __future__ import annotations

from sleuth.common import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    # measuring
    "copy_stats": "tracer.storage._stats",
    "difference_stats": "tracer.storage._stats",
    "difference_sketch": "tracer.storage._sampling",
    # the step file and its layout
    "RECORD_FIELDS": "tracer.storage._format",
    "step_path": "tracer.storage._format",
    "dense_strides": "tracer.storage._layout",
    "stored_extent": "tracer.storage._layout",
    # writing
    "RecordMeta": "tracer.storage._format",
    "RecordRow": "tracer.storage._format",
    "Writer": "tracer.storage._writer",
    "make_writer": "tracer.storage._make_writer",
    # on the writer's rows while recording: watchpoints, and the flight recorder
    "Watcher": "tracer.storage._watch_observer",
    "install_watch": "tracer.storage._watch_observer",
    "FlightRecorder": "tracer.storage._flight_writer",
    "install_flight_recorder": "tracer.storage._flight_writer",
    "disarm_flight_recorder": "tracer.storage._flight_writer",
    "read_flight_recorder": "tracer.storage._flight_reader",
    # reading
    "DUMP_JSON": "tracer.storage._lock",
    "open_h5": "tracer.storage._h5open",
    "path_problem": "tracer.storage._h5open",
    "check_h5": "tracer.storage._h5open",
    "open_dump": "tracer.storage._reader",
    "Dump": "tracer.storage._dump",
    "UNREAD_STATES": "tracer.storage._scan",
    "dump_folder": "tracer.storage._scan",
    "file_rows": "tracer.storage._listing",
    "damaged_files": "tracer.storage._listing",
    "READ_ERRORS": "tracer.storage._step_reader",
    "config_of": "tracer.storage._step_reader",
    "op_capture_of": "tracer.storage._step_reader",
    "read_sketches": "tracer.storage._step_reader",
    "step_status": "tracer.storage._step_reader",
    "ReadError": "tracer.storage._tensor_reader",
    "TensorReader": "tracer.storage._tensor_reader",
    "RawTensor": "tracer.storage._decode",
    "decode_bits": "tracer.storage._decode",
    "element_size": "tracer.storage._decode",
    "c_order_bytes": "tracer.storage._decode",
    "parse_shape": "tracer.storage._decode",
    "sketch_positions": "tracer.storage._sketch",
    "sketch_row": "tracer.storage._sketch",
    "SKETCH_SIZE": "tracer.storage._sketch",
    # the one door to a run's files: strict names, paths kept inside the run, regular files,
    # names printed escaped
    "STEP_FILE": "tracer.storage._door",
    "atomic_file": "tracer.storage._door",
    "RANK_DIR": "tracer.storage._door",
    "inside_run": "tracer.storage._door",
    "kind_problem": "tracer.storage._door",
    "number_of": "tracer.storage._door",
    "numbered": "tracer.storage._door",
    "open_regular": "tracer.storage._door",
    "printable": "tracer.storage._door",
    "read_bounded": "tracer.storage._door",
    # JSON files a run wrote, read within size and depth limits
    "JsonLimitError": "tracer.storage._bounded_json",
    "load_bounded": "tracer.storage._bounded_json",
    "loads_bounded": "tracer.storage._bounded_json",
    "read_text_bounded": "tracer.storage._bounded_json",
    # exporting
    "ExportedDump": "tracer.storage._export",
    "export_parquet": "tracer.storage._export",
    "is_export": "tracer.storage._export",
    "read_export": "tracer.storage._export",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
