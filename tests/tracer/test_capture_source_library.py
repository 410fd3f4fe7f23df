"""Source lines in a model whose code is installed (site-packages), as a Hugging Face model's
is: records name the model's own lines, not the training script's call."""
from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

import tracer
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
    call_site = f"{__file__}:{n}"  # absolute: the library fixture works in another folder
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
