"""`sleuth profile RUN`: tables, --json, --csv and errors."""
from __future__ import annotations

import json

import pytest

from profiler import Collector, CollectorConfig
from profiler_testkit import train
from sleuth.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("cli_run")
    cfg = CollectorConfig(wait=0, warmup=1, active=2, activities=("cpu",), count_flops=False,
                          tokens_per_step=64)
    with Collector(run, config=cfg) as c:
        train(3, c)
    return run


def test_profile_prints_tables(run, capsys):
    assert main(["profile", str(run), "--top", "4"]) == 0
    out = capsys.readouterr().out
    for text in ("step breakdown", "forward_us", "top 4 ops", "aten::", "top 4 modules",
                 "<root>", "window0.trace.json.gz", "tokens/s"):
        assert text in out, text
    assert "ranks:" not in out  # one rank: no cluster table


def test_profile_json_and_csv(run, tmp_path, capsys):
    assert main(["profile", str(run), "--json", "--top", "3", "--csv", str(tmp_path / "csv")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["steps"] == 2 and data["summary"]["mfu"] is None  # no FLOP count
    assert len(data["top_ops"]) == 3 and len(data["top_modules"]) == 3
    assert data["steps"][0]["step_us"] > 0 and len(data["cluster"]) == 1
    for name in ("ops", "modules", "steps", "memory", "cluster"):
        assert (tmp_path / "csv" / f"{name}.csv").stat().st_size > 0


def test_profile_errors(tmp_path, capsys):
    assert main(["profile", str(tmp_path)]) == 2
    assert "no profile in" in capsys.readouterr().err
    assert main(["profile", str(tmp_path), "--top", "0"]) == 2


def test_csv_into_a_file_names_the_folder_it_takes(run, tmp_path, capsys):
    taken = tmp_path / "tables.csv"
    taken.write_text("mine")
    for argv in (["profile", str(run)], ["profile", "diff", str(run), str(run)]):
        assert main([*argv, "--csv", str(taken)]) == 2
        err = capsys.readouterr().err
        assert "that is a file; --csv takes a folder" in err and "File exists" not in err, err
    assert taken.read_text() == "mine"


def test_profile_subprocess(run, sleuth_cli):
    r = sleuth_cli("profile", str(run), "--top", "2")
    assert r.returncode == 0, r.stderr
    assert "top 2 modules" in r.stdout
