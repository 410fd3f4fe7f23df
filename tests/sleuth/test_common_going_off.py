"""sleuth.common's rule for a tool that fails while it observes a run (warn once and go off,
or raise under SLEUTH_STRICT=1) and the one error root, as every package uses them."""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from sleuth.common import (ConfigError, FormatError, OtherRunError, SleuthError, SleuthWarning,
                           go_off)

ROOT = Path(__file__).resolve().parents[2]


class _ToolError(SleuthError):
    pass


def _said(error: BaseException, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        go_off(error, tool="tool", off="the tool is off", raise_as=_ToolError, **kwargs)
    return [str(c.message) for c in caught if issubclass(c.category, SleuthWarning)]


def test_it_warns_one_line_and_the_run_goes_on(monkeypatch):
    monkeypatch.delenv("SLEUTH_STRICT", raising=False)
    said = _said(OSError(28, "No space left on device"), doing="writing x")
    assert said == ["the tool is off, and the run goes on without it: writing x failed: "
                    "OSError: [Errno 28] No space left on device (SLEUTH_STRICT=1 stops the run "
                    "instead)"]


@pytest.mark.parametrize("value", ["1", " 1 "])
def test_sleuth_strict_raises_the_tools_error_naming_the_cause(monkeypatch, value):
    monkeypatch.setenv("SLEUTH_STRICT", value)
    cause = OSError("disk full")
    with pytest.raises(_ToolError, match=r"^tool: writing x failed: OSError: disk full \("
                       r"SLEUTH_STRICT=1 stops the run here") as e:
        _said(cause, doing="writing x")
    assert e.value.__cause__ is cause


@pytest.mark.parametrize("value", ["", "0", "true", "yes"])
def test_only_one_means_strict(monkeypatch, value):
    """One meaning everywhere: the documented `SLEUTH_STRICT=1`; anything else warns."""
    monkeypatch.setenv("SLEUTH_STRICT", value)
    assert len(_said(OSError("x"))) == 1


def test_a_tools_own_error_is_raised_as_it_is(monkeypatch):
    monkeypatch.setenv("SLEUTH_STRICT", "1")
    own = _ToolError("the folder holds another run's profile")
    with pytest.raises(_ToolError) as e:
        _said(own)
    assert e.value is own


def test_the_caller_may_ask_either_way(monkeypatch):
    monkeypatch.setenv("SLEUTH_STRICT", "1")
    assert len(_said(OSError("x"), raises=False)) == 1
    monkeypatch.delenv("SLEUTH_STRICT")
    with pytest.raises(_ToolError):
        _said(OSError("x"), raises=True)


def test_every_packages_errors_share_one_root_and_the_shared_kinds():
    import dashboard
    import irdump
    import profiler
    import tracer
    import trainer

    for root in (tracer.TracerError, profiler.ProfilerError, irdump.IrDumpError,
                 trainer.TrainerError, dashboard.DashboardError):
        assert issubclass(root, SleuthError), root
    for config in (tracer.ConfigError, profiler.ConfigError, trainer.ConfigError):
        assert issubclass(config, ConfigError) and issubclass(config, ValueError), config
    for other_run in (tracer.OtherRunError, trainer.OtherRunError):
        assert issubclass(other_run, OtherRunError), other_run
    for unreadable in (tracer.DumpFormatError, profiler.ProfileFormatError,
                       irdump.IrFormatError):
        assert issubclass(unreadable, FormatError), unreadable


def test_the_strict_switch_is_read_in_one_module():
    """`SLEUTH_STRICT` is spelled in sleuth.common alone: a tool that read it by its own rule
    would stop, or go on, where the others do not."""
    offenders = []
    for package in ("tracer", "profiler", "irdump", "dashboard", "sleuth", "trainer"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(ROOT / "sleuth" / "common"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value == "SLEUTH_STRICT":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
