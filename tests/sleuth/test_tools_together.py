"""Sleuth's tools stay out of each other's way and out of the numerics.

Summary, profile and IR export, each alone and all together, run beside a mix-level dump, on the
trainer (`sleuth train`, in process) and on a plain loop of our own under `sleuth run`; each
dump must hold, step by step, the same records in the same order as the dump taken alone. The
loop's model is a Llama-style MLP (SiLU gate): a profiled run must end with the same weights,
bit for bit, as an unprofiled one, and still report FLOPs and MFU.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import profiler
import tracer
from sleuth.cli import main

TOOLS = ("--summary", "--profile", "--save-graphs")
# the dump alone, beside each tool alone, and beside all of them: a pair of tools meets in the
# run with all three, so the pairs alone would only repeat it
COMBOS = [(), *((tool,) for tool in TOOLS), TOOLS]
OTHERS = [c for c in COMBOS if c]
WATCH = [{"condition": "nan_inf"}, {"condition": "max_abs_gt", "threshold": 0.5},
         {"condition": "grad_explode", "threshold": 1e-3}, {"condition": "weight_change_gt",
                                                            "threshold": 1e-6}]

LOOP = '''
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LlamaMLP(nn.Module):
    def __init__(self, d=16, hidden=48):
        super().__init__()
        self.norm = RMSNorm(d)
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        # a factory call in forward: a tool's mode that keeps its output alive hands the
        # model a detached alias, an op every other mode then records
        ramp = torch.arange(1, x.shape[-1] + 1, dtype=x.dtype) / x.shape[-1]
        h = self.norm(x * ramp)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


torch.manual_seed(0)
model = LlamaMLP()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.randn(5, 4, 16)
for i in range(5):
    loss = model(data[i]).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
torch.save(model.state_dict(), sys.argv[1])
'''


def record_lists(run_dir):
    """{step: [record names in order]} of rank 0's dump in `run_dir`."""
    dump = tracer.open_dump(run_dir / "dump")
    try:
        return {s: list(dump.stats(0, s)["name"]) for s in dump.steps(0)}
    finally:
        dump.close()


def assert_same_records(base, other, label):
    assert sorted(other) == sorted(base), f"{label}: dump steps {sorted(other)} != {sorted(base)}"
    for step, names in base.items():
        got = other[step]
        extra = [n for n in got if n not in set(names)][:5]
        missing = [n for n in names if n not in set(got)][:5]
        assert got == names, (f"{label}, step {step}: {len(got)} records instead of "
                              f"{len(names)}; extra {extra}, missing {missing}")


def assert_tool_output(run_dir, combo):
    """The other tools ran: a combination where one of them silently did nothing proves
    nothing."""
    if "--summary" in combo:
        assert list((run_dir / "summary").glob("rank0*.h5")), run_dir
    if "--profile" in combo:
        assert list((run_dir / "profile" / "rank0").glob("window*.json")), run_dir
    if "--save-graphs" in combo:
        assert list((run_dir / "ir").glob("*.ir")), run_dir


def _name(combo):
    return "+".join(c.lstrip("-") for c in combo) or "dump-only"


# ---- a plain loop under `sleuth run` --------------------------------------------------------
@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory, sleuth_cli):
    """Each combination under `sleuth run` with the dump on: {combo: run directory}."""
    root = tmp_path_factory.mktemp("loop")
    script = root / "train_mlp.py"
    script.write_text(LOOP)
    config = root / "dump.json"
    config.write_text(json.dumps({"level": "mix", "mode": "statistics"}))
    # the run with every other tool also checks watchpoints (and the flight recorder is on in
    # all): the dump's own observers must not add records either
    watched = root / "dump_watch.json"
    watched.write_text(json.dumps({"level": "mix", "mode": "statistics", "watch": WATCH}))
    runs = {}
    for combo in COMBOS:
        run_dir = root / _name(combo)
        dump = watched if combo == TOOLS else config
        r = sleuth_cli("run", "--run-dir", str(run_dir), "--dump", str(dump), *combo, "--",
                       sys.executable, str(script), str(run_dir / "weights.pt"), cwd=root)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[combo] = run_dir
    return script, runs


@pytest.mark.slow
@pytest.mark.parametrize("combo", OTHERS, ids=_name)
def test_plain_loop_dump_is_the_same_with_other_tools(loop_runs, combo):
    _, runs = loop_runs
    base = record_lists(runs[()])
    assert len(base) >= 5 and all(base.values())
    assert_same_records(base, record_lists(runs[combo]), _name(combo))
    assert_tool_output(runs[combo], combo)
    if combo == TOOLS:  # the watchpoints did fire: their checks ran on every record
        dump = tracer.open_dump(runs[combo] / "dump")
        try:
            assert any(len(dump.hits(0, s)) for s in dump.steps(0))
        finally:
            dump.close()


