"""`profiler.diff_profiles` on time that no op holds, and on scripts at different paths.

Run B is a copy of run A's script under another name (`train_sleep.py` beside `train.py`) that
sleeps 20 ms a step after the optimizer: the change is outside every op. The diff must name
that first (not an op that moved by noise) and pair every op of the two scripts, whose paths
differ, as one op found in both. Run C is A's script pulling a tensor into Python with
`.tolist()` each step: a builtin that makes a tiny op and then works outside any op, named at
its line as the sleep is."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import profiler

REPO = Path(__file__).resolve().parents[2]

LOOP = '''
import sys, time
import torch
from torch import nn
import profiler


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main(run_dir, sleep_s, pull):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    held = torch.randn(400, 400)
    cfg = profiler.CollectorConfig(wait=1, warmup=1, active=8, with_stack=True)
    with profiler.Collector(run_dir, config=cfg) as c:
        for _ in range(10):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if sleep_s:
                time.sleep(sleep_s)
            if pull:
                held.tolist()
            c.step()


main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
'''


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A: train.py; B: the same loop as train_sleep.py in another folder, sleeping 20 ms a
    step (large against the ~1 ms step, so a busy machine cannot hide it); C: train.py calling
    `.tolist()` on 160,000 floats a step (over 10 ms, most of it outside its op)."""
    root = tmp_path_factory.mktemp("outside")
    (root / "a").mkdir()
    (root / "b").mkdir()
    scripts = (root / "a" / "train.py", root / "b" / "train_sleep.py")
    for s in scripts:
        s.write_text(LOOP)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for script, run, sleep, pull in ((scripts[0], "run_a", "0", "0"),
                                     (scripts[1], "run_b", "0.02", "0"),
                                     (scripts[0], "run_c", "0", "1")):
        out = subprocess.run([sys.executable, str(script), str(root / run), sleep, pull], env=env,
                             cwd=script.parent, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
    return root


@pytest.mark.slow
def test_time_outside_ops_is_named_first(pair):
    d = profiler.diff_profiles(pair / "run_a", pair / "run_b")
    assert d.verdict == "slower", d.headline()
    first = d.causes[0]
    assert first.startswith("time outside any op:"), d.causes
    assert "'other'" in first and "not in any op" in first, first
    # no op, line or module is blamed before it
    assert not any(c.startswith(("op ", "module ")) or "train" in c.split(":")[0]
                   for c in d.causes[:1])
    # with stacks, the sleep's line in B's script is named
    sleep_line = LOOP.splitlines().index("                time.sleep(sleep_s)") + 1
    assert f"train_sleep.py:{sleep_line}: a call of sleep()" in first, first
    amount = first.split("time outside any op: ")[1].split(" a step")[0]
    assert amount.endswith(" ms") and float(amount[:-3]) > 10, first  # most of the 20 ms sleep


@pytest.mark.slow
def test_a_builtin_that_makes_an_op_is_named_for_its_time_outside_it(pair):
    """`.tolist()` makes `aten::resolve_conj` and then builds its list outside any op: the
    time is named at its line, and the host table pairs its calls though each step's tensor
    object (and so the event's name) has its own address."""
    d = profiler.diff_profiles(pair / "run_a", pair / "run_c")
    assert d.verdict == "slower", d.headline()
    first = d.causes[0]
    assert first.startswith("time outside any op:"), d.causes
    pull_line = LOOP.splitlines().index("                held.tolist()") + 1
    assert f"train.py:{pull_line}: a call of tolist()" in first, first
    amount = first.split(": a call of tolist(), ")[1].split(" a step")[0]
    assert amount.endswith(" ms") and float(amount[:-3]) > 1, first  # 160,000 floats a step
    tolist = d.host[d.host["name"] == "<built-in method tolist of Tensor object>"]
    assert len(tolist) == 1 and tolist.iloc[0]["calls_b"] == 1, d.host
    # its op is an op, not host time: the ops' change stays small beside the list's building
    ops_change = float(d.ops["self_b_us"].sum() - d.ops["self_a_us"].sum())
    assert ops_change < 0.5 * float(tolist.iloc[0]["delta_us"]), (ops_change, d.host)


@pytest.mark.slow
def test_ops_pair_across_script_paths(pair):
    d = profiler.diff_profiles(pair / "run_a", pair / "run_b")
    ops = d.ops
    mm = ops[ops["name"] == "aten::addmm"]
    assert not mm.empty and set(mm["side"]) == {"both"}, mm
    assert not (ops["side"] == "B only").any(), ops[ops["side"] != "both"]
    assert not (ops["side"] == "A only").any(), ops[ops["side"] != "both"]
    # each side's line is kept: A's in train.py, B's in train_sleep.py
    assert mm["source_a"].str.contains("train.py:").all(), mm["source_a"]
    assert mm["source_b"].str.contains("train_sleep.py:").all(), mm["source_b"]
    assert "in B only" not in " ".join(d.causes)


@pytest.mark.slow
def test_cli_names_outside_time_first(pair):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "sleuth", "profile", "diff", str(pair / "run_a"),
                          str(pair / "run_b"), "--json"], env=env, capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 1, out.stderr
    data = json.loads(out.stdout)
    assert data["causes"][0].startswith("time outside any op:"), data["causes"]
    text = subprocess.run([sys.executable, "-m", "sleuth", "profile", "diff",
                           str(pair / "run_a"), str(pair / "run_b")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO).stdout
    assert "1. time outside any op:" in text, text
    # each side's line in the ops table: the scripts sit at different paths
    assert "train.py:" in text and "| B " in text and "train_sleep.py:" in text, text


def test_new_calls_holding_a_little_of_the_outside_time_leave_the_rest_unplaced():
    """Six new `.item()` calls a step hold only their wrappers' 18 us of 170 us outside ops:
    their line is named with that much, and the rest is said to be Python work no line holds,
    not explained by them."""
    import pandas as pd

    from profiler._diff_causes import Kind, OutsideOps, host_share
    from profiler._diff_words import words
    host = pd.DataFrame([{"name": "<built-in method item of Tensor object>",
                          "source": "train.py:124", "calls_a": 0.0, "calls_b": 6.0,
                          "time_a_us": 0.0, "time_b_us": 18.0, "delta_us": 18.0}])
    call, rest, unplaced = host_share(host, True, 1, 170.0)
    assert call.source == "train.py:124" and call.us == 18.0 and rest == 152.0 and unplaced
    text = words(OutsideOps(kind=Kind.OUTSIDE_OPS, us=170.0, rank_us=170.0, phase="other",
                            phase_us=170.0, share=100.0, ops_us=0.0, stacks=True, host=call,
                            rest_us=rest, unplaced=unplaced))
    assert "at train.py:124: a call of item(), +18 us a step" in text, text
    assert "the other +152 us a step is Python work between ops" in text, text
    host.loc[0, ["time_b_us", "delta_us"]] = 150.0  # most of it: the call holds it
    call, rest, unplaced = host_share(host, True, 1, 170.0)
    assert call.us == 150.0 and rest == 0.0 and not unplaced
    # without stacks no line is named, and nothing is said to be unplaced
    assert host_share(host, False, 1, 170.0) == (None, 0.0, False)
