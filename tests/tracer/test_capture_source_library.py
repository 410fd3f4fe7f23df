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

        def forward(self, x):
            h = self.fc(x)
            return torch.tanh(h) * 2  # LIBRARY LINE
""")


@pytest.fixture
def library(tmp_path, monkeypatch):
    """`fakelib.model.LibraryNet`, imported from a temporary `site-packages` folder."""
    root = tmp_path / "lib" / "site-packages"
    (root / "fakelib").mkdir(parents=True)
    (root / "fakelib" / "__init__.py").write_text("")
    (root / "fakelib" / "model.py").write_text(_MODEL)
    monkeypatch.syspath_prepend(str(root))
    for cache in ("_internal", "_formatted", "_relpath"):
        monkeypatch.setattr(_source, cache, {})
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # the library is not under the current directory
    yield importlib.import_module("fakelib.model")
    sys.modules.pop("fakelib.model", None)
    sys.modules.pop("fakelib", None)


@pytest.mark.parametrize("level", ["mix", "module"])
def test_records_name_the_library_models_lines(library, tmp_path, level):
    torch.manual_seed(0)
    model = library.LibraryNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"path": str(tmp_path / "run"), "level": level, "writer": "sync"}
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
