"""Files that claim more than they can legitimately hold: a compressed /records chunk that
inflates to gigabytes, a summary whose histogram index claims far more values than it stores,
an IR text of gigabytes, a gzip bomb as a trace. Each is refused with one line naming the file
and the bound, before the claim is read (docs/reliability.md, "Resources a file claims")."""
from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from test_fault_files import DUMP_COMMANDS, _run_cli


def _forge_records(step: Path, rows: int) -> None:
    """Replace /records of `step` by a deflated table of `rows` rows (the real rows, then
    zeros): a few KB on disk that inflate to `rows` x 254 bytes; its CRC attribute dropped,
    so nothing after the read catches it."""
    with h5py.File(step, "a") as f:
        real = f["records"][:]
        table = np.zeros(rows, dtype=real.dtype)
        table[:len(real)] = real
        del f["records"]
        f.create_dataset("records", data=table, chunks=(rows,), compression="gzip",
                         compression_opts=9)
        f.attrs.pop("records_crc32", None)


@pytest.mark.parametrize("command", ["dump-show", "check", "diff-good-bad"])
def test_a_records_chunk_that_inflates_far_past_its_size_is_refused(runs, command, capsys):
    """A /records chunk of a few KB that inflates 1000-fold was read whole by `dump show`
    (3.2 MB on disk, 2.5 GiB read, exit 0): deflate's bound (1100x) let it through, though a
    records table compresses about 8-fold. Refused before the read: exit 2, one line naming
    the file and the bound."""
    good, bad = runs
    step = bad / "dump" / "rank0" / "step0.h5"
    _forge_records(step, rows=64 * 1024)  # 16 MiB claimed, about 20 KB stored
    code, text = _run_cli(DUMP_COMMANDS[command](good, bad), capsys)
    assert "Traceback" not in text, text
    assert code == 2, text
    assert str(step) in text and "refused" in text and "times" in text, text


def test_a_records_table_deflated_as_tables_compress_reads(runs, capsys):
    """The same table written with deflate at its real size (h5repack -f GZIP=9 does this)
    reads as before."""
    good, bad = runs
    with h5py.File(bad / "dump" / "rank0" / "step0.h5", "r") as f:
        rows = len(f["records"])
    _forge_records(bad / "dump" / "rank0" / "step0.h5", rows=rows)
    code, text = _run_cli(["dump", "show", str(bad), "--step", "0"], capsys)
    assert code == 0, text


def _forge_histograms(summary: Path, index_rows: int) -> int:
    """Point `index_rows` rows of /hist_index at the whole of /hist_data (rows that overlap,
    as no writer makes them); returns how many values the rows claim."""
    with h5py.File(summary, "a", libver="latest") as f:
        index = f["hist_index"][:]
        n_data = f["hist_data"].shape[0]
        bins = (n_data - 1) // 2
        forged = np.repeat(index[:1], index_rows)
        forged["offset"] = 0
        forged["bins"] = bins
        f["hist_index"].resize((index_rows,))
        f["hist_index"][:] = forged
    return index_rows * (2 * bins + 1)


def test_a_histogram_index_claiming_more_than_the_data_is_refused(runs):
    """A 200 KiB summary whose histogram index claimed 160 million bins (rows pointing at the
    same stored values again and again) took the dashboard to 2.8 GiB. A writer's rows never
    overlap, so the index may claim at most the values /hist_data holds: ProfileFormatError
    naming the file and both counts, before any row is copied."""
    import profiler

    _, bad = runs
    summary = bad / "summary" / "rank0.h5"
    claimed = _forge_histograms(summary, index_rows=64)
    with pytest.raises(profiler.ProfileFormatError) as e:
        profiler.read_histograms(bad)
    assert str(summary) in str(e.value) and f"{claimed:,}" in str(e.value), e.value


def test_a_histogram_row_with_negative_bins_is_refused(runs):
    import profiler

    _, bad = runs
    summary = bad / "summary" / "rank0.h5"
    with h5py.File(summary, "a", libver="latest") as f:
        index = f["hist_index"][:]
        index["bins"][0] = -5
        f["hist_index"][:] = index
    with pytest.raises(profiler.ProfileFormatError) as e:
        profiler.read_histograms(bad)
    assert str(summary) in str(e.value), e.value


