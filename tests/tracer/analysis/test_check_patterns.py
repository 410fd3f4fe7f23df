"""Patterns a dump's config brought with it (`nan_allow`): globs and regular expressions match as
users write them, and a regular expression that backtracks without end is stopped by the time
bound with one message naming the file."""
from __future__ import annotations

import time

import pytest

from tracer._errors import UntrustedFileError
from tracer.analysis import _patterns
from tracer.analysis._patterns import stored_matches

NAMES = ["layers.0.attn.forward.0.output.0", "head.forward.0.output.0",
         "mask::aten.masked_fill.forward.0.output.0"]


def test_globs_and_regexes_match_as_written():
    assert stored_matches(["*::aten.masked_fill.forward.*"], NAMES, "f.h5") == {NAMES[2]}
    assert stored_matches(["re:^head\\."], NAMES, "f.h5") == {NAMES[1]}
    assert stored_matches(["re:attn", "head.*"], NAMES, "f.h5") == {NAMES[0], NAMES[1]}
    assert stored_matches([], NAMES, "f.h5") == set()


def test_backtracking_regex_is_stopped(monkeypatch):
    monkeypatch.setattr(_patterns, "PATTERN_SECONDS", 1.0)
    start = time.monotonic()
    with pytest.raises(UntrustedFileError, match=r"step0\.h5: refused: .*did not finish"):
        stored_matches([r"re:^((\w|\.)+)+!$"], ["transformer.ln_f.bias.optimizer.0.update.0"],
                       "RUN/dump/rank0/step0.h5")
    assert time.monotonic() - start < 10
