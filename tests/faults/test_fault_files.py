"""Every file Sleuth writes, damaged as disks and crashes damage files (truncated at many offsets,
bytes flipped in its header, metadata and data), then read by every command a user would point
at it. For each case: no traceback, a non-zero exit code (or the reader's own error type) with a
message naming the damaged file, and no file changed by the reading. docs/reliability.md keeps
the table of these classes and outcomes."""
from __future__ import annotations

import traceback
from pathlib import Path

import pytest

import damage

DUMP_REGIONS = ("superblock", "root_header", "data:records")
DUMP_COMMANDS = {
    "diff-good-bad": lambda g, b: ["diff", str(g), str(b)],
    "diff-bad-good": lambda g, b: ["diff", str(b), str(g)],
    "check": lambda g, b: ["check", str(b)],
    "check-first-nan": lambda g, b: ["check", str(b), "--first-nan"],
    "dump-ls": lambda g, b: ["dump", "ls", str(b)],
    "dump-show": lambda g, b: ["dump", "show", str(b), "--step", "0"],
}


def _damage(path: Path, case: str) -> None:
    if case.startswith("truncate@"):
        damage.truncate(path, case)
        return
    region = case.split("flip@", 1)[1]
    hdf5 = region in ("superblock", "root_header") or region.startswith("data:")
    regions = damage.hdf5_regions(path) if hdf5 else damage.text_regions(path)
    damage.flip(path, regions[region])


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    from sleuth.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 2
    except BaseException:  # a traceback is what the suite exists to catch
        pytest.fail(f"sleuth {' '.join(argv)} raised:\n{traceback.format_exc()}")
    out = capsys.readouterr()
    return code, out.out + out.err


def _assert_named_refusal(code: int, text: str, damaged: Path, argv: list[str]) -> None:
    assert "Traceback" not in text, text
    assert code != 0, f"sleuth {' '.join(argv)} exited 0 on {damaged}:\n{text}"
    assert damaged.name in text, f"the message does not name {damaged.name}:\n{text}"


DUMP_CASES = damage.truncations() + [f"flip@{r}" for r in DUMP_REGIONS]


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(DUMP_COMMANDS))
@pytest.mark.parametrize("case", DUMP_CASES)
def test_damaged_step_file(runs, case, command, capsys):
    good, bad = runs
    target = bad / "dump" / "rank0" / "step0.h5"
    _damage(target, case)
    before = damage.fingerprint(good, bad)
    argv = DUMP_COMMANDS[command](good, bad)
    code, text = _run_cli(argv, capsys)
    _assert_named_refusal(code, text, target, argv)
    assert damage.fingerprint(good, bad) == before, "a reading command changed files"


@pytest.mark.parametrize("command", ["diff-good-bad", "check"])
def test_flipped_tensor_bytes_never_read_as_same(runs, command, capsys):
    """Bytes flipped inside the stored tensors: statistics still read, so `check` may answer from
    them, but `diff` reads the tensors and must not call the runs the same."""
    good, bad = runs
    target = bad / "dump" / "rank0" / "step0.h5"
    damage.flip(target, damage.hdf5_regions(target)["data:tensors"], count=64)
    argv = DUMP_COMMANDS[command](good, bad)
    code, text = _run_cli(argv, capsys)
    assert "Traceback" not in text
    if command.startswith("diff"):
        assert code != 0, text


PROFILE_CASES = damage.truncations() + [f"flip@{r}" for r in ("head", "middle", "tail")]


@pytest.mark.parametrize("case", PROFILE_CASES)
@pytest.mark.parametrize("name", ["window0.json", "window0.trace.json.gz"])
def test_damaged_profile(runs, name, case, capsys):
    _, bad = runs
    target = bad / "profile" / "rank0" / name
    _damage(target, case)
    before = damage.fingerprint(bad)
    argv = ["profile", str(bad)]
    code, text = _run_cli(argv, capsys)
    _assert_named_refusal(code, text, target, argv)
    assert damage.fingerprint(bad) == before


