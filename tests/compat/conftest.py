"""The compatibility suite's runs, started once per session and shared by every check."""
from __future__ import annotations

import pytest

import compat_kit


@pytest.fixture(scope="session")
def compat_run(tmp_path_factory):
    """A function (framework, kind) -> compat_kit.Run that runs each pair once."""
    root = tmp_path_factory.mktemp("compat")
    done: dict[tuple[str, str], compat_kit.Run | AssertionError] = {}

    def get(fw: compat_kit.Framework, kind: str) -> compat_kit.Run:
        if (fw.name, kind) not in done:
            try:
                done[fw.name, kind] = compat_kit.run(fw, root, kind)
            except AssertionError as e:  # a failed run fails every check that needs it
                done[fw.name, kind] = e
        result = done[fw.name, kind]
        if isinstance(result, AssertionError):
            raise result
        return result

    return get
