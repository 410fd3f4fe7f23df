"""`sleuth run --dump CONFIG` / `--profile CONFIG` check the config before the child starts: a
bad one is one line and exit 2, with or without --strict, and the script never runs."""
from __future__ import annotations

import pytest

_CASES = {
    "dump_unknown_key": ("--dump", '{"levle": "op"}', "unknown key 'levle'; did you mean 'level'?"),
    "dump_duplicate": ("--dump", '{"mode": "tensor", "mode": "full"}', "key 'mode' appears twice"),
    "dump_absurd": ("--dump", '{"async_max_queued_mb": 1000000000000}',
                    "async_max_queued_mb: 1000000000000 is out of range"),
    "dump_nan_watch": ("--dump", '{"watch": [{"condition": "max_abs_gt", "threshold": NaN}]}',
                       "NaN is not a number"),
    "dump_syntax": ("--dump", '{"level": ', "invalid JSON"),
    "profile_bad": ("--profile", '{"active": 0}', "active must be a finite number from 1"),
    "profile_duplicate": ("--profile", '{"wait": 1, "wait": 2}', "key 'wait' appears twice"),
}


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_bad_config_stops_before_the_child(tmp_path, sleuth_cli, case, strict):
    flag, text, message = _CASES[case]
    config = tmp_path / "config.json"
    config.write_text(text)
    run = tmp_path / "run"
    args = ["run", "--run-dir", str(run), flag, str(config), *(["--strict"] if strict else []),
            "--", "python", "-c", "print('the child ran')"]
    r = sleuth_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "the child ran" not in r.stdout
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr and str(config) in r.stderr
    assert not run.exists()


def test_a_good_config_runs_the_child(tmp_path, sleuth_cli):
    config = tmp_path / "dump.json"
    config.write_text('{"level": "module", "steps": "0"}')
    r = sleuth_cli("run", "--run-dir", str(tmp_path / "run"), "--dump", str(config), "--",
                   "python", "-c", "print('the child ran')")
    assert r.returncode == 0 and "the child ran" in r.stdout, r.stderr


# -- config files that are not regular files: refused in one line, never read --------------------

def _fifo(tmp_path):
    import os

    path = tmp_path / "config.fifo"
    os.mkfifo(path)
    return path


_NON_REGULAR = {
    "train_config": ("train", "--config"),
    "train_dump": ("train", "--dump"),
    "train_profile": ("train", "--profile"),
    "run_dump": ("run", "--dump"),
    "run_profile": ("run", "--profile"),
    "check_watch": ("check", "--watch"),
    "diff_map": ("diff", "--map"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder"])
@pytest.mark.parametrize("case", sorted(_NON_REGULAR))
def test_a_config_that_is_not_a_regular_file_is_refused(tmp_path, sleuth_cli, case, kind):
    """`--config /dev/zero` read until MemoryError and `--config FIFO` blocked forever."""
    command, flag = _NON_REGULAR[case]
    path = {"fifo": _fifo, "dev_zero": lambda _: "/dev/zero", "folder": lambda t: t}[kind](tmp_path)
    run = tmp_path / "run"
    rest = {"train": ["--run-dir", str(run), "--set", "steps=1"],
            "run": ["--run-dir", str(run), "--", "python", "-c", "print('the child ran')"],
            "check": [str(run)], "diff": [str(run), str(run)]}[command]
    r = sleuth_cli(command, flag, str(path), *rest, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "not a regular file" in r.stderr and str(path) in r.stderr, r.stderr
    assert "the child ran" not in r.stdout and not (run / "metrics.jsonl").exists()


# -- inline JSON wherever SLEUTH_DUMP_CONFIG takes it -------------------------------------------

_STEPS = ("import torch\nm = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(m.parameters(), 0.1)\n"
          "for _ in range(3):\n    m(torch.ones(1, 2)).sum().backward(); opt.step()\n")


@pytest.mark.slow
def test_run_dump_takes_inline_json(tmp_path, sleuth_cli):
    script = tmp_path / "loop.py"
    script.write_text(_STEPS)
    run = tmp_path / "run"
    r = sleuth_cli("run", "--run-dir", str(run), "--dump", '{"steps": "1", "level": "module"}',
                   "--", "python", str(script))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (run / "dump" / "rank0").glob("step*.h5")) == ["step1.h5"]


@pytest.mark.slow
def test_train_dump_takes_inline_json(tmp_path, sleuth_cli):
    run = tmp_path / "run"
    r = sleuth_cli("train", "--run-dir", str(run), "--set", "steps=2", "--dump",
                   '{"steps": "0", "level": "module"}')
    assert r.returncode == 0, r.stderr
    assert [p.name for p in (run / "dump" / "rank0").glob("step*.h5")] == ["step0.h5"]


def test_bad_inline_json_is_one_line(tmp_path, sleuth_cli):
    r = sleuth_cli("run", "--run-dir", str(tmp_path / "run"), "--dump", '{"levle": "op"}',
                   "--", "python", "-c", "print('the child ran')")
    assert r.returncode == 2 and "the child ran" not in r.stdout
    assert r.stderr.strip() == ("sleuth run: error: --dump: inline JSON: unknown key 'levle'; "
                                "did you mean 'level'? (valid keys: "
                                + r.stderr.split("(valid keys: ", 1)[1].strip())


def test_reference_without_a_dump_is_one_line_before_the_child(tmp_path, capsys):
    from sleuth._cmd_run import child_env
    from sleuth.cli import build_parser, main

    run = tmp_path / "run"
    assert main(["run", "--run-dir", str(run), "--reference", str(tmp_path), "--", "python",
                 "-c", "print('the child ran')"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--reference compares the run's dump" in err
    assert not run.exists()
    args = build_parser().parse_args(["run", "--dump", "{}", "--reference", "ref",
                                      "--on-divergence", "stop", "--", "true"])
    env = child_env(args, base={})
    assert env["SLEUTH_REFERENCE"].endswith("ref") and \
        env["SLEUTH_REFERENCE_ON_DIVERGENCE"] == "stop"
