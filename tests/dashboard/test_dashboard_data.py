"""Data adapters: metrics.jsonl read incrementally as a run trains, summary scalars merged, and
clear empty states for missing data or a missing reader."""
from __future__ import annotations

import json
import math

import pytest

from dashboard_helpers import write_run
from dashboard import _cache, _data


def test_metrics_series_and_incremental_tail(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    path = run / "metrics.jsonl"
    path.write_text(json.dumps({"format_version": "1.0", "kind": "sleuth.trainer.metrics"}) + "\n"
                    + "".join(json.dumps({"step": s, "loss": 1.0 / (s + 1), "lr": 0.1, "step_time_s": 0.5})
                              + "\n" for s in range(3)))
    s = _data.scalars(run)
    assert set(s) >= {"loss", "lr", "step_time_s"}
    assert list(s["loss"]["step"]) == [0, 1, 2]  # the header line is not a data row
    assert list(s["loss"]["wall_time"]) == [0.5, 1.0, 1.5]  # no wall clock: cumulative step time
    with open(path, "a") as f:  # a NaN loss and a half-written line, as a crashing run leaves them
        f.write(json.dumps({"step": 3, "loss": float("nan"), "lr": 0.1, "step_time_s": 0.5}) + "\n")
        f.write('{"step": 4, "lo')
    s = _data.scalars(run)
    assert list(s["loss"]["step"]) == [0, 1, 2, 3] and math.isnan(s["loss"]["value"].iloc[-1])
    with open(path, "a") as f:
        f.write('ss": 0.2, "lr": 0.1, "step_time_s": 0.5}\n')
    assert list(_data.scalars(run)["loss"]["step"]) == [0, 1, 2, 3, 4]


def test_summary_scalars_are_merged(tmp_path):
    profiler = pytest.importorskip("profiler")
    run = write_run(tmp_path / "r", name="r", steps=5)
    w = profiler.SummaryWriter(run, rank=0)
    for step in range(5):
        w.add_scalar("loss", 2.0, step)
        w.add_scalar("weights/norm", 1.0 + step, step)
    w.close()
    s = _data.scalars(run)
    assert "summary/loss" in s and "loss" in s  # a clash keeps both
    assert list(s["weights/norm"]["value"]) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("reader, args, message", [
    (_data.histograms, (), "no summary histograms: run with --summary"),
    (_data.profile, (), "no profile: run with --profile"),
    (_data.dump, (), "no tensor dump: run with --dump"),
    (_data.graphs, (), "no IR graphs: run with --save-graphs"),
])
def test_empty_states_say_how_to_get_the_data(tmp_path, reader, args, message):
    run = write_run(tmp_path / "r", name="r", steps=2)
    with pytest.raises(_data.NoData, match=message):
        reader(run, *args)


def test_missing_reader_is_an_empty_state(tmp_path, monkeypatch):
    run = write_run(tmp_path / "r", name="r", steps=2)
    (run / "profile" / "rank0").mkdir(parents=True)
    (run / "profile" / "rank0" / "x").write_text("")
    import importlib

    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "profiler":
            raise ImportError("No module named 'profiler'")
        return real(name, *a, **k)

    monkeypatch.setattr(_cache.importlib, "import_module", fake)
    with pytest.raises(_data.NoData, match="needs `profiler.read_profile`"):
        _data.profile(run)


def test_eval_lines_do_not_punch_holes(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    lines = [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 2.5}, {"step": 1, "eval_loss": 2.7},
             {"step": 2, "loss": 2.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = _data.scalars(run)
    assert list(s["loss"]["value"]) == [3.0, 2.5, 2.0]
    assert list(s["eval_loss"]["step"]) == [1]
    with open(run / "metrics.jsonl", "a") as f:  # NaN literals take the lenient parser
        f.write(json.dumps({"step": 3, "loss": float("nan")}) + "\n")
        f.write(json.dumps({"step": 3, "eval_loss": 2.1}) + "\n")
    s = _data.scalars(run)
    assert list(s["loss"]["step"]) == [0, 1, 2, 3] and math.isnan(s["loss"]["value"].iloc[-1])
    assert list(s["eval_loss"]["value"]) == [2.7, 2.1]


def test_other_ranks_metrics(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    (run / "metrics.rank1.jsonl").write_text(json.dumps({"step": 0, "loss": 1.5}) + "\n")
    s = _data.scalars(run)
    assert list(s["loss"]["value"]) == [1.0] and list(s["loss [rank 1]"]["value"]) == [1.5]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the dump reader warns about the file it skips
def test_corrupt_files_become_empty_states(tmp_path):
    pytest.importorskip("profiler")
    pytest.importorskip("tracer")
    run = write_run(tmp_path / "r", name="r", steps=2)
    (run / "profile" / "rank0").mkdir(parents=True)
    (run / "profile" / "rank0" / "window0.json").write_text("{not json")
    (run / "profile" / "rank0" / "window0.trace.json").write_text("{not json")
    (run / "dump" / "rank0").mkdir(parents=True)
    (run / "dump" / "rank0" / "step0.h5").write_bytes(b"not hdf5")
    with pytest.raises(_data.NoData, match="could not read the profile"):
        _data.profile(run)
    with pytest.raises(_data.NoData):
        _data.dump_stats(run, 0, 0)


def test_runs_are_labelled_by_folder_not_by_preset(tmp_path):
    """Two runs of the tiny preset were labelled "tiny" and "tiny (2)": the folder tells them
    apart, the preset is a detail on the Runs page."""
    import dashboard
    from dashboard._runs import load_runs
    from dashboard_helpers import runs_page

    a = write_run(tmp_path / "runs" / "a", name="tiny", steps=3)
    b = write_run(tmp_path / "runs" / "b", name="tiny", steps=3)
    assert [r.label for r in load_runs([a, b])] == ["a", "b"]
    deep = [write_run(tmp_path / p / "seed0", name="tiny", steps=2) for p in ("x", "y")]
    assert [r.label for r in load_runs(deep)] == ["x/seed0", "y/seed0"]
    assert [r.label for r in load_runs([a])] == ["a"]
    assert [r.label for r in load_runs([a, a])] == ["a", "a (2)"]
    client = dashboard.create_app([a, b], refresh_s=0).server.test_client()
    status, page = runs_page(client)
    assert status == 200 and '"children": "a"' in page and '"children": "b"' in page
    assert '"children": "tiny"' in page and "tiny (2)" not in page
