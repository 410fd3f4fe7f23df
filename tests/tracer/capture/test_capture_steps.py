"""One step boundary (docs/architecture.md): a step begins when the previous optimizer.step() returns and
ends when its own does, for the trainer, plain loops and explicit `Dumper.step()` alike; dump
step S is the trainer's metrics.jsonl step S, and what follows the last optimizer step is
dropped with a note instead of becoming a step file of its own."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

import tracer
from sleuth.cli import main
from models import MLP, TinyCausalLM, TinyConfig


def _lm_batch():
    ids = torch.randint(0, 64, (2, 8))
    return {"input_ids": ids, "labels": ids}


def _metrics_steps(run):
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in lines if "loss" in m}


@pytest.mark.parametrize("level", ["module", "op"])
def test_trainer_dump_steps_are_metrics_steps(tmp_path, level):
    cfg = tmp_path / "dump.json"
    cfg.write_text(json.dumps({"level": level, "mode": "statistics", "writer": "sync"}))
    run = tmp_path / "run"
    # no clipping: the gradients the optimizer sees are the ones whose norm metrics.jsonl logs;
    # the tiny preset evaluates after the last step, after its optimizer step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["train", "--set", "steps=4", "--set", "optim.grad_clip=0",
                     "--run-dir", str(run), "--dump", str(cfg)])
    assert code == 0
    metrics = _metrics_steps(run)
    d = tracer.open_dump(run)
    assert d.steps(0) == sorted(metrics) == [0, 1, 2, 3]
    for step, m in metrics.items():
        df = d.stats(0, step)
        assert (df.phase == "forward").any() and (df.phase == "backward").any(), step
        grads = df[(df.phase == "optimizer") & (df.direction == "grad")]
        assert len(grads) and (grads.call == grads.call.iloc[0]).all()
        total = math.sqrt(float((grads.norm.astype("float64") ** 2).sum()))
        assert total == pytest.approx(m["grad_norm"], rel=1e-4), step
        assert d.status(0, step) == ("complete", "")
    # the final evaluation and logging came after the last optimizer step: noted, not a step
    note = json.loads((run / "dump" / "rank0" / "notes.jsonl").read_text().splitlines()[-1])
    assert note["step"] == 4 and note["dropped_records"] > 0
    assert any("after the run's last optimizer.step()" in str(w.message) for w in caught)


def _plain_loop(run, level, writer="sync", steps=6, item_after_step=True):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer.Dumper(model, {"path": str(run), "level": level, "writer": writer}):
            for _ in range(steps):
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if item_after_step:
                    loss.item()  # a user's logging, after the step
    return caught


@pytest.mark.parametrize("level,writer", [("module", "sync"), ("op", "sync"), ("op", "async"),
                                          ("mix", "async")])
def test_plain_loop_writes_one_file_per_optimizer_step(tmp_path, level, writer, capsys):
    caught = _plain_loop(tmp_path / "r", level, writer)
    d = tracer.open_dump(tmp_path / "r")
    assert d.steps(0) == [0, 1, 2, 3, 4, 5]
    counts = set()
    for step in range(6):
        df = d.stats(0, step)
        assert (df.phase == "forward").any() and (df.module.str.startswith("fc")).any(), step
        assert (df.phase == "optimizer").any() and d.status(0, step)[0] == "complete"
        if step:
            counts.add(len(df))
    assert len(counts) == 1  # steps 1-5: the same records (step 0 lacks the previous .item())
    notes = tmp_path / "r" / "dump" / "rank0" / "notes.jsonl"
    if level == "module":  # .item() outside any module: no record, nothing dropped
        assert not notes.exists() and not caught
    else:
        note = json.loads(notes.read_text())
        assert note == {"step": 6, "dropped_records": 1, "reason": note["reason"]}
        assert [str(w.message) for w in caught if "1 record(s)" in str(w.message)]
        capsys.readouterr()
        assert main(["dump", "ls", str(tmp_path / "r")]) == 0
        assert "not written: step 6 of rank 0, 1 record(s)" in capsys.readouterr().out


def test_explicit_steps_and_accumulation_keep_their_boundaries(tmp_path):
    torch.manual_seed(0)
    model = TinyCausalLM(TinyConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tracer.Dumper(model, {"path": str(tmp_path / "acc"), "level": "module"}):
        model.eval()
        with torch.no_grad():
            model(**_lm_batch())  # evaluation before the first step: part of step 0
        model.train()
        for _ in range(3):
            for _ in range(2):  # two micro-batches per optimizer step
                model(**_lm_batch())["loss"].backward()
            opt.step()
            opt.zero_grad()
    d = tracer.open_dump(tmp_path / "acc")
    assert d.steps(0) == [0, 1, 2]
    calls = d.stats(0, 0).query("module == 'lm_head' and phase == 'forward'")["call"]
    assert sorted(set(calls)) == [0, 1, 2]  # the evaluation and both micro-batches
    # explicit steps: each d.step() ends one, optimizer steps inside add calls, none dropped
    with tracer.Dumper(model, {"path": str(tmp_path / "ex"), "level": "module"}) as dumper:
        for _ in range(2):
            model(**_lm_batch())["loss"].backward()
            opt.step()
            opt.zero_grad()
            dumper.step()
        model(**_lm_batch())  # a last forward, no step(): written at close, complete
    d = tracer.open_dump(tmp_path / "ex")
    assert d.steps(0) == [0, 1, 2] and d.status(0, 2) == ("complete", "")
    assert not (tmp_path / "ex" / "dump" / "rank0" / "notes.jsonl").exists()


def test_forward_only_script_keeps_its_single_step(tmp_path):
    """No optimizer step ever ends a step: the whole run is step 0, kept at close."""
    model = MLP()
    with tracer.Dumper(model, {"path": str(tmp_path), "level": "op"}):
        with torch.no_grad():
            model(torch.randn(2, 8)).sum().item()
    d = tracer.open_dump(tmp_path)
    assert d.steps(0) == [0] and d.status(0, 0) == ("complete", "")


def test_first_step_numbers_a_resumed_run(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": str(tmp_path), "level": "module", "steps": "11"},
                       first_step=10):
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
    assert tracer.open_dump(tmp_path).steps(0) == [11]


def test_a_step_cut_short_before_its_optimizer_step_is_kept_and_marked(tmp_path):
    """Backward ran, the loop ended before optimizer.step() (leftover micro-batches, a script
    that stops early): a real step's records, kept, but never called complete."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": str(tmp_path), "level": "module"}):
        for i in range(3):
            model(torch.randn(2, 8)).sum().backward()
            if i < 2:
                opt.step()
    d = tracer.open_dump(tmp_path)
    assert d.steps(0) == [0, 1, 2]
    assert d.status(0, 1) == ("complete", "")
    assert d.status(0, 2) == ("interrupted", "the run ended before this step's optimizer.step()")
    assert {"forward", "backward"} <= set(d.stats(0, 2).phase)


def test_steps_asked_for_past_the_runs_end_are_named(tmp_path):
    """"steps": "0|2|9-12" in a run of two optimizer steps: step 2 holds only what followed the
    last optimizer step (dropped, with the run's last step named), and steps 9-12 never began:
    one line says so, since the dump would otherwise lack them without a trace."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer.Dumper(model, {"path": str(tmp_path), "steps": "0|2|9-12",
                                   "level": "module"}):
            for _ in range(2):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            model(torch.randn(2, 4)).sum().item()
    messages = [str(w.message) for w in caught]
    assert any("step(s) 9-12 of the dump config never ran: the run ended after step 1" in m
               for m in messages), messages
    assert any("its last was step 1, so there is no step 2 to write" in m for m in messages)
    assert tracer.open_dump(tmp_path).steps(0) == [0]
