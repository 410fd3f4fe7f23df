"""Files that are not what their place says, read through the one door to a run's files
(tracer.storage._door): a profile window naming a trace outside the run, files whose names
only look like a step's or a rank's, and FIFOs where a step file or a summary goes.
docs/reliability.md, "One door", keeps the table of these classes and outcomes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_fault_files import DUMP_COMMANDS, _run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_profile_window_naming_a_trace_outside_the_run_is_refused(runs, tmp_path, where,
                                                                  capsys):
    """window{K}.json's "trace" that leads out of the run (`../../..`, or an absolute path) was
    followed: another run's ops reported as this one's, exit 0. Refused: exit 2, one line naming
    the window's metadata; nothing of the other file read."""
    good, bad = runs
    meta_path = bad / "profile" / "rank0" / "window0.json"
    other = tmp_path / "elsewhere" / "profile" / "rank0" / "window0.trace.json.gz"
    other.parent.mkdir(parents=True)
    shutil.copyfile(good / "profile" / "rank0" / "window0.trace.json.gz", other)
    meta = json.loads(meta_path.read_text())
    meta["trace"] = str(other) if where == "absolute" else os.path.relpath(other, meta_path.parent)
    meta_path.write_text(json.dumps(meta))
    code, text = _run_cli(["profile", str(bad)], capsys)
    assert "Traceback" not in text, text
    assert code == 2 and len(text.strip().splitlines()) == 1, text
    assert str(meta_path) in text and "not followed" in text, text


def test_profile_trace_named_inside_the_run_is_read(runs, capsys):
    """A "trace" that stays in the run (`./window0.trace.json.gz`) is still read."""
    _, bad = runs
    meta_path = bad / "profile" / "rank0" / "window0.json"
    meta = json.loads(meta_path.read_text())
    meta["trace"] = "./" + meta["trace"]
    meta_path.write_text(json.dumps(meta))
    code, text = _run_cli(["profile", str(bad)], capsys)
    assert code == 0, text


LOOKALIKES = {
    "leading-zero": "dump/rank0/step00.h5",
    "unicode-digit": "dump/rank0/step\u0660.h5",
    "255-bytes": "dump/rank0/step" + "0" * 248 + ".h5",
    "rank-leading-zero": "dump/rank00/step0.h5",
}


@pytest.mark.parametrize("command", ["diff-good-bad", "dump-show"])
@pytest.mark.parametrize("case", sorted(LOOKALIKES))
def test_files_named_like_step_0_never_replace_it(runs, case, command, capsys):
    """`step00.h5`, `step٠.h5` (an Arabic-Indic zero), `step000…0.h5` and `rank00/step0.h5` were
    each parsed as step 0 of rank 0 and replaced the real one in `dump show` and `diff` (a
    divergence the real files do not have). Names match strictly (`step` + canonical ASCII
    decimal): they are no step file, and the real step 0 is read."""
    good, bad = runs
    lookalike = bad / LOOKALIKES[case]
    lookalike.parent.mkdir(exist_ok=True)
    shutil.copyfile(bad / "dump" / "rank0" / "step1.h5", lookalike)
    code, text = _run_cli(DUMP_COMMANDS[command](good, bad), capsys)
    assert code == 0, text
    if command == "dump-show":
        _, expected = _run_cli(DUMP_COMMANDS[command](good, good), capsys)
        assert text.replace(str(bad), str(good)) == expected
    else:
        assert "SAME" in text, text
    code, text = _run_cli(["dump", "ls", str(bad)], capsys)
    assert code == 0 and "2 step file(s)" in text, text


@pytest.mark.parametrize("command", ["dump-ls", "check", "diff-good-bad"])
def test_fifo_named_as_a_step_file_is_refused_not_waited_on(runs, command):
    """A FIFO named `step1.h5` blocked `dump ls`, `check` and `diff` forever in HDF5's open.
    Only regular files are opened: the FIFO is named as unreadable (exit 2), the other step
    is still read. A real process with a timeout, so that a hang fails instead of stalling."""
    good, bad = runs
    fifo = bad / "dump" / "rank0" / "step1.h5"
    fifo.unlink()
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, "-m", "sleuth", *DUMP_COMMANDS[command](good, bad)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        _release(fifo)
        pytest.fail(f"sleuth {command} waited on a FIFO named step1.h5")
    text = done.stdout + done.stderr
    assert "Traceback" not in text, text
    assert done.returncode == 2, text
    assert str(fifo) in text and "FIFO" in text, text


