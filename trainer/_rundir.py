"""The run directory as the trainer sees it: run.json, metrics files, checkpoint paths, atomic writes.

`write_run_json` is public because the CLI also records runs of other people's scripts
(`sleuth run`) with it. A run's id is made and read back by the rule every tool shares
(`sleuth.common`: `new_run_id`, `read_run_id`), which the trainer's face re-exports.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from sleuth.common import atomic_file, new_run_id, open_regular, read_run_id

FORMAT_VERSION = "1.0"


def atomic_write_text(path: Path, text: str, *, exclusive: bool = False) -> None:
    """Write `text` to `path` whole: readers see the old file or the whole new one (the door's
    atomic_file, sleuth.common).

    With `exclusive`, the file is linked into place instead, which fails (FileExistsError, the
    partial file removed) when `path` exists: of two processes that both found it missing, one
    wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not exclusive:
        with atomic_file(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(partial, path)
    finally:
        partial.unlink()


def write_run_json(run_dir: str | Path, *, name: str, argv: Sequence[str], world_size: int,
                   config: dict[str, Any], run_id: str = "", exclusive: bool = False) -> Path:
    """Write `RUN/run.json` (atomically) describing who made the run, and return its path.

    Args:
        run_dir: the run directory (created if missing).
        name: the run's name.
        run_id: the run's id, which every other file of the run carries too (`new_run_id`).
        argv: the command line that started it.
        world_size: number of processes.
        config: the resolved configuration, JSON-serialisable.
        exclusive: a new run claims the directory: another process that wrote run.json since
            the directory was checked (two runs started into one new directory) wins.

    Raises:
        OtherRunError: with `exclusive`, run.json exists.
    """
    record = {
        "format_version": FORMAT_VERSION,
        "run_id": run_id,
        "name": name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv),
        "world_size": world_size,
        "versions": {"torch": _torch_version(), "sleuth": _sleuth_version(),
                     "python": platform.python_version()},
        "config": config,
    }
    path = Path(run_dir) / "run.json"
    try:
        atomic_write_text(path, json.dumps(record, indent=2, sort_keys=False) + "\n",
                          exclusive=exclusive)
    except FileExistsError as e:
        from trainer._errors import OtherRunError

        raise OtherRunError(f"{path} was written by another run started into {run_dir} at the "
                            f"same time as this one (run {run_id}); pick another run directory"
                            ) from e
    return path


def _torch_version() -> str:
    # `sleuth run` writes run.json before its command starts and never needs torch itself:
    # importing it only for the version costs seconds of CPU
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "unknown"


def _sleuth_version() -> str:
    # from the installed distribution: the trainer must not import the `sleuth` CLI package
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sleuth")
    except PackageNotFoundError:
        return "unknown"


class RunDir:
    """Paths inside one run directory for one rank; files other ranks must not share get a suffix."""

    def __init__(self, path: str | Path, *, rank: int = 0) -> None:
        self.path = Path(path)
        self.rank = rank

    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    @property
    def metrics(self) -> Path:
        """metrics.jsonl for rank 0, metrics.rank{R}.jsonl for the others."""
        return self.path / ("metrics.jsonl" if self.rank == 0 else f"metrics.rank{self.rank}.jsonl")

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def data_cache(self) -> Path:
        """Where the demo corpus is written (per rank, so ranks never race on one file)."""
        return self.path / "data" / f"rank{self.rank}"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step{step}"

    def latest_checkpoint(self) -> Path | None:
        """The complete checkpoint with the highest step, or None."""
        steps = []
        if self.checkpoints.is_dir():
            for p in self.checkpoints.iterdir():
                if p.name.startswith("step") and p.name[4:].isdigit() and (p / "meta.json").is_file():
                    steps.append(int(p.name[4:]))
        return self.checkpoint(max(steps)) if steps else None

    def open_metrics(self, run_id: str = "", resume_step: int | None = None) -> TextIO:
        """Open the metrics file for appending; a new file starts with a format header line
        naming the run. A file of another run is refused (OtherRunError), never appended to.

        `resume_step`: the run continues from a checkpoint of that step, so the lines of steps
        from there on (logged after the checkpoint, before the run stopped) are dropped first:
        the resumed run logs them again, and a curve must not hold a step twice."""
        self.path.mkdir(parents=True, exist_ok=True)
        new = not self.metrics.exists() or self.metrics.stat().st_size == 0
        if not new:
            _check_header(self.metrics, run_id)
            if resume_step is not None:
                _drop_steps_from(self.metrics, resume_step)
        f = open(self.metrics, "a", encoding="utf-8")
        if new:
            f.write(json.dumps({"format_version": FORMAT_VERSION, "kind": "sleuth.trainer.metrics",
                                "run_id": run_id}) + "\n")
            f.flush()
        return f


def _drop_steps_from(path: Path, step: int) -> None:
    """Rewrite the metrics file at `path` (atomically) without the lines of `step` and later."""
    kept, dropped = [], 0
    with _open_text(path) as f:
        for line in f:
            try:
                value = json.loads(line).get("step")
            except (ValueError, AttributeError, RecursionError):
                value = None  # the header, or a line this reader does not judge: kept
            if isinstance(value, int) and value >= step:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        atomic_write_text(path, "".join(kept))


def _header_id(path: Path) -> str:
    """The run id in a metrics file's header line ("" before run ids)."""
    with _open_text(path) as f:
        try:
            first = f.readline(1 << 20)
            header = json.loads(first)
        except (ValueError, RecursionError):  # not UTF-8, not JSON: a header naming no run
            return ""
    run_id = header.get("run_id", "") if isinstance(header, dict) else ""
    return run_id if isinstance(run_id, str) else ""


def _check_header(path: Path, run_id: str) -> None:
    """OtherRunError when the metrics file at `path` names a run other than `run_id` (files
    written before run ids name none and are not checked)."""
    from trainer._errors import OtherRunError

    found = _header_id(path)
    if found and run_id and found != run_id:
        raise OtherRunError(f"{path} holds the metrics of run {found}, not of run {run_id}: the "
                            f"run directory mixes two runs; read each run from its own folder "
                            f"(train with --overwrite or another --run-dir)")


def read_metrics(run_dir: str | Path, rank: int = 0) -> list[dict[str, Any]]:
    """The metric lines of a run (step lines and eval lines), header excluded.

    Raises:
        OtherRunError: the metrics file names another run than run.json does.
        TrainerError: a line is not JSON (named by its number).
    """
    path = RunDir(run_dir, rank=rank).metrics
    owner = read_run_id(run_dir)
    if owner:
        _check_header(path, owner)
    from trainer._errors import TrainerError

    lines, number = [], 1
    try:
        with _open_text(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    lines.append(json.loads(line))
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser
        raise TrainerError(f"{path}: line {number} is damaged ({type(e).__name__}: {e}); it is "
                           f"not a metrics line the trainer wrote: restore the file, or move it "
                           f"away") from e
    return [d for d in lines if isinstance(d, dict) and "step" in d]


def _open_text(path: Path) -> TextIO:
    """A metrics file open for reading through the door (sleuth.common.open_regular): a FIFO
    in its place is refused, never waited on (UntrustedFileError naming it)."""
    import io

    return io.TextIOWrapper(open_regular(path), encoding="utf-8")
