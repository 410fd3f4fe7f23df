"""The collector on real profiled runs of a tiny GPT-like model (CPU), and the tables read back."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

import profiler
from profiler import Collector, CollectorConfig
from profiler_testkit import train

CFG = dict(wait=0, warmup=1, active=2, repeat=1, activities=("cpu",), tokens_per_step=64)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    run = tmp_path_factory.mktemp("labelled")
    with Collector(run, config=CollectorConfig(**CFG), rank=0) as c:
        train(4, c, labels=True)
    return run, c, profiler.read_profile(run)


def test_trace_is_valid_chrome_json(labelled):
    run, c, prof = labelled
    d = run / "profile" / "rank0"
    assert c.traces == [d / "window0.trace.json.gz"] == prof.traces
    with gzip.open(c.traces[0], "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ProfilerStep#1", "ProfilerStep#2", "sleuth.forward"} <= names
    meta = json.loads((d / "window0.json").read_text())
    assert meta["format_version"] == "1.0" and meta["steps"] == [1, 2]
    assert meta["flops_per_step"] > 0 and meta["flop_counts"]["aten.mm"] > 0
    assert not list(d.glob("*.partial")) and not list(d.glob(".*tmp"))


def test_module_table_has_model_names(labelled):
    mods = labelled[2].modules.set_index("module")
    for name in ("<root>", "emb", "blocks.0", "blocks.0.attn", "blocks.1.mlp.0", "head"):
        assert name in mods.index, name
    assert mods.loc["<root>", "type"] == "TinyGPT" and mods.loc["blocks.1.mlp.0", "type"] == "Linear"
    assert (mods["calls"] == 2).all()  # one call per recorded step
    assert (mods["forward_self_us"] <= mods["forward_total_us"] + 1e-6).all()
    assert mods.loc["head", "backward_self_us"] > 0
    assert mods.loc["blocks.0", "backward_total_us"] >= mods.loc["blocks.0.attn", "backward_total_us"] > 0


def test_step_breakdown_sums_to_step_time(labelled):
    steps = labelled[2].steps
    assert list(steps["step"]) == [1, 2] and (steps["source"] == "labels").all()
    parts = steps[["data_us", "forward_us", "backward_us", "optimizer_us", "other_us"]].sum(axis=1)
    assert ((parts - steps["step_us"]).abs() <= 0.01 * steps["step_us"]).all()
    assert (steps[["data_us", "forward_us", "backward_us", "optimizer_us"]] > 0).all().all()


def test_ops_summary_and_memory(labelled):
    _, c, prof = labelled
    ops = prof.ops
    mm = ops[ops["name"] == "aten::mm"]
    assert not mm.empty and (mm["input_shapes"] != "").all() and mm["flops"].sum() > 0
    assert (ops["cpu_self_us"] >= 0).all() and (ops["cpu_self_us"] <= ops["cpu_total_us"] + 1e-6).all()
    s = prof.summary
    assert s["step_time_s"] > 0 and s["tokens_per_s"] == pytest.approx(64 / s["step_time_s"])
    assert 0 < s["mfu"] < 1 and s["comm_share"] == 0.0
    assert not prof.memory.empty and (prof.memory["device"] == "cpu").all()
    assert len(prof.cluster) == 1 and prof.cluster["slowest"].all()


def test_export_after_trace_handler(labelled, tmp_path):
    _, c, _ = labelled
    out = c.export_chrome_trace(tmp_path / "copy.json")
    assert "traceEvents" in json.loads(out.read_text())
    with pytest.raises(profiler.ProfilerError, match="no profiled window"):
        Collector(tmp_path, config=CollectorConfig(**CFG)).export_chrome_trace(tmp_path / "x.json")


@pytest.mark.slow
def test_inferred_breakdown_tables_written_and_stacks(tmp_path):
    cfg = CollectorConfig(**{**CFG, "write_tables": True, "with_stack": True, "count_flops": False})
    with Collector(tmp_path, config=cfg) as c:
        train(4, c, labels=False)
    d = tmp_path / "profile" / "rank0"
    for t in ("ops", "modules", "steps", "memory"):
        assert (d / f"window0.{t}.parquet").exists()
    cached = profiler.read_profile(tmp_path)
    for t in ("ops", "modules", "steps", "memory"):
        (d / f"window0.{t}.parquet").unlink()
    built = profiler.read_profile(tmp_path)
    assert cached.ops.equals(built.ops) and cached.modules.equals(built.modules)
    assert "blocks.0.attn" in set(built.modules["module"])
    assert not built.modules["module"].str.contains("_0$").any()  # no with_stack duplicates
    steps = built.steps
    assert (steps["source"] == "inferred").all()
    parts = steps[["data_us", "forward_us", "backward_us", "optimizer_us", "other_us"]].sum(axis=1)
    assert ((parts - steps["step_us"]).abs() <= 0.01 * steps["step_us"]).all()
    assert (steps["backward_us"] > 0).all() and (steps["optimizer_us"] > 0).all()
    # export_stacks may come out empty (pytorch/pytorch#100253): never leave an empty file
    for p in d.glob("*.stacks.txt"):
        assert p.stat().st_size > 0
    assert cached.summary["mfu"] != cached.summary["mfu"]  # NaN: no FLOP count asked for


@pytest.mark.slow
def test_repeating_windows_and_cut_short_window(tmp_path):
    cfg = CollectorConfig(wait=1, warmup=0, active=2, repeat=0, activities=("cpu",),
                          with_modules=False, profile_memory=False)
    with Collector(tmp_path, config=cfg) as c:
        train(8, c, labels=False)  # windows: steps 1-2, 4-5, 7-8 cut short: 8 never ran
    prof = profiler.read_profile(tmp_path)
    assert len(prof.traces) == 3
    assert sorted(prof.steps["step"]) == [1, 2, 4, 5, 7]
    assert prof.modules.empty
    # closing as a window begins (its step never ran) writes no empty window
    run2 = tmp_path / "run2"
    with Collector(run2, config=cfg) as c:
        train(4, c, labels=False)  # step 4 starts window 2 and never runs
    assert len(profiler.read_profile(run2).traces) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_trace_has_device_time(tmp_path):
    from profiler_testkit import TinyGPT
    model = TinyGPT().cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 64, (4, 16), device="cuda")
    with Collector(tmp_path, config=CollectorConfig(wait=0, warmup=1, active=2)) as c:
        for _ in range(4):
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
            c.step()
    prof = profiler.read_profile(tmp_path)
    assert prof.ops["device_us"].sum() > 0
    assert (prof.memory["device"] == "cuda:0").any()
    assert prof.summary["peak_tflops"] > 100


def _full_disk(monkeypatch):
    """A disk that fills while a window is written: every fsync fails as a full disk's does."""
    import errno
    import os

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)


