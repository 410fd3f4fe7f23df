"""`sleuth ir`: in-process through sleuth.cli.main, and the process boundary once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sleuth.cli import main

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _models_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def test_factory_writes_requested_stages_and_formats(tmp_path, capsys):
    code = main(["ir", "irdump_models:make_tiny", "--input-shape", "2,16", "--out",
                 str(tmp_path), "--stages", "backward", "forward_eager", "--formats", "ir", "dot",
                 "--depth", "1", "--json"])
    assert code == 0
    paths = json.loads(capsys.readouterr().out)
    assert [Path(p).name for p in paths] == ["02_backward.ir", "02_backward.dot",
                                             "03_forward_eager.ir", "03_forward_eager.dot"]
    dot = (tmp_path / "03_forward_eager.dot").read_text()
    assert 'label="layers.0 (Block)\\n' in dot  # depth 1: level-2 modules collapsed


def test_integer_inputs_and_preset(tmp_path, capsys):
    pytest.importorskip("trainer")
    code = main(["ir", "--preset", "tiny", "--out", str(tmp_path), "--stages", "forward_eager",
                 "--formats", "ir"])
    assert code == 0
    text = (tmp_path / "03_forward_eager.ir").read_text()
    assert "# entry: GPT" in text and "int64[2,64]" in text
    assert "aten.embedding" in text


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    assert main(["ir", "no_such_module_xyz:make", "--input-shape", "2"]) == 2
    assert "cannot import 'no_such_module_xyz'" in capsys.readouterr().err
    assert main(["ir", "irdump_models:make_tiny"]) == 2
    assert "--input-shape is required" in capsys.readouterr().err
    assert main(["ir", "irdump_models:make_tiny", "--input-shape", "2,16", "--dtype", "flot",
                 "--out", str(tmp_path)]) == 2
    assert "unknown --dtype 'flot'" in capsys.readouterr().err


def test_help_in_a_subprocess_does_not_import_torch(sleuth_cli):
    proc = sleuth_cli("ir", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "MODULE:FACTORY" in proc.stdout and "--input-shape" in proc.stdout
    code = ("import sys\nfrom sleuth.cli import main\ntry:\n    main(['ir', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env["PYTHONPATH"] = str(HERE.parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.stderr.strip().splitlines()[-1] == "False"
