"""`profiler.diff_profiles` names an injected slowdown first in models we did not write: a
Hugging Face Llama with gradient checkpointing turned on (a recompute), a Hugging Face GPT-2
whose logits a hook upcasts to float64 (a new cast), and a Hugging Face ResNet (a
torchvision-style CNN) trained on a smaller batch accumulated to the same size (more, smaller
calls). Each pair of runs is profiled one after the other in one process
(tests/profiler/slow_models.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import profiler

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def profile_pair(kind: str, tmp_path: Path) -> tuple[Path, Path]:
    """The base run and the slowed one, profiled one after the other in one process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]),
           "OMP_NUM_THREADS": "1"}
    dirs = (tmp_path / "a", tmp_path / "b")
    out = subprocess.run([sys.executable, str(HERE / "slow_models.py"), kind, *map(str, dirs)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout
    return dirs


def judged_pair(kind: str, tmp_path: Path):
    """The diff of a profiled pair (B slowed on purpose); profiled again, once, when it is not
    judged slower: a shared machine's load can change between the two runs. A
    second "no change beyond noise" is skipped (the diff rightly says it cannot tell: the
    causes are named only for a change the steps show); a verdict of "faster" fails."""
    d = profiler.diff_profiles(*profile_pair(kind, tmp_path / "first"))
    if d.verdict != "slower":
        d = profiler.diff_profiles(*profile_pair(kind, tmp_path / "again"))
        if d.verdict == "no change":
            pytest.skip(f"the machine was too busy to time the steps: {d.headline()}")
    return d


def _line_of(cause: str) -> int:
    """The first line number a cause names in slow_models.py (several lines: `:53,60; ...`;
    a cause's text may carry shapes such as `[[8,3,32,32],[8,3,7,7]]` right after the line)."""
    found = re.search(r"slow_models\.py:(\d+)", cause)
    assert found, f"no line of slow_models.py in: {cause}"
    return int(found.group(1))


def test_llama_recompute_named_first(tmp_path):
    d = judged_pair("llama", tmp_path)
    assert d.verdict == "slower" and d.exit_code == 1, d.headline()
    # the recompute runs in backward: the first cause names the test's backward line, with
    # calls of the layers' matmuls up (the forward line beside it: backward ops take their
    # forward op's line, and which of the two adds more a step is the machine's to say); a
    # decoder layer's module is called twice a step
    first = d.causes[0]
    assert "slow_models.py:" in first and "calls" in first, d.causes
    text = (HERE / "slow_models.py").read_text().splitlines()
    lines = [int(m) for m in re.findall(r"slow_models\.py:(\d+)", first.split(" (")[0])]
    assert any("loss.backward()" in text[n - 1] for n in lines), first
    assert any(m.calls_b >= 2 * m.calls_a > 0 for m in d.modules.itertuples()
               if m.module.startswith("model.layers.")), d.modules.head()


def test_gpt2_new_cast_named_first(tmp_path):
    d = judged_pair("gpt2", tmp_path)
    assert d.verdict == "slower", d.headline()
    first = d.causes[0]
    line = _line_of(first)
    assert "output.double()" in (HERE / "slow_models.py").read_text().splitlines()[line - 1], first
    assert "in B only" in first
    only = d.ops[(d.ops["side"] == "B only") & d.ops["source"].str.contains("slow_models.py")]
    assert {"aten::_to_copy", "aten::_log_softmax"} <= set(only["name"]), only


def test_resnet_smaller_batch_named_first(tmp_path):
    d = judged_pair("resnet", tmp_path)
    assert d.verdict == "slower", d.headline()
    # the loop's forward or backward line, whose ops run 4 times as often (2 images, not 8)
    first = d.causes[0]
    text = (HERE / "slow_models.py").read_text().splitlines()[_line_of(first) - 1]
    assert "model(pixel_values=" in text or ".backward()" in text, first
    calls = re.search(r"calls ([\d.]+) -> ([\d.]+)", first)
    assert calls and float(calls.group(2)) == 4 * float(calls.group(1)), first
    conv = d.modules.set_index("module").loc["resnet.embedder.embedder.convolution"]
    assert conv["calls_b"] == 4 * conv["calls_a"] > 0
