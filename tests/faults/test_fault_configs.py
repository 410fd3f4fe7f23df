"""Configs with every kind of wrong value, and dump files of wrong and future format versions:
each is refused before any work starts, with exit code 2, one message naming the file and the
key, no traceback, and nothing written."""
from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest

BAD_DUMP_CONFIGS = {
    "unknown-key": '{"steps": "0", "levle": "op"}',
    "duplicate-key": '{"steps": "0", "steps": "1"}',
    "not-json": '{"steps": "0",',
    "not-an-object": '["steps"]',
    "empty-file": '',
    "bad-level": '{"level": "modul"}',
    "bad-mode": '{"mode": "tensors"}',
    "bad-steps-text": '{"steps": "zero"}',
    "negative-steps": '{"steps": "-3"}',
    "reversed-range": '{"steps": "8-5"}',
    "bad-ranks": '{"ranks": "a|b"}',
    "bad-writer": '{"writer": "threaded"}',
    "queue-huge": '{"async_max_queued_mb": 1e12}',
    "queue-zero": '{"async_max_queued_mb": 0}',
    "queue-negative": '{"async_max_queued_mb": -5}',
    "queue-nan": '{"async_max_queued_mb": NaN}',
    "queue-string": '{"async_max_queued_mb": "lots"}',
    "params-string": '{"params": "yes"}',
    "modules-not-list": '{"modules": 5}',
    "bad-regex": '{"modules": ["re:(unclosed"]}',
    "watch-unknown-condition": '{"watch": [{"condition": "nan_infs"}]}',
    "watch-nan-threshold": '{"watch": [{"condition": "max_abs_gt", "threshold": NaN}]}',
    "watch-inf-threshold": '{"watch": [{"condition": "max_abs_gt", "threshold": Infinity}]}',
    "watch-missing-threshold": '{"watch": [{"condition": "max_abs_gt"}]}',
    "watch-range-reversed": '{"watch": [{"condition": "out_of_range", "low": 5, "high": -5}]}',
    "watch-bad-on-hit": '{"watch": [{"condition": "nan_inf", "on_hit": "explode"}]}',
    "watch-duplicate-key": '{"watch": [{"condition": "nan_inf", "condition": "all_zero"}]}',
}


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    from sleuth.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    except BaseException:
        pytest.fail(f"sleuth {' '.join(argv)} raised:\n{traceback.format_exc()}")
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("entry", ["train", "run"])
@pytest.mark.parametrize("name", sorted(BAD_DUMP_CONFIGS))
def test_bad_dump_config_refused_before_work(tmp_path, name, entry, capsys):
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(BAD_DUMP_CONFIGS[name])
    run = tmp_path / "run"
    marker = tmp_path / "child-ran"
    if entry == "train":
        argv = ["train", "--preset", "tiny", "--set", "steps=1", "--run-dir", str(run),
                "--dump", str(cfg)]
    else:
        argv = ["run", "--run-dir", str(run), "--dump", str(cfg), "--", "python3", "-c",
                f"open({str(marker)!r}, 'w').close()"]
    code, text = _run_cli(argv, capsys)
    assert "Traceback" not in text, text
    assert code == 2, text
    assert cfg.name in text, f"the message does not name {cfg.name}:\n{text}"
    assert not marker.exists(), "the script ran with a config that was refused"
    assert not (run / "dump").exists() or not any((run / "dump").rglob("*.h5"))


@pytest.mark.parametrize("version", ["9.0", "abc", "", None])
@pytest.mark.parametrize("command", ["diff", "check", "dump-ls"])
def test_wrong_format_version_refused(pristine, tmp_path, version, command, capsys):
    import shutil

    import h5py

    bad = tmp_path / "bad"
    shutil.copytree(pristine / "dump", bad / "dump")
    target = bad / "dump" / "rank0" / "step0.h5"
    with h5py.File(target, "r+") as f:
        if version is None:
            del f.attrs["format_version"]
        else:
            f.attrs["format_version"] = version
    argv = {"diff": ["diff", str(pristine), str(bad)], "check": ["check", str(bad)],
            "dump-ls": ["dump", "ls", str(bad)]}[command]
    code, text = _run_cli(argv, capsys)
    assert "Traceback" not in text, text
    # `dump ls` lists every file with its status and exits 1 when one is not complete (a newer
    # major version refuses the whole dump: 2); the commands that answer from the files exit 2
    assert code == 2 or (command == "dump-ls" and code == 1 and version != "9.0"), text
    assert target.name in text, text


@pytest.mark.parametrize("address", ["garbage://x", "tcp://", "tcp://host name:8786"])
@pytest.mark.parametrize("command", ["check", "diff"])
def test_scheduler_address_that_does_not_read(pristine, tmp_path, address, command, capsys):
    """`--scheduler` with an address Dask cannot read ended in Dask's ValueError traceback; it
    is refused before any connection: exit 2, one line naming the address and the form."""
    import shutil

    pytest.importorskip("distributed")
    run = tmp_path / "run"
    shutil.copytree(pristine / "dump", run / "dump")
    shutil.copytree(run / "dump" / "rank0", run / "dump" / "rank1")  # the ranks go to Dask
    argv = ([command, str(run)] if command == "check" else [command, str(run), str(run)]) + [
        "--scheduler", address]
    code, text = _run_cli(argv, capsys)
    assert "Traceback" not in text, text
    assert code == 2 and len(text.strip().splitlines()) == 1, text
    assert f"Dask scheduler address {address!r}" in text, text


def test_interpret_at_level_module_is_said_to_do_nothing_more():
    # the interpreter's records are op records: at level module it would silently be "compiled"
    import warnings

    from tracer import SleuthWarning
    from tracer._config import DumpConfig

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        DumpConfig(path="x", compiled="interpret", level="op")
        DumpConfig(path="x", compiled="interpret")
    said = [str(w.message) for w in seen if issubclass(w.category, SleuthWarning)]
    assert len(said) == 1 and 'set "level": "op" or "mix"' in said[0], said