def _release(fifo: Path) -> None:
    """Let a reader blocked in open() on `fifo` go (a writer end appears and closes)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_fifo_as_a_profile_trace_is_refused(runs, capsys):
    _, bad = runs
    fifo = bad / "profile" / "rank0" / "window0.trace.json.gz"
    fifo.unlink()
    os.mkfifo(fifo)
    code, text = _run_cli(["profile", str(bad)], capsys)
    assert code == 2 and "FIFO" in text and str(fifo) in text, text


EVIL = "evil\x1b[31mRED\x07\x9b2J"


@pytest.mark.parametrize("command", ["dump-ls", "check", "train"])
def test_control_characters_in_a_run_id_are_escaped(runs, tmp_path, command, capsys):
    """A run id with control characters (run.json, dump/dump.json) was printed raw to the
    terminal by `train`, `run`, `dump ls` and `check` (an escape sequence drives the terminal).
    Printed through tracer.storage.printable: the controls are shown as `\\x1b`, `\\x07`."""
    _, bad = runs
    for name in ("run.json", "dump/dump.json"):
        data = json.loads((bad / name).read_text())
        data["run_id"] = EVIL
        (bad / name).write_text(json.dumps(data))
    argv = (["train", "--preset", "tiny", "--set", "steps=1", "--run-dir", str(bad)]
            if command == "train" else DUMP_COMMANDS[command](bad, bad))
    code, text = _run_cli(argv, capsys)
    assert code != 0 and "evil" in text, text
    assert not any(c in text for c in "\x1b\x07\x9b"), repr(text)
    assert "evil\\x1b[31mRED\\x07\\x9b2J" in text, text


def test_run_folder_named_with_undecodable_bytes_reads(runs, tmp_path, capsys):
    """In a run folder whose name holds bytes that are not UTF-8, `dump ls` called both
    complete steps damaged (UnicodeEncodeError: pandas' Arrow strings refuse the path's
    surrogate escapes); they read, and the path is printed with the byte escaped."""
    good, _ = runs
    odd = tmp_path / os.fsdecode(b"run\xff")
    shutil.copytree(good, odd)
    code, text = _run_cli(["dump", "ls", str(odd)], capsys)
    assert code == 0 and "damaged" not in text, text
    assert "run\\xff" in text and "\udcff" not in text, text
    code, text = _run_cli(["diff", str(good), str(odd)], capsys)
    assert code == 0 and "SAME" in text, text


def _cli_with_file_size_limit(argv: list[str], limit: int) -> subprocess.CompletedProcess:
    """`sleuth argv` in a process that may write no file past `limit` bytes (RLIMIT_FSIZE,
    SIGXFSZ ignored): every write past it fails as on a full disk."""
    import resource
    import signal

    def limit_writes() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-m", "sleuth", *argv], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120, preexec_fn=limit_writes)


def test_profile_csv_on_a_full_disk_leaves_no_truncated_table(runs, tmp_path):
    """`profile --csv` on a full disk left a truncated ops.csv beside the whole tables. Each
    table is written whole or not at all: exit 2, one line naming the table, and every table
    left in the folder is the one written without the limit."""
    good, _ = runs
    whole, full = tmp_path / "whole", tmp_path / "full"
    from sleuth.cli import main

    assert main(["profile", str(good), "--csv", str(whole)]) == 0
    sizes = sorted(p.stat().st_size for p in whole.glob("*.csv"))
    done = _cli_with_file_size_limit(["profile", str(good), "--csv", str(full)],
                                     limit=sizes[-1] - 1)
    left = sorted(p.name for p in full.iterdir())
    assert not [n for n in left if not n.endswith(".csv")], left
    for name in left:
        assert (full / name).read_bytes() == (whole / name).read_bytes(), name
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "cannot write" in done.stderr and len(done.stderr.strip().splitlines()) == 1, \
        done.stderr


def test_diff_csv_on_a_full_disk_leaves_no_temporary_file(runs, tmp_path):
    """`diff --csv` on a full disk left its temporary file beside the target. Removed: exit 2,
    one line naming the file, nothing left in the folder."""
    good, _ = runs
    out = tmp_path / "out" / "rows.csv"
    out.parent.mkdir()
    done = _cli_with_file_size_limit(["diff", str(good), str(good), "--csv", str(out)],
                                     limit=16 << 10)
    assert list(out.parent.iterdir()) == []
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert str(out) in done.stderr, done.stderr


@pytest.mark.parametrize("name", ["dump/rank0/step0.h5", "dump/dump.json"])
def test_a_run_file_linked_out_of_its_folder_is_not_followed(runs, tmp_path, name, capsys):
    """Found by the fuzz harness: `dump/dump.json` as a soft link to a file outside the run
    was read by `dump ls` (a step file so linked by `dump show`): another file taken as the
    run's. A soft link is followed only within its folder: the step is refused (exit 2, one
    line naming the link), dump.json is taken as absent; the file outside keeps its access time
    (nothing of it read)."""
    import time

    good, bad = runs
    outside = tmp_path / "outside" / Path(name).name
    outside.parent.mkdir()
    shutil.copyfile(good / name, outside)
    os.utime(outside, (0, time.time()))
    (bad / name).unlink()
    os.symlink(outside, bad / name)
    command = ["dump", "show", str(bad), "--step", "0"] if name.endswith(".h5") else \
        ["dump", "ls", str(bad)]
    code, text = _run_cli(command, capsys)
    assert "Traceback" not in text, text
    assert outside.stat().st_atime == 0, "the file outside the run was read"
    if name.endswith(".h5"):
        assert code == 2 and "soft link leading out of its folder" in text, text
    else:  # the dump's run record unread: the dump is listed as one without it
        assert code == 0, text
