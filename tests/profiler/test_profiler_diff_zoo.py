"""A zoo of slowdowns for `profiler.diff_profiles`, as a user meets them: a Hugging Face Llama
profiled once, again (a repeat of A's config, passed as `repeat_a`, as `--repeat-a` is) and
once per slowdown class, in one process (tests/profiler/slow_models.py `zoo`), each class
asserting the verdict and the first cause. The classes the other model tests hold (a
recompute, a new cast, a smaller batch accumulated) are not run again here.

- `longer`: the sequence eight times as long: the same ops on larger inputs, said first,
  whatever the machine's load (shapes are read in each run alone);
- `python`: Python work between the ops after backward: time outside any op, first;
- and A against its repeat: no calls or shapes moved, so nothing load cannot move decides.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import profiler
from profiler._diff_causes import LOAD_PROOF, Kind

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CLASSES = ("longer", "python")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, profiler.Profile]:
    """Each run's profile by name (`a`, `a2`, each class), each read once."""
    out = tmp_path_factory.mktemp("zoo")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(HERE / "slow_models.py"), "zoo", str(out),
                           *CLASSES], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, done.stdout
    return {run: profiler.read_profile(out / run) for run in ("a", "a2", *CLASSES)}


def _diff(zoo: dict[str, profiler.Profile], cls: str):
    return profiler.diff_profiles(zoo["a"], zoo[cls], repeat_a=[zoo["a2"]])


def test_a_longer_sequence_is_the_same_ops_on_larger_inputs(zoo):
    d = _diff(zoo, "longer")
    assert d.verdict == "slower" and d.exit_code == 1, d.headline()
    assert d.findings[0].kind == Kind.SHAPES, d.causes
    assert d.causes[0].startswith("the same ops on larger inputs: "), d.causes
    # the same ops at the same site on other shapes are never "in B only" (an op only B
    # dispatches, a kernel chosen for the longer sequence, may be)
    reshaped = {c.name for c in d.findings[0].changes}
    alone = [f for f in d.findings if getattr(f, "side", "") == "B"]
    assert not [f.name for f in alone if f.name in reshaped], d.causes


def test_python_work_between_ops_is_time_outside_any_op(zoo):
    d = _diff(zoo, "python")
    if d.verdict == "no change" and d.judgement.noise > 0.05:
        pytest.skip(f"the machine was too busy to time the steps: {d.headline()}")
    assert d.verdict == "slower", d.headline()
    assert d.findings[0].kind == Kind.OUTSIDE_OPS, d.causes
    assert d.causes[0].startswith("time outside any op: "), d.causes


def test_a_repeat_of_the_config_moves_nothing_load_cannot_move(zoo):
    """Two runs of one config make the same calls on the same shapes: whatever their steps
    say (one run after the other on a busy machine can differ by 10 % and more, which only
    repeats measure), no verdict rests on calls or shapes, and none of them is a cause."""
    d = profiler.diff_profiles(zoo["a"], zoo["a2"])
    assert d.judgement.decided_by == "steps", d.headline()
    assert not any(c.kind in LOAD_PROOF for c in d.findings), d.causes