@pytest.mark.slow
def test_profile_changes_no_weight_and_still_counts_flops(loop_runs, tmp_path, sleuth_cli):
    script, runs = loop_runs
    plain = tmp_path / "plain.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    subprocess.run([sys.executable, str(script), str(plain)], check=True, cwd=tmp_path, env=env)
    profiled = tmp_path / "profiled"
    r = sleuth_cli("run", "--run-dir", str(profiled), "--profile", "--", sys.executable,
                   str(script), str(tmp_path / "profiled.pt"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    want = torch.load(plain, weights_only=True)
    for label, path in [("profile", tmp_path / "profiled.pt"),
                        *((_name(c), d / "weights.pt") for c, d in runs.items())]:
        got = torch.load(path, weights_only=True)
        diff = [k for k in want if not torch.equal(want[k], got[k])]
        assert not diff, f"{label}: weights differ from the run without Sleuth in {diff}"
    meta = json.loads((profiled / "profile" / "rank0" / "window0.json").read_text())
    assert meta["flop_counts"]["aten.mm"] > 0 and meta["flops_unpriced"] == 0
    summary = profiler.read_profile(profiled).summary
    assert summary["flops_per_step"] == meta["flops_per_step"] > 0
    assert math.isfinite(summary["mfu"]) and summary["mfu"] > 0
    assert not summary["dump_on"] and summary["clamped_events"] == 0


@pytest.mark.slow
def test_profile_with_dump_says_so(loop_runs, capsys):
    _, runs = loop_runs
    run = runs[("--profile",)]
    prof = profiler.read_profile(run)
    s = prof.summary
    assert s["dump_on"] and s["tools"]["tracer"] > 0 and 0 < s["tool_share"] < 1
    assert s["clamped_events"] == 0  # no negative self time left to clamp
    assert "PythonDispatchMode" not in set(prof.ops["name"])
    assert (prof.steps["tools_us"] > 0).all()
    assert main(["profile", str(run)]) == 0
    out = capsys.readouterr().out
    assert "the dump was on in these steps" in out and "tracer" in out and "clamped" not in out
    assert main(["profile", "--json", str(run)]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["dump_on"] is True and summary["tools"]["tracer"] > 0


# ---- the trainer ----------------------------------------------------------------------------
TRAIN = ["train", "--preset", "tiny", "--set", "steps=4", "--set", "eval_every=0",
         "--set", "model.n_layer=1", "--set", "batch_size=2", "--set", "data.seq_len=16",
         "--set", "model.block_size=16"]


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """Each combination of `sleuth train` (in this process) with the dump on."""
    root = tmp_path_factory.mktemp("trainer")
    config = root / "dump.json"
    config.write_text(json.dumps({"level": "mix", "mode": "statistics"}))
    runs = {}
    for combo in COMBOS:
        run_dir = root / _name(combo)
        assert main([*TRAIN, "--run-dir", str(run_dir), "--dump", str(config), *combo]) == 0
        runs[combo] = run_dir
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("combo", OTHERS, ids=_name)
def test_trainer_dump_is_the_same_with_other_tools(trainer_runs, combo):
    base = record_lists(trainer_runs[()])
    assert len(base) >= 4 and sum(map(len, base.values())) > 1000
    assert_same_records(base, record_lists(trainer_runs[combo]), _name(combo))
    assert_tool_output(trainer_runs[combo], combo)


@pytest.mark.slow
def test_the_claim_knows_every_file_the_tools_write(trainer_runs, tmp_path):
    """A run with every tool: the claim on its directory finds one run in all of it, and
    `--overwrite`'s removal leaves no file behind (sleuth.common.run_files names each tool's
    files; a tool that writes a new kind of file and leaves the list out fails here)."""
    import shutil

    import trainer

    run = tmp_path / "run"
    shutil.copytree(trainer_runs[TOOLS], run)
    found = trainer.scan_run_dir(run)
    [(run_id, names)] = found.by_run.items()
    assert run_id and {"run.json", "dump/", "summary/", "profile/", "ir/"} <= set(names), names
    trainer.remove_run_files(run)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == []


@pytest.mark.slow
@pytest.mark.parametrize("strict", ["0", "1"])
def test_train_goes_on_when_its_tools_cannot_write(tmp_path, capsys, monkeypatch, recwarn,
                                                   strict):
    """`sleuth train --profile --save-graphs` where neither the profile nor the graphs can be
    written (a file stands where each folder goes): each tool says so in one `sleuth:` line and
    goes off, and the training ends normally; SLEUTH_STRICT=1 stops it with exit 2."""
    from sleuth.cli import main

    monkeypatch.setenv("SLEUTH_STRICT", strict)
    run = tmp_path / "run"
    run.mkdir()
    (run / "profile").write_text("not a folder")
    (run / "ir").write_text("not a folder")
    code = main(["train", "--preset", "tiny", "--set", "steps=3", "--set", "eval_every=0",
                 "--run-dir", str(run), "--profile", "--save-graphs"])
    out = capsys.readouterr()
    if strict == "1":
        assert code == 2 and "Traceback" not in out.err, out.err
        return
    assert code == 0, out.err
    from tracer import SleuthWarning

    said = [str(w.message) for w in recwarn if issubclass(w.category, SleuthWarning)]
    assert len(said) == 2, said
    assert any("the IR graphs are not saved" in line for line in said), said
    assert any("the profiler is off" in line for line in said), said
    assert [m["step"] for m in __import__("trainer").read_metrics(run)] == [0, 1, 2]
