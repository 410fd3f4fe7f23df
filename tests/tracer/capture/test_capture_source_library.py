"""Source lines in a model whose code is installed (site-packages), as a Hugging Face model's
is: records name the model's own lines, not the training script's call."""
from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

import tracer
from sleuth.common import _user_line, short_path
from tracer.capture import _source

_MODEL = textwrap.dedent("""
    import torch
    from torch import nn


    class LibraryNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = 2.0

        def forward(self, x):
            h = self.fc(x)
            return torch.tanh(h) * self.scale  # LIBRARY LINE
""")


@pytest.fixture
def library(tmp_path, monkeypatch):
    """`fakelib.model.LibraryNet`, imported from a temporary `site-packages` folder."""
    root = tmp_path / "lib" / "site-packages"
    (root / "fakelib").mkdir(parents=True)
    (root / "fakelib" / "__init__.py").write_text("")
    (root / "fakelib" / "model.py").write_text(_MODEL)
    monkeypatch.syspath_prepend(str(root))
    for cache in ("_internal", "_formatted", "_relpath", "_sited"):
        monkeypatch.setattr(_source, cache, {})
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # the library is not under the current directory
    yield importlib.import_module("fakelib.model")
    sys.modules.pop("fakelib.model", None)
    sys.modules.pop("fakelib", None)


@pytest.mark.parametrize("level,writer", [("mix", "sync"), ("module", "sync"),
                                          ("mix", "async")])
def test_records_name_the_library_models_lines(library, tmp_path, level, writer):
    torch.manual_seed(0)
    model = library.LibraryNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"path": str(tmp_path / "run"), "level": level, "writer": writer}
    with tracer.Dumper(model, config):
        model(torch.randn(2, 4)).sum().backward()  # SCRIPT LINE
        opt.step()
    stats = tracer.open_dump(tmp_path / "run").stats(rank=0, step=0)
    lines = _MODEL.splitlines()
    by_name = dict(zip(stats["name"], stats["source"]))
    if level == "mix":  # an op of the model's forward: the model's own line
        source = by_name["<root>::aten.tanh.forward.0.output.0"]
        path, line = source.rsplit(":", 1)
        assert path == "fakelib/model.py" and "LIBRARY LINE" in lines[int(line) - 1]
    # the child's call site is the model's line too; the root's call is the script's
    path, line = by_name["fc.forward.0.output.0"].rsplit(":", 1)
    assert path == "fakelib/model.py" and "self.fc(x)" in lines[int(line) - 1]
    path, line = by_name["<root>.forward.0.output.0"].rsplit(":", 1)
    assert path.endswith("test_capture_source_library.py")
    with open(__file__) as f:
        assert "SCRIPT LINE" in f.read().splitlines()[int(line) - 1]
    # the user's call site: the script's line for records made in the library, "" where the
    # source is the script's own line
    callers = dict(zip(stats["name"], stats["caller"]))
    script = by_name["<root>.forward.0.output.0"]
    assert callers["fc.forward.0.output.0"] == script
    assert callers["<root>.forward.0.output.0"] == ""
    assert callers["fc.weight.optimizer.0.param.0"] == ""
    if level == "mix":
        assert callers["<root>::aten.tanh.forward.0.output.0"] == script
        assert callers["fc::aten.addmm.forward.0.output.0"] == script
        backward = stats[stats.phase == "backward"]
        assert len(backward) and set(backward.source) == {script}
        assert set(backward.caller) == {""}


def _library_run(library, run, scale):
    torch.manual_seed(0)
    model = library.LibraryNet()
    model.scale = scale
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracer.Dumper(model, {"path": str(run), "level": "op", "writer": "sync"}):
        model(torch.randn(2, 4)).sum().backward()  # CALL SITE
        opt.step()


def test_dump_show_and_diff_show_the_call_site(library, tmp_path, capsys):
    from sleuth.cli import main

    _library_run(library, tmp_path / "a", scale=2.0)
    _library_run(library, tmp_path / "b", scale=3.0)  # the library's mul differs first
    with open(__file__) as f:
        n = next(i for i, text in enumerate(f.read().splitlines(), 1)
                 if "# CALL SITE" in text and "next(" not in text)
    # the library fixture works in another folder: printed from the sys.path entry holding it
    call_site = f"{short_path(__file__)}:{n}"
    assert main(["dump", "show", str(tmp_path / "a"), "--filter", "fc::aten.addmm.*"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[-2:] == ["source", "caller"]
    assert out[2].split()[-1] == call_site and out[2].split()[-2].startswith("fakelib/model.py:")
    result = tracer.diff(tmp_path / "a", tmp_path / "b")
    fd = result.first_divergence
    assert fd["name"] == "<root>::aten.mul.forward.0.output.0"
    assert fd["source"].startswith("fakelib/model.py:") and fd["caller"] == call_site
    assert set(result.records.caller) == {call_site, ""}
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert f"called from {call_site}" in capsys.readouterr().out


def test_a_library_inside_the_standard_librarys_folder_is_still_the_models_code(
        library, tmp_path, monkeypatch):
    """pyenv, python.org and conda installs keep site-packages inside the standard library's
    folder (lib/python3.X/site-packages): a library there is the model's code, not Python's."""
    monkeypatch.setattr(_user_line, "_STDLIB", str(tmp_path / "lib") + "/")
    torch.manual_seed(0)
    model = library.LibraryNet()
    with tracer.Dumper(model, {"path": str(tmp_path / "run"), "level": "op"}):
        model(torch.randn(2, 4)).sum().backward()
    stats = tracer.open_dump(tmp_path / "run").stats(rank=0, step=0)
    source = dict(zip(stats["name"], stats["source"]))["<root>::aten.tanh.forward.0.output.0"]
    path, line = source.rsplit(":", 1)
    assert path == "fakelib/model.py" and "LIBRARY LINE" in _MODEL.splitlines()[int(line) - 1]


def test_a_hugging_face_models_ops_name_its_modeling_file(tmp_path):
    """The same, on transformers as pip installed it here, wherever its site-packages lies."""
    import logging

    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with tracer.Dumper(model, {"path": str(tmp_path), "level": "op", "phases": "forward"}):
        model(input_ids=ids)  # THE CALL
    stats = tracer.open_dump(tmp_path).stats(rank=0, step=0)
    norm = stats[(stats["module"] == "model.layers.0.input_layernorm")
                 & (stats["phase"] == "forward")]
    assert len(norm) and all(s.startswith("transformers/models/llama/modeling_llama.py:")
                             for s in norm["source"])
    assert all(c.endswith("test_capture_source_library.py:" + str(_line("# THE CALL")))
               for c in norm["caller"])


def _line(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f.read().splitlines(), 1)
                    if text in line and "_line(" not in line)
