"""SummaryWriter: frequency, readers, size cap, and a file that survives SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import profiler
from profiler import SummaryWriter, read_histograms, read_scalars

REPO = Path(__file__).resolve().parents[2]


def test_scalars_histograms_frequency_and_readers(tmp_path):
    with SummaryWriter(tmp_path, rank=1, frequency={"scalar": 2, "histogram": 5}) as w:
        for step in range(10):
            w.add_scalar("loss", 1.0 / (step + 1), step, wall_time=100.0 + step)
            w.add_scalars({"lr": 0.1, "skipped": None}, step)
            w.add_histogram("acts", torch.arange(100, dtype=torch.float32), step, bins=10)
        w.add_histogram("numpy", np.array([1.0, 2.0, np.nan, np.inf]), 0, bins=4)
    assert (tmp_path / "summary" / "rank1.h5").exists()
    df = read_scalars(tmp_path)
    assert list(df.columns) == ["rank", "tag", "step", "wall_time", "value"]
    loss = df[df.tag == "loss"]
    assert list(loss.step) == [0, 2, 4, 6, 8] and (df["rank"] == 1).all()
    assert loss.value.iloc[1] == pytest.approx(1 / 3) and loss.wall_time.iloc[1] == 102.0
    assert set(df.tag) == {"loss", "lr"}
    h = read_histograms(tmp_path, tag="acts")
    assert list(h.step) == [0, 5]
    assert len(h.edges[0]) == 11 and h.counts[0].sum() == 100
    assert h.edges[0][0] == 0 and h.edges[0][-1] == 99
    nh = read_histograms(tmp_path, tag="numpy")
    assert nh.counts[0].sum() == 2  # non-finite values are left out
    assert read_histograms(tmp_path, tag="missing").empty


def test_model_histograms_and_errors(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    w = SummaryWriter(tmp_path)
    w.add_model_histograms(model, 0)
    w.add_model_histograms(model, 3)  # not a multiple of the histogram frequency (10)
    w.close()
    w.close()  # idempotent
    tags = set(read_histograms(tmp_path).tag)
    assert tags == {f"{k}/{n}" for k in ("weights", "grads") for n in
                    ("0.weight", "0.bias", "2.weight", "2.bias")}
    with pytest.raises(profiler.ProfilerError, match="closed"):
        w.add_scalar("x", 1.0, 0)
    with pytest.raises(profiler.ConfigError, match="did you mean 'histogram'"):
        SummaryWriter(tmp_path, frequency={"histogrm": 3})
    # a second writer for the same rank never reopens the file: it starts a segment
    with SummaryWriter(tmp_path) as w2:
        w2.add_scalar("later", 5.0, 20)
    assert (tmp_path / "summary" / "rank0.seg1.h5").exists()
    assert read_scalars(tmp_path).tag.tolist() == ["later"]


def test_size_cap_warns_once_and_stops(tmp_path):
    w = SummaryWriter(tmp_path, max_bytes=256 * 1024, flush_every=10)
    with pytest.warns(profiler.SummaryCapReached, match="max_bytes=262144.*SLEUTH_SUMMARY_MAX_BYTES"):
        for step in range(2000):
            w.add_histogram("big", torch.randn(1000), step * 10, bins=256)
    assert w.stopped
    w.add_scalar("after", 1.0, 0)
    w.close()
    size = os.path.getsize(w.path)
    assert size < 256 * 1024 + 128 * 1024  # stops within a chunk or two of the cap
    h = read_histograms(tmp_path)
    assert 0 < len(h) < 2000 and "after" not in set(read_scalars(tmp_path).tag)


WRITER = textwrap.dedent("""
    import sys, time
    from profiler import SummaryWriter
    w = SummaryWriter(sys.argv[1], flush_every=50)
    step = 0
    while True:
        w.add_scalar("loss", float(step), step)
        if step % 10 == 0:
            w.add_histogram("h", [float(step), step + 1.0, step + 2.0], step, bins=3)
        if step == 500:
            print("ready", flush=True)
        step += 1
""")


def test_summary_survives_sigkill(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for var in ("SLEUTH_PROFILE", "SLEUTH_SUMMARY", "SLEUTH_DUMP_CONFIG"):
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # killed in the middle of writing
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    df = read_scalars(tmp_path / "run")
    assert len(df) >= 500
    steps = df.step.to_numpy()
    assert (steps == np.arange(len(steps))).all() and (df.value == df.step).all()
    h = read_histograms(tmp_path / "run")
    assert len(h) >= 50 and all(c.sum() == 3 for c in h.counts)


_DTENSOR_HISTOGRAM = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from profiler import SummaryWriter

    dist.init_process_group("gloo", rank=0, world_size=1)
    weight = distribute_tensor(torch.arange(12.0).view(3, 4), init_device_mesh("cpu", (1,)),
                               [Shard(0)])
    with SummaryWriter(sys.argv[1]) as w:  # FSDP2's parameters are such DTensors
        w.add_histogram("weights/w", weight, 0, bins=4)
    dist.destroy_process_group()
    # torch's gloo threads abort a rank now and then as the interpreter finalizes
    # (docs/frameworks.md, "An abort at exit"): exit handlers, then no C++ teardown
    import atexit, os, sys; atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch.distributed, "init_process_group"),
                    reason="torch built without distributed")
def test_histogram_of_a_dtensor_is_its_local_shard(tmp_path, free_port):
    """A DTensor's histogram is taken on this rank's shard: boolean indexing of a DTensor has
    no sharding rule, and `--summary` must not stop an FSDP2 run."""
    script = tmp_path / "hist.py"
    script.write_text(_DTENSOR_HISTOGRAM)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, env=env, timeout=120)
    h = read_histograms(tmp_path, tag="weights/w")
    assert h.counts[0].sum() == 12 and h.edges[0][0] == 0 and h.edges[0][-1] == 11


@pytest.mark.parametrize("failure", ["full_disk", "unwritable_folder"])
def test_a_summary_that_cannot_be_written_goes_off_and_the_run_goes_on(tmp_path, monkeypatch,
                                                                      failure):
    """A full disk while the summary flushes, or a folder it cannot make: one `sleuth:`
    warning, later records dropped, no error into the training loop; SLEUTH_STRICT=1 raises
    ProfilerError instead."""
    import errno
    import os
    import warnings

    import h5py

    from profiler import ProfilerError, SummaryWriter
    from tracer import SleuthWarning

    if failure == "unwritable_folder":
        (tmp_path / "summary").write_text("a file where the summary folder goes")
    else:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(h5py.Dataset, "resize", full)

    def log() -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            w = SummaryWriter(tmp_path, rank=0, flush_every=1)
            for step in range(3):
                w.add_scalar("train/loss", 1.0 / (step + 1), step)
            w.close()
        return [str(x.message) for x in seen if issubclass(x.category, SleuthWarning)]

    monkeypatch.delenv("SLEUTH_STRICT", raising=False)
    said = log()
    assert len(said) == 1 and said[0].startswith("the summary is off"), said
    assert "SLEUTH_STRICT=1" in said[0]
    monkeypatch.setenv("SLEUTH_STRICT", "1")
    with pytest.raises(ProfilerError, match="summary: "):
        log()