@pytest.mark.parametrize("case", damage.truncations() + ["flip@superblock", "flip@root_header"])
def test_damaged_summary(runs, case):
    import profiler

    _, bad = runs
    target = bad / "summary" / "rank0.h5"
    _damage(target, case)
    try:
        profiler.read_scalars(bad)
    except profiler.ProfilerError as e:
        assert target.name in str(e), str(e)
    else:
        pytest.fail(f"read_scalars read a damaged {target} without a word")


# the last byte of an IR file is its final newline: without it the text is still whole
IR_CASES = [c for c in damage.truncations() if c != "truncate@-1B"] + [
    f"flip@{r}" for r in ("head", "middle")]


@pytest.mark.parametrize("case", IR_CASES)
def test_damaged_ir(runs, case):
    import irdump

    _, bad = runs
    target = sorted((bad / "ir").glob("*_forward_eager.ir"))[0]
    _damage(target, case)
    try:
        df = irdump.read_ir(target)
    except irdump.IrDumpError as e:
        assert target.name in str(e), str(e)
    else:
        # a cut that falls on a line boundary can leave a shorter graph that parses: then the
        # reader must say the graph is incomplete, not return it as whole
        pytest.fail(f"read_ir returned {len(df)} nodes from a damaged {target.name}")


CKPT_CASES = [c for c in damage.truncations()] + ["flip@head", "flip@middle"]


@pytest.mark.parametrize("case", CKPT_CASES)
@pytest.mark.parametrize("name", ["model.pt", "trainer.pt"])
def test_damaged_checkpoint_resume(runs, name, case, capsys):
    _, bad = runs
    target = bad / "checkpoints" / "step3" / name
    _damage(target, case)
    argv = ["train", "--preset", "tiny", "--set", "steps=4", "--run-dir", str(bad),
            "--resume", "latest"]
    code, text = _run_cli(argv, capsys)
    _assert_named_refusal(code, text, target, argv)


# -- forged files: claims checked against what the file holds -----------------------------------
FORGED_COMMANDS = {
    "diff-good-bad": lambda g, b, out: ["diff", str(g), str(b)],
    "check": lambda g, b, out: ["check", str(b)],
    "dump-ls": lambda g, b, out: ["dump", "ls", str(b)],
    "dump-show": lambda g, b, out: ["dump", "show", str(b), "--step", "0"],
    "dump-export": lambda g, b, out: ["dump", "export", str(b), "--out", str(out)],
}


def _assert_one_line_refusal(code: int, text: str, target: Path, argv: list[str]) -> None:
    assert "Traceback" not in text, text
    assert code == 2, f"sleuth {' '.join(argv)} exited {code}:\n{text}"
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"more than one line:\n{text}"
    assert str(target) in lines[0] and "refused" in lines[0], lines[0]


@pytest.mark.parametrize("command", sorted(FORGED_COMMANDS))
@pytest.mark.parametrize("case", sorted(damage.FORGERIES))
def test_forged_step_file(runs, tmp_path, case, command, capsys):
    """A step file that claims more than it stores (10^10 rows, 4 TB of tensor bytes) or whose
    data lies in another file (external or soft link out, external storage, a virtual
    dataset) is refused where it is opened: exit 2, one line naming it, nothing read from the
    other file, nothing written."""
    good, bad = runs
    target = bad / "dump" / "rank0" / "step0.h5"
    damage.forge(target, case, good / "dump" / "rank0" / "step1.h5")
    out = tmp_path / "export.parquet"
    before = damage.fingerprint(good, bad)
    argv = FORGED_COMMANDS[command](good, bad, out)
    code, text = _run_cli(argv, capsys)
    _assert_one_line_refusal(code, text, target, argv)
    assert damage.fingerprint(good, bad) == before, "a reading command changed files"
    assert not out.exists() and not list(tmp_path.glob(".export.parquet*"))


