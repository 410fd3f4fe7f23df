"""The door to a run's files (tracer.storage._door): strict names, paths a file names kept
inside the run, regular files only, names printed with controls escaped."""
from __future__ import annotations

import os

import pytest

from tracer import UntrustedFileError
from tracer.storage import (RANK_DIR, STEP_FILE, inside_run, kind_problem, number_of, numbered,
                            open_regular, printable)


@pytest.mark.parametrize("name, step", [("step0.h5", 0), ("step12.h5", 12),
                                        ("step00.h5", None), ("step01.h5", None),
                                        ("step\u0660.h5", None), ("step\uff11.h5", None),
                                        ("step 1.h5", None), ("step-1.h5", None),
                                        ("step1.h5x", None), ("xstep1.h5", None),
                                        ("step" + "0" * 248 + ".h5", None),
                                        ("step" + "9" * 19 + ".h5", None)])
def test_step_names_are_canonical_ascii_decimal(name, step):
    assert number_of(STEP_FILE, name) == step


def test_rank_and_other_names():
    assert number_of(RANK_DIR, "rank3") == 3 and number_of(RANK_DIR, "rank03") is None
    seg = numbered(r"rank{n}(?:\.seg{n})?\.h5")
    assert seg.fullmatch("rank0.seg2.h5").groups() == ("0", "2")
    assert seg.fullmatch("rank0.seg02.h5") is None


def test_inside_run(tmp_path):
    run = tmp_path / "run"
    (run / "profile" / "rank0").mkdir(parents=True)
    meta = run / "profile" / "rank0" / "window0.json"
    assert inside_run(run, meta, "window0.trace.json.gz") == \
        (run / "profile" / "rank0" / "window0.trace.json.gz").resolve()
    assert inside_run(run, meta, "../rank1/x") == (run / "profile" / "rank1" / "x").resolve()
    for name in ("../../../elsewhere", str(tmp_path / "x"), "", None, 3, "a\0b"):
        with pytest.raises(UntrustedFileError, match="window0.json"):
            inside_run(run, meta, name)
    (run / "profile" / "rank0" / "out").symlink_to(tmp_path)
    with pytest.raises(UntrustedFileError, match="leads out of the run"):
        inside_run(run, meta, "out/x")


def test_only_regular_files_open(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "FIFO" in kind_problem(fifo) and "folder" in kind_problem(tmp_path)
    assert kind_problem(tmp_path / "missing") is None
    for path in (fifo, tmp_path, "/dev/zero"):
        with pytest.raises(UntrustedFileError, match="not a regular file"):
            open_regular(path)
    (tmp_path / "f").write_bytes(b"abc")
    with open_regular(tmp_path / "f") as f:
        assert f.read() == b"abc"


def test_printable_escapes_controls_and_undecodable_bytes():
    assert printable("run-1") == "run-1"
    assert printable("a\x1b[2Jb\nc\x07") == "a\\x1b[2Jb\\nc\\x07"
    assert printable(os.fsdecode(b"run\xff")) == "run\\xff"
    assert printable(b"x\x9by") == "x\\x9by"
    assert printable("\u2028") == "\\u2028"


def test_atomic_file_appears_whole_or_not_at_all(tmp_path):
    from tracer.storage import atomic_file

    target = tmp_path / "t.csv"
    target.write_text("old")
    with pytest.raises(OSError):
        with atomic_file(target) as f:
            f.write("half")
            raise OSError(28, "No space left on device")
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]
    with atomic_file(target) as f:
        f.write("new")
    assert target.read_text() == "new" and sorted(tmp_path.iterdir()) == [target]
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_fifo_as_a_rank_lock_is_refused_not_waited_on(tmp_path):
    """A FIFO as `dump/rank0/.lock` held the writer at its start (the lock was read with a
    plain open); it is not a lock this sleuth reads: DumpLockedError naming it, at once."""
    import threading

    from tracer import TracerError
    from tracer._config import DumpConfig
    from tracer.storage import make_writer
    from tracer.storage._lock import LOCK_NAME

    lock = tmp_path / "dump" / "rank0" / LOCK_NAME
    lock.parent.mkdir(parents=True)
    os.mkfifo(lock)
    raised: list[BaseException] = []

    def start() -> None:
        try:
            w = make_writer(DumpConfig(path=str(tmp_path), writer="sync"), rank=0,
                            world_size=1)
            try:
                w.begin_step(0)  # the lock is taken with the first step
                w.end_step()
            finally:
                w.close()
        except TracerError as e:
            raised.append(e)

    worker = threading.Thread(target=start, daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():
        os.close(os.open(lock, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the writer waited on a FIFO as its rank lock")
    assert raised and str(lock) in str(raised[0]) and "not a lock" in str(raised[0]), raised
