"""The one line a command prints of its own when it has written a run: what is where.

`sleuth run` and `sleuth train` end with it (on stderr, so the script's own stdout stays the
script's), e.g. `sleuth run: run written to runs/a: dump (3 steps), profile (1 window); next:
sleuth dashboard runs/a`. It counts the files on disk, so it says what
is there, not what was asked for.
"""
from __future__ import annotations

from pathlib import Path

from tracer.storage import RANK_DIR, STEP_FILE, printable


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def dump_part(dump: Path, run_dir: Path) -> str | None:
    """'dump (N steps[, R ranks])' for a dump folder (with its place when it is not the run
    directory's), or a note that it holds no step; None when there is no dump folder."""
    if not dump.is_dir():
        return None
    ranks = [r for r in dump.glob("rank*") if r.is_dir() and RANK_DIR.fullmatch(r.name)]
    steps = {int(m.group(1)) for r in ranks for f in r.iterdir()
             if (m := STEP_FILE.fullmatch(f.name))}
    where = "" if dump == run_dir / "dump" else f" in {printable(dump)}"
    if not steps:
        return (f"no dump step{where} (the dump config's steps were never reached, or the "
                "script never called optimizer.step())")
    ranked = f", {_plural(len(ranks), 'rank')}" if len(ranks) > 1 else ""
    return f"dump ({_plural(len(steps), 'step')}{ranked}){where}"


def written_line(command: str, run_dir: Path, *, dump: Path | None = None,
                 graphs: Path | None = None, also: str = "") -> str:
    """One line naming what the run in `run_dir` holds: `also` (the command's own files), its
    dump (at `dump`, default RUN/dump), profile windows, summary and graphs (at `graphs`,
    default RUN/ir)."""
    parts = [also] if also else []
    dumped = dump_part(dump if dump is not None else run_dir / "dump", run_dir)
    if dumped:
        parts.append(dumped)
    windows = list((run_dir / "profile").glob("rank*/window*.trace.json.gz"))
    if windows:
        parts.append(f"profile ({_plural(len(windows), 'window')})")
    if any((run_dir / "summary").glob("rank*.h5")):
        parts.append("summary")
    graphs = graphs if graphs is not None else run_dir / "ir"
    irs = list(graphs.glob("*.ir")) if graphs.is_dir() else []
    if irs:
        where = "" if graphs == run_dir / "ir" else f" in {printable(graphs)}"
        parts.append(f"graphs ({_plural(len(irs), 'stage')}){where}")
    held = f": {', '.join(parts)}" if parts else ""
    shown = printable(run_dir)
    return f"sleuth {command}: run written to {shown}{held}; next: sleuth dashboard {shown}"
