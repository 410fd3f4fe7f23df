"""Where records are compared and judged: two dumps aligned and compared (`diff`), watchpoints
checked over a dump (`check`), the first NaN traced to its origin, and numeric headroom. The
recording side (the live watch observer, the flight recorder, the crash hooks) never imports
this package; it imports from them.

Reads dumps through `tracer.storage`'s reader only; `diff` and `check` need no torch. Names load
lazily (sleuth.common.lazy_exports); a test pins this list.
"""
from __future__ import annotations

from sleuth.common import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    # diff
    "DiffResult": "tracer.analysis._diff_result",
    "diff": "tracer.analysis._diff",
    "Tolerance": "tracer.analysis._compare",
    "RankDiffResult": "tracer.analysis._ranks",
    "diff_ranks": "tracer.analysis._ranks",
    "dump_ranks": "tracer.analysis._ranks",
    # a run compared with a known-good dump while it trains
    "LiveReference": "tracer.analysis._live",
    "read_live_reference": "tracer.analysis._live",
    # a bug or rounding: ops re-run on recorded inputs
    "Explanation": "tracer.analysis._explain",
    "explain": "tracer.analysis._explain",
    "NotReplayable": "tracer.analysis._replay",
    "replay": "tracer.analysis._replay",
    "write_repro": "tracer.analysis._repro",
    "AuditResult": "tracer.analysis._audit",
    "audit": "tracer.analysis._audit",
    # two codebases: which module is which
    "ModuleMap": "tracer.analysis._map_file",
    "map_modules": "tracer.analysis._map",
    "read_module_map": "tracer.analysis._map_file",
    # check and the first NaN
    "Coverage": "tracer.analysis._check",
    "TABLE_READ_ERRORS": "tracer.analysis._check",
    "check": "tracer.analysis._check",
    "check_ranks": "tracer.analysis._check_ranks",
    "describe_origin": "tracer.analysis._check",
    "find_first_nan": "tracer.analysis._check",
    "first_nan_origin": "tracer.analysis._check",
    # numeric headroom and its trend over steps
    "HeadroomReport": "tracer.analysis._trend",
    "headroom_trend": "tracer.analysis._trend",
    "record_headroom": "tracer.analysis._headroom",
    # watchpoints (their conditions: tracer._watch_config) and the flight recorder's rows
    "WatchConfig": "tracer.analysis._check",
    "read_flight_recorder": "tracer.analysis._check",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
