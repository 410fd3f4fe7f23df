"""The fault zoo (fault_zoo.py): on five Hugging Face families built from configs at the
installed transformers release, a fault injected at a site a seeded generator picks must be
named by diff, explain and check: the right module, op, phase, line and verdict, at level op and
mix. The fast lane (`-m "not slow"`) runs every fault class once, at level op on one family
per class (picked by the generator); the `slow` sweep, which CI runs, every other family and
level."""
from __future__ import annotations

import zlib

import pytest

from fault_zoo import FAMILIES, FAULTS, Case, dump_pair, in_site

pytest.importorskip("transformers")

ALL = [Case(f, fault, level) for f in FAMILIES for fault in FAULTS for level in ("op", "mix")]


def _fast(case: Case) -> bool:
    families = sorted(FAMILIES)
    return case.level == "op" and \
        case.family == families[zlib.crc32(case.fault.encode()) % len(families)]


CASES = [pytest.param(c, id=c.id, marks=() if _fast(c) else pytest.mark.slow) for c in ALL]


@pytest.mark.parametrize("case", CASES)
def test_the_fault_is_named_where_it_sits(case: Case, tmp_path) -> None:
    from tracer.analysis import check, diff, explain

    pair = dump_pair(case, tmp_path)
    fault = pair.fault
    first = diff(pair.a, pair.b).first_divergence
    assert first is not None, "diff found no divergence"
    e = explain(pair.a, pair.b)
    where = f"site {pair.site}; diff's first divergence {first['name']}; explain: {e.verdict}"
    assert e.status == fault.verdict, where
    if fault.verdict == "bug":
        blamed = e.blamed
        assert blamed is not None and in_site(blamed["module"], pair.site), where
        assert blamed["phase"] == fault.phase, where
        if fault.op is not None:
            assert blamed["op"] == fault.op, where
        if pair.line is not None:
            # the faulty line, as the source, or as the caller of a library's line (a
            # transformers Conv1D the faulty line calls)
            line = f"fault_zoo.py:{pair.line}"
            assert blamed["source"].endswith(line) or \
                (blamed.get("caller") or "").endswith(line), where
    elif fault.verdict == "precision":
        assert e.blamed is None and "bfloat16" in e.verdict, where
    if case.fault == "nan":
        origin = check(pair.b).attrs["first_nan"]
        assert origin is not None and in_site(origin["module"], pair.site), origin
        assert origin["source"].endswith(f"fault_zoo.py:{pair.line}"), origin
    else:
        assert check(pair.a).attrs["first_nan"] is None
