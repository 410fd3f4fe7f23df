"""`sleuth audit` (one run's ops against float64, no reference) and `sleuth explain --repro`
(a one-op script and its inputs, runnable without sleuth)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.cli import main
from tests.tracer.analysis.test_explain import _dump_llama
from tracer.analysis import audit

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("audit")
    return {"a": _dump_llama(root / "a"), "eps": _dump_llama(root / "eps", eps=1e-2),
            "bf16": _dump_llama(root / "bf16", bf16=True)}


@pytest.mark.slow
def test_audit_ranks_ops_by_their_error_against_float64(runs):
    full = audit(runs["a"])
    assert full.calls > 100 and len(full.table) > 100
    assert full.table["units"].is_monotonic_decreasing
    assert full.table["units"].max() < 64  # float32 ops stay near their dtype's roundoff
    half = audit(runs["bf16"])
    low = half.table[half.table["dtype"] == "bfloat16"]
    assert len(low) and low["rel_error"].max() > 100 * full.table["rel_error"].max()
    # where the bf16 run loses precision: its bf16 ops, at the top by error
    top = half.table.sort_values("rel_error", ascending=False).head(5)
    assert (top["dtype"] == "bfloat16").all()


@pytest.mark.slow
def test_audit_command_line(runs, capsys, tmp_path):
    assert main(["audit", str(runs["bf16"]), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "op call(s) re-run in float64" in out and "losing the most precision" in out
    assert main(["audit", str(runs["a"]), "--json", "--csv", str(tmp_path / "a.csv")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["replayed"] == data["calls"] and data["ops"][0]["units"] >= data["ops"][-1]["units"]
    assert (tmp_path / "a.csv").read_text().startswith("name,op,module")
    assert main(["audit", str(runs["a"]), "--step", "7"]) == 2
    assert "has no step 7" in capsys.readouterr().err


@pytest.mark.slow
def test_a_repro_runs_without_sleuth_and_shows_the_bug(runs, tmp_path, capsys):
    out = tmp_path / "repro"
    assert main(["explain", str(runs["a"]), str(runs["eps"]), "--repro", str(out)]) == 1
    assert "repro written" in capsys.readouterr().out
    script = out / "repro_aten_add.py"
    assert script.is_file() and (out / "repro_aten_add.h5").is_file()
    text = script.read_text()
    assert "torch.ops.aten.add.Tensor(x[0], 1e-06)" in text
    assert "torch.ops.aten.add.Tensor(x[0], 0.01)" in text and "sleuth" not in text.split(
        '"""', 2)[2]  # the code after the docstring imports no sleuth
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = {k.strip().rstrip(":"): v for k, v in
             (line.split("relative error") for line in run.stdout.splitlines())}
    assert float(lines["A's call on A's inputs vs A's recorded output"]) == 0.0
    assert float(lines["B's call on A's inputs vs A's recorded output"]) > 1.0


@pytest.mark.slow
def test_no_repro_for_precision(runs, tmp_path, capsys):
    assert main(["explain", str(runs["a"]), str(runs["bf16"]), "--repro",
                 str(tmp_path / "r")]) == 1
    assert "no repro: the verdict is precision" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()


def test_no_repro_when_the_op_is_blamed_for_its_input(tmp_path, capsys):
    """Operands swapped: the op computes right on what it gets; the repro would show nothing,
    so none is written and the line is named instead."""
    from tests.tracer.analysis.test_explain import _dump_cnn

    a, b = _dump_cnn(tmp_path / "a"), _dump_cnn(tmp_path / "swap", swap=True)
    assert main(["explain", str(a), str(b), "--repro", str(tmp_path / "r")]) == 1
    assert "no repro: the op is blamed for the input it receives" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()
