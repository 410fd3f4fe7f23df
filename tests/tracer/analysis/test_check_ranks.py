"""`sleuth check` over every rank as one task per rank (this process, a local pool, a real Dask
cluster): the same hits and the same first NaN as one check over the whole dump."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import tracer
from sleuth.cli import main
from tracer._config import DumpConfig
from tracer.analysis import check, check_ranks
from tracer.storage import RecordMeta, make_writer


def write_run(root: Path, ranks: int, steps=(1, 2, 3), put: dict | None = None) -> Path:
    """A statistics dump; `put` maps (rank, step, layer) to a value that record holds (NaN
    for a NaN made there, 1e6 for a watchpoint hit)."""
    put = put or {}
    for rank in range(ranks):
        w = make_writer(DumpConfig(path=str(root), writer="sync"), rank=rank, world_size=ranks)
        for step in steps:
            w.begin_step(step)
            carry = None
            for i in range(4):
                value = put.get((rank, step, i), carry if carry is not None and
                                math.isnan(carry) else float(i + step))
                carry = value
                w.add(RecordMeta(f"layers.{i}.forward.0.output.0", f"layers.{i}", "", "forward",
                                 "output", 0, 0, f"model.py:{10 + i}"),
                      torch.full((4, 4), value))
            w.end_step()
        w.close()
    return root


@pytest.fixture
def run(tmp_path: Path) -> Path:
    # a NaN made on rank 3 at step 2, layer 2, and on rank 1 only at step 3; a large value
    # on rank 0 at step 1
    return write_run(tmp_path / "run", 4, put={(3, 2, 2): math.nan, (1, 3, 0): math.nan,
                                               (0, 1, 1): 1e6})


def _same(df, whole):
    assert df.to_dict("records") == whole.to_dict("records")
    assert df.attrs["first_nan"] == whole.attrs["first_nan"]
    assert df.attrs["coverage"] == whole.attrs["coverage"]


def test_each_engine_says_what_one_check_says(run):
    watch = [{"condition": "nan_inf"}, {"condition": "max_abs_gt", "threshold": 1e4}]
    whole = check(run, watch=watch)
    origin = whole.attrs["first_nan"]
    assert (origin["rank"], origin["step"], origin["name"]) == (
        3, 2, "layers.2.forward.0.output.0")
    assert sorted(set(zip(whole["rank"], whole["condition"]))) == [
        (0, "max_abs_gt"), (1, "nan_inf"), (3, "nan_inf")]
    one = check_ranks(run, watch=watch, workers=1)
    assert one.attrs["engine"] == "in-process" and one.attrs["ranks"] == [0, 1, 2, 3]
    _same(one, whole)
    pool = check_ranks(run, watch=watch, workers=2)
    assert pool.attrs["engine"] == "local (2 processes)"
    _same(pool, whole)


@pytest.mark.slow
def test_on_a_real_dask_cluster(run):
    distributed = pytest.importorskip("distributed")
    watch = [{"condition": "nan_inf"}]
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        on_dask = check_ranks(run, watch=watch, scheduler=cluster.scheduler_address)
    assert on_dask.attrs["engine"].startswith("dask tcp://127.0.0.1:")
    _same(on_dask, check(run, watch=watch))


def test_cli_checks_every_rank_as_tasks(run, capsys):
    assert main(["check", str(run), "--first-nan", "--json", "--workers", "2"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "local (2 processes)" and out["read"] == 12
    assert (out["first_nan"]["rank"], out["first_nan"]["step"]) == (3, 2)
    assert main(["check", str(run), "--workers", "1"]) == 1
    text = capsys.readouterr().out
    assert "first NaN: layers.2.forward.0.output.0" in text and "rank 3" in text
    assert "watchpoint hits" in text
    assert main(["check", str(run), "--workers", "0"]) == 2
    assert "--workers 0: give 1 or more" in capsys.readouterr().err


def test_a_damaged_rank_is_named_never_clean(run, capsys):
    from tests.tracer.storage.test_dump_cli import damage_records

    clean = write_run(run.parent / "clean", 3)
    assert main(["check", str(clean), "--workers", "2"]) == 0
    capsys.readouterr()
    damage_records(next((clean / "dump" / "rank1").glob("step2*.h5")))
    assert main(["check", str(clean), "--workers", "2", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "incomplete" and out["read"] == 8
    assert [(u["rank"], u["step"]) for u in out["unread"]] == [(1, 2)]


def test_unknown_rank_is_a_clear_error(run):
    with pytest.raises(tracer.TracerError, match=r"no rank 9 in the dump .*ranks: 0, 1, 2, 3"):
        check_ranks(run, ranks=[9])


@pytest.mark.slow
def test_python_runs_the_ranks_here_unless_asked_and_the_command_line_per_core(run, capsys):
    """From Python a pool is never started unasked (it would import the caller's script
    again); `workers=0` and the command line take one process per core."""
    import os

    assert check_ranks(run).attrs["engine"] == "in-process"
    assert tracer.diff_ranks(run, run).engine == "in-process"
    cores = min(os.cpu_count() or 1, 4)
    want = "in-process" if cores == 1 else f"local ({cores} processes)"
    assert check_ranks(run, workers=0).attrs["engine"] == want
    assert main(["check", str(run), "--first-nan", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["engine"] == want
    assert main(["diff", str(run), str(run), "--workers", "-1"]) == 2
    assert "--workers -1: give 1 or more" in capsys.readouterr().err


UNGUARDED = """
import sys
from tracer.analysis import check_ranks
print("script body ran", flush=True)
check_ranks(sys.argv[1], workers=2)
"""


@pytest.mark.slow
def test_a_pool_started_from_an_unguarded_script_says_how_to_fix_it(run, tmp_path):
    """A script that starts a pool at import time, without `if __name__ == "__main__":`:
    the pool's processes import it again and cannot start one of their own. The call ends with
    an error that names the guard, never a hang or a bare BrokenProcessPool."""
    import os
    import subprocess
    import sys

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: no pool")
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    res = subprocess.run([sys.executable, str(script), str(run)], capture_output=True,
                         text=True, env=env, timeout=180)
    assert res.returncode == 1
    assert "TracerError" in res.stderr and 'if __name__ == "__main__":' in res.stderr
    assert "workers=1" in res.stderr


def test_the_first_nan_command_headroom_suggests_keeps_the_rank(tmp_path, capsys):
    """`check --headroom RUN --rank 1` on a rank with non-finite records points to
    `check --first-nan` for that same rank, and that command, run as printed, finds it."""
    import shlex

    run = write_run(tmp_path / "run", 2, put={(1, 2, 1): math.inf})
    main(["check", "--headroom", str(run), "--rank", "1"])
    out = capsys.readouterr().out
    command = out.split("where the first came from: ", 1)[1].splitlines()[0]
    assert command.endswith("--rank 1"), command
    words = shlex.split(command)
    assert words[:2] == ["sleuth", "check"]
    assert main(words[1:]) == 1
    assert "first +Inf: layers.1.forward.0.output.0 (module layers.1, forward, step 2, " \
           "rank 1)" in capsys.readouterr().out