@pytest.mark.parametrize("command", ["check", "dump-ls", "diff-good-bad"])
def test_config_attribute_too_deep(runs, command, capsys):
    """A step file's config attribute nested 200k deep overflowed the JSON parser
    (RecursionError); it is read within the depth limit: exit 2, one line naming the file."""
    good, bad = runs
    target = bad / "dump" / "rank0" / "step0.h5"
    damage.deep_config(target)
    before = damage.fingerprint(good, bad)
    argv = DUMP_COMMANDS[command](good, bad)
    code, text = _run_cli(argv, capsys)
    assert "Traceback" not in text, text
    assert code == 2 and len(text.strip().splitlines()) == 1, text
    assert str(target) in text and "deeper than 64 levels" in text, text
    assert damage.fingerprint(good, bad) == before


@pytest.mark.slow
def test_stored_pattern_that_backtracks_is_time_bound(runs):
    """A dump config's `nan_allow` regular expression that backtracks for hours: `check` stops
    it after the time bound, exit 2, one line naming the step file. Run as a real process with
    a timeout, so that a hang fails the test instead of stalling the suite."""
    import os
    import subprocess
    import sys

    _, bad = runs
    target = bad / "dump" / "rank0" / "step0.h5"
    damage.stored_pattern(target)
    before = damage.fingerprint(bad)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    try:
        done = subprocess.run([sys.executable, "-m", "sleuth", "check", str(bad)], cwd=root,
                              env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("sleuth check ran a stored regular expression without a time bound")
    text = done.stdout + done.stderr
    assert "Traceback" not in text, text
    assert done.returncode == 2 and len(text.strip().splitlines()) == 1, text
    assert str(target) in text and "did not finish" in text, text
    assert damage.fingerprint(bad) == before


def test_partial_file_that_is_no_step_is_not_counted(runs, capsys):
    """`flight_recorder.h5.partial` (left by a disk that filled while the flight recorder wrote)
    is not a step file: `dump ls` and `check` neither list nor count it."""
    _, bad = runs
    leftover = bad / "dump" / "rank0" / "flight_recorder.h5.partial"
    leftover.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(4096))
    code, text = _run_cli(["dump", "ls", str(bad)], capsys)
    assert code == 0 and "2 step file(s)" in text and leftover.name not in text, text
    code, text = _run_cli(["check", str(bad)], capsys)
    assert code == 0 and leftover.name not in text, text


@pytest.mark.parametrize("link", ["itself", "loop", "nowhere"])
@pytest.mark.parametrize("command", ["dump-ls", "dump-show", "check", "dump-show-file"])
def test_step_file_that_is_a_looping_or_dangling_soft_link(runs, link, command, capsys):
    """A step file that is a soft link to itself, a loop of two, or a link to nothing: one line
    naming the file and the problem (no HDF5 error text), exit 2; the other steps are still
    listed (`dump ls`) and checked (`check`)."""
    good, bad = runs
    rank = bad / "dump" / "rank0"
    target = rank / "step5.h5"
    if link == "itself":
        target.symlink_to("step5.h5")
    elif link == "loop":
        target.symlink_to("step6.h5")
        (rank / "step6.h5").symlink_to("step5.h5")
    else:
        target.symlink_to(bad / "no-such-file.h5")
    before = damage.fingerprint(good, bad)
    argv = {"dump-ls": ["dump", "ls", str(bad)],
            "dump-show": ["dump", "show", str(bad), "--step", "5"],
            "dump-show-file": ["dump", "show", str(target)],
            "check": ["check", str(bad)]}[command]
    code, text = _run_cli(argv, capsys)
    assert "Traceback" not in text and code == 2, text
    assert "errno" not in text.lower() and "Unable to synchronously" not in text, text
    problem = "a soft link to nothing" if link == "nowhere" else "a soft link that loops"
    named = [line for line in text.splitlines() if str(target) in line]
    assert len(named) == 1 and problem in named[0], text
    if command == "dump-ls":  # the two real steps are listed beside it
        assert "4 step file(s)" in text or "3 step file(s)" in text, text
        assert "complete" in text
    assert damage.fingerprint(good, bad) == before
