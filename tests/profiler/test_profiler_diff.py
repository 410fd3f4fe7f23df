"""`sleuth profile diff A B` on the worked example of docs/profiler.md: two runs of
examples/train.py, one slowed by a finite check with `.item()` on every gradient each step.
The diff names that line first and exits 1; two runs of the same config exit 0, "no change
beyond noise"; --json and --csv; a profile that cannot be read is exit 2 in one line."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
CONFIG = {"wait": 1, "warmup": 2, "active": 20, "with_stack": True}


def _profile(root: Path, *runs: tuple[str, list[str]]) -> None:
    """Profile the runs at the same time, each `(name, extra arguments of train.py)`."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = []
    for name, extra in runs:
        shutil.rmtree(root / name, ignore_errors=True)
        procs.append((name, subprocess.Popen(
            [sys.executable, "-m", "sleuth", "run", "--run-dir", str(root / name), "--profile",
             str(root / "profile.json"), "--", sys.executable, str(TRAIN), "--steps", "24",
             *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)))
    for name, p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"{name}: {out}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A and B (--check-finite) profiled at the same time with one thread each, so that the
    machine's speed drifting (a neighbour's burst) falls on both alike, which one profile a
    side cannot see when they run one after the other; and two runs of A's config, c1 and c2,
    likewise. On a shared machine a burst can still spread 1 ms steps over tens of percent
    (the diff then rightly says it cannot tell): a pair is profiled again, once; the timing
    verdict is skipped if still so, never the checks that do not depend on load."""
    import profiler

    root = tmp_path_factory.mktemp("pdiff")
    (root / "profile.json").write_text(json.dumps(CONFIG))
    for _attempt in range(2):
        _profile(root, ("a", []), ("b", ["--check-finite"]))
        if profiler.diff_profiles(root / "a", root / "b").verdict == "slower":
            break
    for _attempt in range(2):  # the same config: a busy spell may favour one process
        _profile(root, ("c1", []), ("c2", []))
        if profiler.diff_profiles(root / "c1", root / "c2").verdict == "no change":
            break
    return root


def need_quiet(runs: Path, other: str) -> None:
    """Skips a timing verdict the machine's load decided: the diff gave none beyond a floor
    that the load raised (it says so). A verdict in the wrong direction is never skipped."""
    import profiler
    d = profiler.diff_profiles(runs / "a", runs / other)
    assert d.verdict != "faster", d.headline()
    if d.verdict == "no change" and d.judgement.noise > 0.05:
        pytest.skip(f"the machine was too busy to time 1 ms steps: {d.headline()}")


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(TRAIN.read_text().splitlines(), 1) if text in line)


@pytest.mark.slow
def test_slowed_run_names_the_sync_line_first(runs, sleuth_cli):
    need_quiet(runs, "b")
    r = sleuth_cli("profile", "diff", str(runs / "a"), str(runs / "b"), "--top", "5")
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert "B is slower" in out
    first = out.split("likeliest first:")[1].splitlines()[1]
    assert f"examples/train.py:{_line_of('torch.isfinite(p.grad)')}:" in first, out
    assert "aten::isfinite" in first and "in B only" in first
    assert "ops found in one run only:" in out and "step breakdown" in out


@pytest.mark.slow
def test_same_config_is_no_change_beyond_noise(runs, sleuth_cli):
    """Two processes of one config at once can still get a busy machine unevenly, every step
    of one a little faster (significant by the rank test, yet within the steps' own spread
    give or take a point): such a pair is profiled again, once, and a verdict given while the
    steps spread past the 5 % threshold is skipped; on a quiet machine any verdict but "no
    change" fails."""
    import profiler

    d = profiler.diff_profiles(runs / "c1", runs / "c2")
    if d.verdict != "no change" and d.judgement.noise > 0.05:
        pytest.skip(f"the machine was too busy to time two runs alike: {d.headline()}")
    r = sleuth_cli("profile", "diff", str(runs / "c1"), str(runs / "c2"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no change beyond noise" in r.stdout
    assert "likeliest first" not in r.stdout


@pytest.mark.slow
def test_the_added_line_leads_by_calls_whatever_the_load(runs):
    """Calls do not change with load: the check's line adds the most time through new calls."""
    import profiler
    d = profiler.diff_profiles(runs / "a", runs / "b")
    top = d.lines.sort_values("from_calls_us", ascending=False).iloc[0]
    assert top["source"].endswith(f"examples/train.py:{_line_of('torch.isfinite(p.grad)')}")
    assert top["side"] == "B only" and "aten::isfinite (calls 0 -> 6)" in top["ops"]


@pytest.mark.slow
def test_json_and_csv(runs, sleuth_cli, tmp_path):
    r = sleuth_cli("profile", "diff", str(runs / "a"), str(runs / "b"), "--json", "--csv",
                   str(tmp_path / "csv"))
    assert r.returncode in (0, 1), r.stderr
    data = json.loads(r.stdout)
    assert data["exit_code"] == r.returncode and data["verdict"] in ("slower", "no change")
    assert data["step_time"]["a"]["n"] == 20 and data["step_time"]["b"]["n"] == 20
    assert {row["phase"] for row in data["breakdown"]} >= {"data", "forward", "backward",
                                                            "optimizer", "other"}
    isfinite = [o for o in data["ops"] if o["name"] == "aten::isfinite"]
    # one row per input shape (ops pair by name and shapes): 6 calls over the parameters'
    assert isfinite and {o["side"] for o in isfinite} == {"B only"}
    assert sum(o["calls_b"] for o in isfinite) == 6
    assert data["sides"]["a"]["stacks"] and data["sides"]["b"]["traces"]
    for name in ("breakdown", "ops", "modules", "lines", "ranks"):
        assert (tmp_path / "csv" / f"{name}.csv").stat().st_size > 0


@pytest.mark.slow
def test_repeats_of_a_config_measure_the_variation_between_runs(runs, sleuth_cli):
    """c1 and c2 are runs of A's config: given as repeats, the floor includes how far their
    median steps lie apart, the verdict pools their steps, and a verdict against B's new calls
    is never given."""
    r = sleuth_cli("profile", "diff", str(runs / "a"), str(runs / "b"), "--repeat-a",
                   str(runs / "c1"), "--repeat-a", str(runs / "c2"), "--json")
    assert r.returncode in (0, 1), r.stderr
    data = json.loads(r.stdout)
    assert data["verdict"] in ("slower", "no change"), data["headline"]
    st = data["step_time"]
    assert st["a"]["n"] == 60 and st["b"]["n"] == 20
    assert st["between_runs"] is not None and st["between_runs"] >= 0
    assert st["noise_floor"] >= st["between_runs"]
    assert st["repeats"] == {"a": [str(runs / "c1"), str(runs / "c2")], "b": []}
    assert any("between runs of one config" in n for n in data["notes"])
    r = sleuth_cli("profile", "diff", str(runs / "a"), str(runs / "b"), "--repeat-b",
                   str(runs / "nowhere"))
    assert r.returncode == 2 and "--repeat-b" in r.stderr and "Traceback" not in r.stderr
    r = sleuth_cli("profile", str(runs / "a"), "--repeat-a", str(runs / "c1"))
    assert r.returncode == 2 and "sleuth profile diff A B --repeat-a" in r.stderr


@pytest.mark.slow
def test_unreadable_profile_is_exit_2_in_one_line(sleuth_cli, tmp_path):
    """A profile of three tiny steps is enough to read: this test of the quick lane does not
    wait on the pairs the timing tests profile."""
    from profiler import Collector, CollectorConfig
    from profiler_testkit import train

    good = tmp_path / "good"
    cfg = CollectorConfig(wait=0, warmup=1, active=2, activities=("cpu",), count_flops=False)
    with Collector(good, config=cfg) as c:
        train(3, c)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    trace = bad / "profile" / "rank0" / "window0.trace.json.gz"
    trace.write_bytes(gzip.compress(b'{"traceEvents": [')[:-8])
    for args in (("profile", "diff", str(good), str(bad)),
                 ("profile", "diff", str(good), str(tmp_path / "missing")),
                 ("profile", "diff", str(good), str(tmp_path))):
        r = sleuth_cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = sleuth_cli("profile", "diff", str(good))
    assert r.returncode == 2 and "sleuth profile diff A B" in r.stderr