def test_a_summary_dataset_claiming_more_than_the_file_stores_is_refused(runs):
    """/hist_data resized to 40 million values never written: HDF5 hands back fill values
    for them, 320 MB read from a file of a few KB. Refused where the file is opened (the step
    file's rule, tracer.storage.open_h5's check)."""
    import profiler

    _, bad = runs
    summary = bad / "summary" / "rank0.h5"
    with h5py.File(summary, "a", libver="latest") as f:
        f["hist_data"].resize((40_000_000,))
        index = f["hist_index"][:]
        index["offset"][-1] = 40_000_000 - 2 * int(index["bins"][-1]) - 1
        f["hist_index"][:] = index
    with pytest.raises(profiler.ProfileFormatError) as e:
        profiler.read_histograms(bad)
    assert str(summary) in str(e.value) and "refused" in str(e.value), e.value


def test_an_ir_text_larger_than_any_graph_is_refused_unread(runs):
    """A Graph-page search read a 1.5 GiB `.ir` whole. An IR text larger than
    irdump.MAX_IR_BYTES is refused from its size, before a byte is read (a sparse file here:
    1.5 GiB that cost nothing on disk)."""
    import irdump
    from irdump._read import MAX_IR_BYTES

    _, bad = runs
    ir = bad / "ir" / "00_forward.ir"
    with open(ir, "r+b") as f:
        f.truncate(MAX_IR_BYTES + 1)
    with pytest.raises(irdump.IrFormatError) as e:
        irdump.read_ir(ir)
    assert str(ir) in str(e.value) and f"{MAX_IR_BYTES:,}" in str(e.value), e.value


def test_a_gzip_bomb_trace_is_refused_by_its_ratio_while_reading(runs, capsys):
    """A trace gzip of 2 MB that inflates to 2 GiB was read to its 2 GiB bound before the
    refusal. A trace compresses about 10-fold; one that inflates past
    profiler._trace.MAX_TRACE_RATIO times its size is refused while it is read: exit 2, one
    line naming the file and the bound. Scaled down: 48 MiB from 48 KB."""
    _, bad = runs
    trace = bad / "profile" / "rank0" / "window0.trace.json.gz"
    trace.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * (48 << 20) + b"]}", 9))
    code, text = _run_cli(["profile", str(bad)], capsys)
    assert "Traceback" not in text, text
    assert code == 2 and len(text.strip().splitlines()) == 1, text
    assert str(trace) in text and "times its size" in text, text


def test_a_trace_that_inflates_past_its_stated_size_is_refused(runs, capsys):
    """gzip states the inflated size in its last 4 bytes; a trace inflating past it is
    damaged or forged, and reading stops there."""
    _, bad = runs
    trace = bad / "profile" / "rank0" / "window0.trace.json.gz"
    data = bytearray(gzip.compress(gzip.decompress(trace.read_bytes())))
    data[-4:] = (100).to_bytes(4, "little")
    trace.write_bytes(bytes(data))
    code, text = _run_cli(["profile", str(bad)], capsys)
    assert code == 2 and str(trace) in text and "states" in text, text


def test_a_real_trace_still_reads(runs, capsys):
    good, _ = runs
    code, text = _run_cli(["profile", str(good)], capsys)
    assert code == 0, text


def test_a_truncated_summary_holds_no_claim_on_the_run_directory(runs, answers_within):
    """Found by the fuzz harness: a summary cut short (305 bytes) held the claim on the run
    directory (`sleuth train`, zero-code attach) for minutes: its failed open was retried as
    SWMR, where HDF5 retries each read with sleeps between. Only a file a killed writer left
    "open for write" is opened as SWMR (sleuth.common.left_open_for_write). A thread with a
    timeout, so that the hang fails instead of stalling."""
    import trainer

    _, bad = runs
    with open(bad / "summary" / "rank0.h5", "r+b") as f:
        f.truncate(305)
    answered, answer = answers_within(lambda: trainer.claim_run_dir(bad, "another-run"), 30)
    assert answered, "the claim waited on a truncated summary"
    assert isinstance(answer[0], trainer.OtherRunError), answer  # the run's other files name it