def _profiled_run(run, monkeypatch, *, strict: bool) -> list:
    """Train 4 steps under a collector (one window of steps 1-2); the SleuthWarnings given."""
    import warnings

    from tracer import SleuthWarning

    monkeypatch.setenv("SLEUTH_STRICT", "1" if strict else "0")
    monkeypatch.setenv("SLEUTH_RUN_ID", "this-run")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Collector(run, config=CollectorConfig(**CFG), rank=0) as c:
            model, _ = train(4, c, labels=True)
    assert model is not None  # the run trained to its end
    return [w for w in seen if issubclass(w.category, SleuthWarning)]


def _unwritable(run):
    (run / "profile").parent.mkdir(parents=True, exist_ok=True)
    (run / "profile").write_text("a file where the profile folder goes")


def _another_runs(run):
    d = run / "profile" / "rank0"
    d.mkdir(parents=True)
    (d / "window0.json").write_text(json.dumps({"format_version": "1.0", "run_id": "other"}))


@pytest.mark.parametrize("failure", ["full_disk", "unwritable_folder", "read_only_folder",
                                     "another_runs_folder"])
def test_a_failed_write_turns_the_profiler_off_and_the_run_goes_on(tmp_path, monkeypatch,
                                                                  failure):
    """Profiling never stops the run: a window that cannot be written (a full disk, a folder
    that cannot be made or written, another run's profile there) gives one `sleuth:` warning,
    the profiler goes off, nothing half-written is left, and training ends normally;
    SLEUTH_STRICT=1 raises ProfilerError instead (the tracer's switch, `tracer.strict`)."""
    import os

    run = tmp_path / "run"
    run.mkdir()
    if failure == "full_disk":
        _full_disk(monkeypatch)
    elif failure == "unwritable_folder":
        _unwritable(run)
    elif failure == "read_only_folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        (run / "profile" / "rank0").mkdir(parents=True)
        (run / "profile" / "rank0").chmod(0o555)
    else:
        _another_runs(run)
    before = sorted(p.relative_to(run) for p in run.rglob("*") if p.is_file())
    warned = _profiled_run(run, monkeypatch, strict=False)
    assert len(warned) == 1, [str(w.message) for w in warned]
    text = str(warned[0].message)
    assert text.startswith("the profiler is off from step") and "goes on" in text, text
    assert "SLEUTH_STRICT=1" in text
    if failure == "another_runs_folder":
        assert "another run (run other" in text
    assert sorted(p.relative_to(run) for p in run.rglob("*")
                  if p.is_file()) == before  # nothing written, nothing half-written
    with pytest.raises(profiler.ProfilerError):
        _profiled_run(run, monkeypatch, strict=True)


def test_a_fifo_as_a_windows_metadata_is_passed_over_not_waited_on(tmp_path, monkeypatch,
                                                                    answers_within):
    """The collector reads the run ids of the windows already in its folder before it starts;
    a FIFO named `window0.json` there held it forever in that read. Only regular files are
    read (tracer.storage.open_regular): the FIFO is passed over, and the window of another run
    beside it still refused (which stops the collector before torch's profiler starts)."""
    import os

    from tracer import SleuthWarning

    folder = tmp_path / "profile" / "rank0"
    folder.mkdir(parents=True)
    fifo = folder / "window0.json"
    os.mkfifo(fifo)
    (folder / "window1.json").write_text(json.dumps({"run_id": "another-run"}))
    monkeypatch.setenv("SLEUTH_RUN_ID", "this-run")  # the run whose windows it checks against
    c = Collector(tmp_path, config=CollectorConfig(**CFG), rank=0)
    with pytest.warns(SleuthWarning, match="another run") as caught:
        answered, _ = answers_within(c.start, 30, fifo)
    c.close()
    assert answered, "the collector waited on a FIFO named window0.json"
    assert caught
