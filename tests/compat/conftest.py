"""The compatibility suite's runs, started once per session and shared by every check."""
from __future__ import annotations

import pytest

import compat_kit


@pytest.fixture(scope="session")
def compat_run(tmp_path_factory):
    """A function (framework, kind) -> compat_kit.Run that runs each pair once."""
    root = tmp_path_factory.mktemp("compat")
    done: dict[tuple[str, str], compat_kit.Run] = {}

    def get(fw: compat_kit.Framework, kind: str) -> compat_kit.Run:
        if (fw.name, kind) not in done:
            done[fw.name, kind] = compat_kit.run(fw, root, kind)
        return done[fw.name, kind]

    return get
