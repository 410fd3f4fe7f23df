"""The bounded JSON reader: a file's size and nesting are checked before it is parsed."""
from __future__ import annotations

import os

import pytest

from tracer.storage import JsonLimitError, load_bounded, loads_bounded


def test_a_small_file_reads_and_brackets_inside_strings_do_not_count(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"name": "[[[[{{{{", "n": [1, [2]]}')
    assert load_bounded(path, max_depth=3) == {"name": "[[[[{{{{", "n": [1, [2]]}


def test_deep_nesting_is_one_clear_error(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(JsonLimitError, match="nested deeper than 64"):
        load_bounded(path)


def test_size_is_read_from_the_disk_not_the_content(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"a": "' + "x" * 2000 + '"}')
    with pytest.raises(JsonLimitError, match="more than the 1,000"):
        load_bounded(path, max_bytes=1000)
    with pytest.raises(JsonLimitError, match="more than the 1,000"):
        loads_bounded(path.read_text(), "inline", max_bytes=1000)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_or_a_device_is_refused_without_reading(tmp_path):
    fifo = tmp_path / "cfg.json"
    os.mkfifo(fifo)
    with pytest.raises(JsonLimitError, match="not a regular file"):
        load_bounded(fifo)
    with pytest.raises(JsonLimitError, match="not a regular file"):
        load_bounded("/dev/zero")


def test_invalid_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"a": 1,\n "b": }')
    with pytest.raises(JsonLimitError, match=r"run.json:2:7: invalid JSON"):
        load_bounded(path)
