"""The live reference (tracer.analysis._live): a run's steps diffed with a known-good dump's as
the Dumper writes them. The record it names is the record `tracer.diff` names afterwards; a
reference that does not read goes off in one line; "stop" ends the run with exit code 3."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

import tracer
from sleuth.common import SleuthError
from models import MLP


def _train(path, reference=None, *, fault_step=None, steps=3, writer="sync"):
    """Three SGD steps of a small MLP on fixed batches, dumped at level module; at `fault_step`
    the weight of fc2 is scaled before the forward (a fault written in place)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)
    with tracer.Dumper(model, {"path": str(path), "writer": writer}, reference=reference):
        for step in range(steps):
            if step == fault_step:
                with torch.no_grad():
                    model.fc2.weight.mul_(1.5)
            model(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("live") / "ref"
    _train(path)
    return path


def test_the_first_divergence_is_the_diffs_said_at_once_and_kept(reference, tmp_path, capfd):
    live = tracer.LiveReference(reference)
    _train(tmp_path / "run", live, fault_step=1)
    err = capfd.readouterr().err
    after = tracer.diff(reference, tmp_path / "run").first_divergence
    assert live.first_divergence["name"] == after["name"] and after["step"] == 1
    assert live.compared == [0, 1]  # nothing compared after the first divergence
    [line] = [x for x in err.splitlines() if "live reference" in x]
    assert line.startswith(f"sleuth: live reference: first divergence at step 1: {after['name']}"
                           f" (module fc2, op -, phase optimizer, at ")
    kept = json.loads((tmp_path / "run" / "dump" / "rank0" / "live_reference.json").read_text())
    assert (kept["step"], kept["first_divergence"]["name"]) == (1, after["name"])


def test_the_first_divergence_kept_is_read_back_and_marked_on_the_runs_page(reference,
                                                                            tmp_path):
    """`tracer.read_live_reference` reads what each rank kept, through the door, and the
    dashboard's Runs page marks the run with it: the line said live and the diff to run. A
    forged file (not the object written, a FIFO, a link out of the run) is said, never read
    as a divergence, and a look-alike rank folder (`rank00`) is not a rank."""
    from dashboard._page_runs import _live_marks
    from dashboard._runs import load_runs

    run = tmp_path / "run"
    _train(run, tracer.LiveReference(reference), fault_step=1)
    [found] = tracer.read_live_reference(run)
    assert found["rank"] == 0 and found["step"] == 1
    assert found["line"].startswith("live reference: first divergence at step 1: ")
    [mark] = _live_marks(load_runs([run])[0])
    text = str(mark.children)
    assert "Diverged from its reference (rank 0)" in text and "first divergence at step 1" in text
    assert f"sleuth diff {reference.resolve()} {run}" in text
    kept = run / "dump" / "rank0" / "live_reference.json"
    good = kept.read_text()
    assert tracer.read_live_reference(tmp_path / "nowhere") == []
    shutil.copytree(run / "dump" / "rank0", run / "dump" / "rank00")
    assert [f["rank"] for f in tracer.read_live_reference(run)] == [0]
    shutil.rmtree(run / "dump" / "rank00")
    outside = tmp_path / "outside.json"
    outside.write_text(good)
    for forge in ("list", "fifo", "link"):
        kept.unlink()
        if forge == "list":
            kept.write_text("[1, 2]")
        elif forge == "fifo":
            os.mkfifo(kept)
        else:
            os.symlink(outside, kept)
        [found] = tracer.read_live_reference(run)
        assert set(found) == {"rank", "error"}, found
        [mark] = _live_marks(load_runs([run])[0])
        assert "Cannot read this data" in str(mark.children)


def test_the_same_run_raises_no_alarm_with_the_async_writer(reference, tmp_path, capfd):
    live = tracer.LiveReference(reference)
    _train(tmp_path / "run", live, writer="async")
    assert live.first_divergence is None and live.compared == [0, 1, 2]
    assert "live reference" not in capfd.readouterr().err


def test_stop_ends_the_run_with_exit_code_3(reference, tmp_path):
    live = tracer.LiveReference(reference, on_divergence="stop")
    with pytest.raises(tracer.ReferenceDiverged) as e:
        _train(tmp_path / "run", live, fault_step=1)
    assert isinstance(e.value, SystemExit) and e.value.code == 3
    assert str(e.value).endswith("diverged from " + str(reference) + " at step 1")
    # the run ends at the end of the divergent step or of the next one (the judge's `LAG`)
    assert tracer.open_dump(tmp_path / "run").steps(0) in ([0, 1], [0, 1, 2])


def test_a_reference_that_does_not_read_is_one_line_and_the_run_goes_on(tmp_path,
                                                                        monkeypatch):
    monkeypatch.delenv("SLEUTH_STRICT", raising=False)
    with pytest.warns(tracer.SleuthWarning) as said:
        live = tracer.LiveReference(tmp_path / "nowhere")
    [line] = [str(w.message) for w in said]
    assert line.startswith("the live reference is off, and the run goes on without it: "
                           "reading the reference") and "nowhere" in line
    _train(tmp_path / "run", live, steps=1)
    assert not live.active and live.compared == []
    monkeypatch.setenv("SLEUTH_STRICT", "1")
    with pytest.raises(SleuthError, match="no dump at .*nowhere"):  # the error itself
        tracer.LiveReference(tmp_path / "nowhere")


def test_user_mistakes_are_one_line_errors(tmp_path):
    with pytest.raises(tracer.ConfigError, match="on_divergence"):
        tracer.LiveReference(tmp_path, on_divergence="halt")
    with pytest.raises(tracer.ConfigError, match=r"pass tracer.LiveReference\("):
        tracer.Dumper(MLP(), {"path": str(tmp_path / "run")}, reference=str(tmp_path))


def test_a_map_for_the_live_reference_is_checked_before_the_run_starts(tmp_path, capsys):
    """`sleuth run --map` needs --reference, and a map that does not read stops it before the
    command runs, in one line naming the option and the file (exit 2)."""
    from sleuth.cli import main

    (tmp_path / "dump.json").write_text('{"mode": "statistics"}')
    (tmp_path / "bad.yaml").write_text("pairs: [")
    never = ["--", sys.executable, "-c", "raise SystemExit(9)"]
    assert main(["run", "--run-dir", str(tmp_path / "r"), "--dump", str(tmp_path / "dump.json"),
                 "--map", str(tmp_path / "bad.yaml"), *never]) == 2
    assert "--map pairs the run's modules with a reference's" in capsys.readouterr().err
    assert main(["run", "--run-dir", str(tmp_path / "r"), "--dump", str(tmp_path / "dump.json"),
                 "--reference", str(tmp_path), "--map", str(tmp_path / "bad.yaml"),
                 *never]) == 2
    err = capsys.readouterr().err
    assert "--map" in err and "bad.yaml: not YAML" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


_TRAIN = '''
import os, sys
import torch
sys.path.insert(0, {models!r})
from models import TinyCausalLM, TinyConfig

torch.manual_seed(0)
model = TinyCausalLM(TinyConfig())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1)
fault = os.environ.get("FAULT") == "1"
up = model.layers[1].mlp[0]
inner = up.forward


def forward(x):
    out = inner(x)
    return out * 1.5 if fault and step == 2 else out  # the fault: an extra op in step 2


up.forward = forward
for step in range(5):
    ids = torch.randint(0, 64, (2, 8), generator=data)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
'''


@pytest.mark.slow
def test_sleuth_run_names_the_diffs_record_in_the_step_it_happens(tmp_path, sleuth_cli):
    """An unedited script under `sleuth run --reference`: a run like the reference says
    nothing; a fault in step 2 is named live at the record `tracer.diff` names afterwards, in
    step 2; with --on-divergence stop the run ends with exit code 3."""
    from pathlib import Path

    (tmp_path / "train.py").write_text(_TRAIN.format(models=str(Path(__file__).parents[1])))
    (tmp_path / "dump.json").write_text(json.dumps({"steps": "all"}))

    def run(name, *extra, fault=False):
        return sleuth_cli("run", "--run-dir", name, "--dump", "dump.json", *extra, "--",
                          "python", "train.py", cwd=tmp_path, env={"FAULT": "1" if fault else "0"})

    proc = run("ref")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run("same", "--reference", "ref")
    assert proc.returncode == 0 and "live reference" not in proc.stderr, proc.stderr[-3000:]
    proc = run("bad", "--reference", "ref", fault=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = tracer.diff(tmp_path / "ref", tmp_path / "bad").first_divergence
    assert after["step"] == 2 and after["module"].endswith("layers.1.mlp.0")
    [line] = [x for x in proc.stderr.splitlines() if "live reference" in x]
    assert line.startswith(f"sleuth: live reference: first divergence at step 2: "
                           f"{after['name']} (module {after['module']}, op ")
    assert f"phase forward, at {after['source']}): " in line and line.endswith("the run goes on")
    proc = run("stopped", "--reference", "ref", "--on-divergence", "stop", fault=True)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "first divergence at step 2" in proc.stderr and "Traceback" not in proc.stderr
    kept = json.loads((tmp_path / "stopped" / "dump" / "rank0" / "live_reference.json")
                      .read_text())
    assert kept["first_divergence"]["name"] == after["name"]


_LIVE_FAULTS = ("extra_forward", "extra_small", "dropped_op", "extra_backward", "swapped",
                "permutation", "nan")


@pytest.mark.slow
@pytest.mark.parametrize("fault", _LIVE_FAULTS)
def test_fault_zoo_faults_are_found_live_in_their_step(tmp_path, fault):
    """The fault zoo's op faults, put into a small causal LM from step 2 on (the reference runs
    the fault's correct code from step 2 on): found live at step 2 at the record `tracer.diff`
    names afterwards, inside the site or right after the site's op that only one run ran
    (level op, sync and async writers)."""
    from fault_zoo import _inject, in_site
    from models import TinyCausalLM, TinyConfig

    site = "layers.1.mlp.0"

    def train(path, faulty, reference=None, writer="sync"):
        torch.manual_seed(0)
        model = TinyCausalLM(TinyConfig())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(1)
        with tracer.Dumper(model, {"path": str(path), "level": "op", "writer": writer},
                           reference=reference):
            for step in range(4):
                if step == 2:
                    _inject(model, fault, site, faulty)
                ids = torch.randint(0, 64, (2, 8), generator=data)
                model(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()

    train(tmp_path / "ref", faulty=False)
    for writer in ("sync", "async"):
        live = tracer.LiveReference(tmp_path / "ref")
        train(tmp_path / writer, faulty=True, reference=live, writer=writer)
        after = tracer.diff(tmp_path / "ref", tmp_path / writer).first_divergence
        assert live.first_divergence is not None, (writer, after)
        assert (live.first_divergence["step"], live.first_divergence["name"]) == \
            (2, after["name"]) and after["step"] == 2, writer
        # an op only one run has is unpaired: the diff names the next record, and it before
        made = [after["module"]] + [u["name"].split("::")[0] for u in after["unpaired_before"]]
        assert any(in_site(m, site) for m in made), after


def test_a_reference_step_that_does_not_read_whole_is_said_never_a_silent_pass(tmp_path, capfd):
    import shutil

    ref = tmp_path / "ref"
    shutil.copytree(_reference_of(tmp_path), ref)
    step = ref / "dump" / "rank0" / "step1.h5"
    data = bytearray(step.read_bytes())  # damaged inside: listed, but not read whole
    data[len(data) // 2:len(data) // 2 + 4096] = bytes(4096)
    step.write_bytes(bytes(data))
    live = tracer.LiveReference(ref)
    _train(tmp_path / "run", live)
    assert live.first_divergence is None
    err = capfd.readouterr().err
    assert "step 1 of rank 0 was not judged whole" in err, err


def _reference_of(tmp_path):
    path = tmp_path / "made"
    _train(path)
    return path


def test_the_steps_are_judged_in_a_helper_process(reference, tmp_path, monkeypatch):
    from tracer.analysis import _live, _live_judge

    judges = []
    real = _live_judge.Judge

    class Counted(real):
        def __init__(self) -> None:
            super().__init__()
            judges.append(self._proc.pid)

    monkeypatch.setattr(_live, "Judge", Counted)
    monkeypatch.setattr(_live, "judged", None)  # nothing judged in the run's own process
    live = tracer.LiveReference(reference)
    _train(tmp_path / "run", live, fault_step=2)
    assert len(judges) == 1 and judges[0] != os.getpid()
    assert live.first_divergence["step"] == 2 and live.compared == [0, 1, 2]


@pytest.mark.parametrize("how", ["does_not_start", "dies"])
def test_without_its_helper_process_the_run_judges_its_steps_itself(reference, tmp_path,
                                                                     monkeypatch, how):
    from tracer.analysis import _live, _live_judge

    class Broken(_live_judge.Judge):
        def __init__(self) -> None:
            if how == "does_not_start":
                raise OSError("no such program")
            super().__init__()
            self._proc.kill()  # its answers never come: the steps sent are compared here

    monkeypatch.setattr(_live, "Judge", Broken)
    monkeypatch.delenv("SLEUTH_STRICT", raising=False)
    live = tracer.LiveReference(reference)
    with pytest.warns(tracer.SleuthWarning, match="its judge process failed .*compared in "
                                                  "the run's own process"):
        _train(tmp_path / "run", live, fault_step=1)
    after = tracer.diff(reference, tmp_path / "run").first_divergence
    assert live.first_divergence["name"] == after["name"] and live.compared == [0, 1]


def test_a_setup_difference_is_said_before_the_divergence_it_causes(reference, tmp_path, capfd):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)  # the reference has none
    data = torch.Generator().manual_seed(1)
    live = tracer.LiveReference(reference)
    with tracer.Dumper(model, {"path": str(tmp_path / "run"), "writer": "sync"},
                       reference=live):
        for _ in range(3):
            model(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    lines = [x for x in capfd.readouterr().err.splitlines() if "live reference" in x]
    assert lines[0].startswith(f"sleuth: live reference: step 0 of rank 0 is set up otherwise "
                               f"than {reference}: SGD momentum 0 in A, 0.5 in B"), lines
    assert live.setup and "momentum" in live.setup[0]
    kept = json.loads((tmp_path / "run" / "dump" / "rank0" / "live_reference.json").read_text())
    assert kept["setup"] == live.setup


_DDP = '''
import os
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(),
                                                          nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(1 + rank)
for step in range(3):
    x = torch.randn(16, 4)
    if os.environ.get("FAULT") == "1" and rank == 1 and step == 1:
        x = x * 2  # rank 1's batch scaled in step 1 only
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
import atexit, sys; atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)
'''


@pytest.mark.slow
def test_each_torchrun_rank_is_judged_against_its_reference_rank(tmp_path, sleuth_cli,
                                                                 free_port):
    """Two DDP ranks under `sleuth run --reference`: rank 1's batch differs in step 1; each
    rank compares itself with the same rank of the reference, each in a judge of its own, and
    both name step 1 (rank 1 its batch, rank 0 the gradients DDP averaged with it)."""
    (tmp_path / "ddp.py").write_text(_DDP)
    (tmp_path / "dump.json").write_text(json.dumps({"steps": "all", "mode": "statistics"}))

    def run(name, *extra, fault=False):
        return sleuth_cli("run", "--run-dir", name, "--dump", "dump.json", *extra, "--",
                          "python", "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={free_port()}", "ddp.py", cwd=tmp_path,
                          env={"FAULT": "1" if fault else "0"}, timeout=300)

    proc = run("ref")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run("bad", "--reference", "ref", fault=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for rank in (0, 1):
        kept = json.loads((tmp_path / "bad" / "dump" / f"rank{rank}" / "live_reference.json")
                          .read_text())
        after = tracer.diff(tmp_path / "ref", tmp_path / "bad", rank=rank).first_divergence
        assert kept["step"] == 1 and kept["rank"] == rank, kept
        assert kept["first_divergence"]["name"] == after["name"], (kept, after)
        found[rank] = kept["first_divergence"]
    assert found[1]["phase"] == "forward", found[1]
    lines = [x for x in proc.stderr.splitlines() if "first divergence at step 1" in x]
    assert len(lines) == 2 and "(rank 0)" in " ".join(lines) and "(rank 1)" in " ".join(lines)
