"""Profiler and summaries for PyTorch training runs: trace collection, tables, scalars, histograms.

Public names are loaded lazily (PEP 562) so `import profiler` imports neither torch nor pandas;
each entry maps a public name to the private module that defines it. A test pins this list.
"""
from __future__ import annotations

from sleuth.common import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    # collection
    "Collector": "profiler._collector",
    "CollectorConfig": "profiler._config",
    "schedule_action": "profiler._config",
    # summaries
    "SummaryWriter": "profiler._summary",
    "SummaryCapReached": "profiler._summary",
    # zero-code attach
    "attach_from_env": "profiler._attach",
    # reading
    "Profile": "profiler._reader",
    "read_profile": "profiler._reader",
    "read_scalars": "profiler._summary_reader",
    "read_histograms": "profiler._summary_reader",
    "summary_lines": "profiler._text",
    # comparing two runs
    "ProfileDiff": "profiler._diff",
    "diff_profiles": "profiler._diff",
    # errors
    "ProfilerError": "profiler._errors",
    "ConfigError": "profiler._errors",
    "ProfileFormatError": "profiler._errors",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
