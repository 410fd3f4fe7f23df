"""The CLI's top-level handling: bad input is one line and exit 2, never a traceback; --debug
and SLEUTH_DEBUG=1 show the traceback; a closed stdout pipe ends quietly."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch

from sleuth.cli import main
from tracer._config import DumpConfig
from tracer.storage import RecordMeta, make_writer

REPO = Path(__file__).resolve().parents[2]


def write_dump(run, records: int = 1) -> None:
    """One statistics step of `records` module records, through the tracer's own writer."""
    w = make_writer(DumpConfig(path=str(run), writer="sync", mode="statistics"), rank=0,
                    world_size=1)
    w.begin_step(0)
    for i in range(records):
        w.add(RecordMeta(f"layer{i}.forward.0.output.0", f"layer{i}", "", "forward", "output", 0,
                         0, "m.py:1"), torch.ones(2))
    w.end_step()
    w.close()


@pytest.fixture
def damaged_run(tmp_path):
    """A run whose only step file has a /records table that is a group, not a table."""
    write_dump(tmp_path)
    with h5py.File(tmp_path / "dump" / "rank0" / "step0.h5", "r+") as f:
        del f["records"]
        f.create_group("records")
    return tmp_path


def test_bad_input_is_one_line_without_traceback(damaged_run, sleuth_cli):
    r = sleuth_cli("dump", "show", str(damaged_run))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "step0.h5" in r.stderr and "damaged" in r.stderr


def test_debug_flag_and_env_show_the_traceback(damaged_run, sleuth_cli):
    with pytest.raises(Exception, match="damaged"):
        main(["--debug", "dump", "show", str(damaged_run)])
    r = sleuth_cli("dump", "show", str(damaged_run), env={"SLEUTH_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr and "DumpFormatError" in r.stderr


def test_os_error_on_a_user_path_is_one_line(tmp_path, capsys):
    write_dump(tmp_path)
    target = tmp_path / "no" / "such" / "dir" / "out.csv"
    assert main(["dump", "show", str(tmp_path), "--csv", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sleuth dump: error: ") and "Traceback" not in err


def test_unknown_errors_keep_their_traceback(monkeypatch):
    import sleuth._cmd_dump as cmd

    def bug(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cmd, "_show", bug)
    with pytest.raises(ZeroDivisionError):
        main(["dump", "show", "anything"])


@pytest.mark.parametrize("args", [["--help"], ["dump", "show", "RUN"]])
def test_closed_stdout_pipe_ends_quietly(tmp_path, args):
    run = tmp_path / "ok"
    write_dump(run, records=2000)  # more than a pipe buffer of table rows
    args = [str(run) if a == "RUN" else a for a in args]
    # `sleuth ... | head -1`: the reader takes one line and goes away
    p = subprocess.Popen([sys.executable, "-m", "sleuth", *args], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    code = p.wait(timeout=300)
    assert first
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == "", err
    assert code in (0, 141)


# -- argparse: no abbreviations, "did you mean", one line ----------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["dif"], "sleuth: error: argument COMMAND: invalid choice 'dif'; did you mean 'diff'?"),
    (["check", "RUN", "--ste", "2"], "sleuth check: error: unrecognized option --ste; did you "
                                     "mean --step?"),
    (["check", "RUN", "--stpe", "2"], "sleuth check: error: unrecognized option --stpe; did you "
                                      "mean --step?"),
    (["diff", "A", "B", "--cosine", "0.9"], "sleuth diff: error: unrecognized option --cosine; "
                                            "did you mean --cosine-min?"),
    (["dump", "lss", "RUN"], "sleuth dump: error: argument ACTION: invalid choice 'lss'; did you "
                             "mean 'ls'?"),
    (["diff", "A", "B", "--thresold", "1"], "sleuth diff: error: unrecognized option --thresold "),
    (["profile", "dif", "A", "B"], "sleuth profile: error: unknown subcommand 'dif'; did you mean "
                                   "'diff'?"),
])
def test_typos_are_one_line_with_a_suggestion(sleuth_cli, args, expected):
    """`--ste 2` was silently `--step 2`; `sleuth dif` listed the commands with no hint."""
    r = sleuth_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(expected), r.stderr


def test_every_parser_refuses_abbreviations():
    from sleuth.cli import build_parser

    def walk(parser):
        yield parser
        for action in parser._actions:
            for sub in getattr(action, "choices", None) or {}:
                if isinstance(action.choices, dict):
                    yield from walk(action.choices[sub])

    parsers = list(walk(build_parser()))
    assert len(parsers) > 15
    assert [p.prog for p in parsers if p.allow_abbrev] == []


@pytest.mark.slow
def test_python_m_trainer_refuses_abbreviations(tmp_path):
    r = subprocess.run([sys.executable, "-m", "trainer", "--res", "latest", "--run-dir",
                        str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "unrecognized arguments: --res" in r.stderr, r.stderr
