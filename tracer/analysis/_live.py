"""`tracer.LiveReference`: a run compared with a known-good dump while it trains.

A Dumper given a `LiveReference` tells it each step it has written; the reference compares
that step file with its own dump's step of the same number and rank by `tracer.diff` itself
(the same pairing, tolerances and first-divergence order, so the record named live is the
record `sleuth diff` names afterwards), and at the first record out of tolerance says so in
one line on stderr, keeps it in ``RUN/dump/rank{R}/live_reference.json`` and, when asked, ends
the run (`tracer.ReferenceDiverged`, exit code `REFERENCE_EXIT`).

The comparison reads the step file back once it is on disk, at the step boundary after it is
written: with the synchronous writer the step that just ended, with the asynchronous writer
(whose file is written while the next step trains) the step before it; the last steps are
compared when the Dumper closes. Nothing runs per record: a Dumper without a reference pays
one attribute test per step.

This module sits on the judging side (it runs the diff); the Dumper only calls the two methods
of the protocol below, so a traced run without a reference never imports it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

from sleuth.common import atomic_file, describe_error, go_off
from tracer._errors import REFERENCE_EXIT, ConfigError, ReferenceDiverged, TracerError
from tracer.analysis._compare import Tolerance
from tracer.analysis._diff import diff
from tracer.storage import READ_ERRORS, open_dump

FORMAT_VERSION = 1
FILE_NAME = "live_reference.json"
ON_DIVERGENCE = ("continue", "stop")
ENV_VAR = "SLEUTH_REFERENCE"
ON_DIVERGENCE_ENV = "SLEUTH_REFERENCE_ON_DIVERGENCE"


class LiveReference:
    """A known-good run a Dumper's steps are compared with as they are written.

    Args:
        run: the reference: a run directory, its dump folder or one rank's folder, dumped with
            the same config (level, mode, steps) as the run it checks.
        tolerance: as `tracer.diff`'s; unset fields take the per-dtype defaults.
        on_divergence: "continue" (default) says the first divergence and goes on; "stop"
            says it and ends the run with `tracer.ReferenceDiverged` (a SystemExit of code
            `REFERENCE_EXIT`, 3).

    A reference that does not exist or does not read is said in one line and compares nothing
    (the run goes on without it); under SLEUTH_STRICT=1 that raises instead. Raises
    ConfigError for an `on_divergence` other than "continue" or "stop".
    """

    def __init__(self, run: str | os.PathLike, *, tolerance: Tolerance | None = None,
                 on_divergence: Literal["continue", "stop"] = "continue") -> None:
        if on_divergence not in ON_DIVERGENCE:
            raise ConfigError(f"on_divergence: expected 'continue' or 'stop', got "
                              f"{on_divergence!r}")
        self.run = Path(run)
        self.tolerance = tolerance or Tolerance()
        self.on_divergence = on_divergence
        self.first_divergence: dict[str, Any] | None = None
        """The first divergent record found (as `DiffResult.first_divergence`), or None."""
        self.compared: list[int] = []
        """The steps compared so far, in order."""
        self._pending: list[tuple[Path, int, int]] = []  # (step file, rank, step) not yet read
        self._missing_said = False
        self._dump: Any = None
        try:
            self._dump = open_dump(self.run)
        except (TracerError, *READ_ERRORS) as e:
            self._off(e, f"reading the reference {self.run}")

    @classmethod
    def from_env(cls) -> LiveReference | None:
        """The reference $SLEUTH_REFERENCE names, stopping the run at a divergence when
        $SLEUTH_REFERENCE_ON_DIVERGENCE is "stop"; None when $SLEUTH_REFERENCE is unset or
        "0". Another $SLEUTH_REFERENCE_ON_DIVERGENCE raises ConfigError."""
        run = os.environ.get(ENV_VAR, "").strip()
        if not run or run == "0":
            return None
        how = os.environ.get(ON_DIVERGENCE_ENV, "").strip() or "continue"
        if how not in ON_DIVERGENCE:
            raise ConfigError(f"${ON_DIVERGENCE_ENV}: expected 'continue' or 'stop', got "
                              f"{how!r}")
        return cls(run, on_divergence=how)  # type: ignore[arg-type]

    @property
    def active(self) -> bool:
        """True while steps are still compared: the reference read, no divergence found yet."""
        return self._dump is not None and self.first_divergence is None

    # -- the protocol the Dumper calls ------------------------------------------------------------
    def step_ended(self, path: str | os.PathLike, rank: int, step: int) -> None:
        """The Dumper ended step `step` of `rank`, whose file is (or will be) `path`."""
        if self.active:
            self._pending.append((Path(path), int(rank), int(step)))

    def judge(self, *, final: bool = False) -> None:
        """Compare every ended step whose file is on disk (`final`: the Dumper closed its
        writer; a step whose file is still missing then was not written and is dropped).
        Raises ReferenceDiverged at a divergence when `on_divergence` is "stop", except at
        `final`: the run is over, and at interpreter exit no exception could set its status."""
        while self._pending and self.active:
            path, rank, step = self._pending[0]
            if not path.is_file():  # the async writer has not renamed it into place yet
                if not final:
                    return
                self._pending.pop(0)
                continue
            self._pending.pop(0)
            self._compare(path, rank, step)
            if self.first_divergence is not None and self.on_divergence == "stop" and not final:
                raise ReferenceDiverged(self._stop_line())
        if final:
            self._pending.clear()

    # -- comparing ------------------------------------------------------------------------------
    def _compare(self, path: Path, rank: int, step: int) -> None:
        if step not in self._dump.steps(rank):
            if not self._missing_said:
                self._missing_said = True
                _say(f"live reference: {self.run} has no step {step} of rank {rank}; steps it "
                     f"lacks are not compared (dump the reference with the same \"steps\" and "
                     f"ranks)")
            return
        try:
            result = diff(self._dump.path(rank, step), path, tolerance=self.tolerance,
                          keep_records=False)
        except (TracerError, *READ_ERRORS) as e:
            self._off(e, f"comparing step {step} with the reference {self.run}")
            return
        self.compared.append(step)
        if result.first_divergence is None:
            if result.status != "same":  # never a silent "no alarm" over what was not judged
                why = "; ".join([p.line() for p in result.problems[:2]] or result.notes[:1])
                _say(f"live reference: step {step} of rank {rank} was not judged whole against "
                     f"{self.run} ({result.status}: {why or 'see sleuth diff'})")
            return
        self.first_divergence = dict(result.first_divergence)
        line = divergence_line(self.first_divergence, step)
        _say(f"{line}; reference {self.run} (rank {rank}); "
             f"{'the run stops' if self.on_divergence == 'stop' else 'the run goes on'}")
        self._keep(path, rank, step, line)

    def _keep(self, path: Path, rank: int, step: int, line: str) -> None:
        """Write the first divergence beside the run's step files, whole or not at all."""
        found = {"format_version": FORMAT_VERSION, "reference": str(self.run.resolve()),
                 "rank": rank, "step": step, "on_divergence": self.on_divergence,
                 "tolerance": {"rtol": self.tolerance.rtol, "atol": self.tolerance.atol,
                               "cosine_min": self.tolerance.cosine_min},
                 "line": line, "first_divergence": self.first_divergence}
        target = path.with_name(FILE_NAME)
        try:
            with atomic_file(target) as f:
                json.dump(found, f, indent=1, default=str)
        except OSError as e:
            _say(f"live reference: the first divergence was not kept in {target}: "
                 f"{describe_error(e)}")

    def _stop_line(self) -> str:
        fd = self.first_divergence or {}
        return (f"live reference: run stopped at step {fd.get('step')} (exit code "
                f"{REFERENCE_EXIT}): {fd.get('name')} diverged from {self.run}")

    def _off(self, error: BaseException, doing: str) -> None:
        self._dump = None
        self._pending.clear()
        go_off(error, tool="live reference", off="the live reference is off",
               doing=doing, stacklevel=3)


def divergence_line(fd: dict[str, Any], step: int) -> str:
    """The first part of the line said at a live divergence: step, record, module, op, phase,
    the user's line, and why the record is out of tolerance."""
    op = fd.get("op") or "-"
    where = fd.get("source") or "unknown source"
    reason = fd.get("reason") or "out of tolerance"
    return (f"live reference: first divergence at step {step}: {fd.get('name')} (module "
            f"{fd.get('module')}, op {op}, phase {fd.get('phase')}, at {where}): {reason}")


def _say(text: str) -> None:
    """A finding is said at once on stderr, one line: not a warning a filter could hide."""
    print(f"sleuth: {text}", file=sys.stderr, flush=True)
