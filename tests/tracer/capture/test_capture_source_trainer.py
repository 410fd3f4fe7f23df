"""Source lines inside Sleuth's reference trainer count as user code, installed or not."""
from __future__ import annotations

import os

from sleuth.common import _user_line
from tracer.capture import _source


def test_trainer_frames_are_user_code_and_print_package_relative(monkeypatch, tmp_path):
    # Pretend the packages live in site-packages, as after `pip install .`.
    root = str(tmp_path / "lib" / "site-packages")
    monkeypatch.setattr(_user_line, "_PACKAGES_ROOT", root)
    monkeypatch.setattr(_source, "_internal", {})
    monkeypatch.setattr(_source, "_formatted", {})
    monkeypatch.setattr(_source, "_relpath", {})
    namespace: dict = {}
    code = compile("def step():\n    return user_source(1)\n",
                   os.path.join(root, "trainer", "model.py"), "exec")
    exec(code, {"user_source": _source.user_source}, namespace)
    assert namespace["step"]() == "trainer/model.py:2"

    # another name: code objects that differ only in their file compare equal
    other = compile("def layer():\n    return user_source(1)\n",
                    os.path.join(root, "somelib", "layer.py"), "exec")
    exec(other, {"user_source": _source.user_source}, namespace)
    # other installed code is the user's too (a Hugging Face model's forward), printed from
    # the site-packages folder on
    assert namespace["layer"]() == "somelib/layer.py:2"
