"""The files each Sleuth tool writes into a run directory, named once.

A run directory holds one run (docs/architecture.md, "The run directory"): before a run writes
there, the claim on it (`trainer.claim_run_dir`, used by `sleuth train`, `sleuth run` and
zero-code attach) reads the run id of every file a tool wrote there, and `--overwrite` removes
those files by name and nothing else. Both go by this list, one entry per kind of file with the
tool that writes it; a tool that writes a new kind of file adds it here, or the claim would
neither see it nor remove it. Names are the readers' strict names (`sleuth.common.numbered`):
a look-alike such as `step00.h5` or `rank٠` is no file of a run, so the claim neither reads its
run id nor removes it.
"""
from __future__ import annotations

import re

from sleuth.common._door import numbered


def _names(pattern: str) -> re.Pattern[str]:
    """A whole-name pattern (match it with `.fullmatch`); `{n}` stands for one canonical ASCII
    decimal number."""
    return numbered("(?:" + pattern + ")")


RANK_DIR = _names(r"rank{n}")
"""A rank's folder, under dump/, profile/ and data/ (every tool)."""
# trainer: its record of the run, the metrics, the checkpoints, the demo corpus (data/rank{R}/)
RUN_JSON = ("run.json", "run.json.partial")
METRICS = _names(r"metrics(?:\.rank{n})?\.jsonl(?:\.partial)?")
CHECKPOINT_DIR = _names(r"step{n}(?:\.partial)?")
CHECKPOINT_FILES = ("model.pt", "trainer.pt", "adapter.pt", "meta.json")
CORPUS = re.compile(r"demo_\w+_(?:train\.jsonl|val\.parquet)(?:\.[0-9]+\.partial)?", re.ASCII)
# tracer: dump/dump.json and dump/rank{R}/ (step files, their partials, the flight recorder,
# notes, the rank lock)
DUMP_TOP = _names(r"dump\.json(?:\..+\.partial)?")
DUMP_FILE = _names(r"step{n}\.h5(?:\.data)?(?:\.partial)?|flight_recorder\.h5(?:\.partial)?"
                   r"|notes\.jsonl|\.lock(?:\..+\.partial)?")
STEP_FILE = _names(r"step{n}\.h5")
# profiler: summary/rank{R}[.seg{N}].h5 and profile/rank{R}/ (windows, their metadata)
SUMMARY = _names(r"rank{n}(?:\.seg{n})?\.h5")
PROFILE_FILE = _names(r"\.?window{n}\..+")
WINDOW_META = _names(r"window{n}\.json")
# irdump: ir/{stage:02d}_{name}.ir, .sorted.ir, .dot, .svg
IR_FILE = re.compile(r"[0-9]{2}_\w+?(?:\.sorted\.ir|\.ir|\.dot|\.svg)(?:\.partial)?", re.ASCII)
