"""`tracer.LiveReference`: a run compared with a known-good dump while it trains.

A Dumper given a `LiveReference` tells it each step it has written; the reference compares
that step file with its own dump's step of the same number and rank by `tracer.diff` itself
(the same pairing, tolerances and first-divergence order, so the record named live is the
record `sleuth diff` names afterwards), and at the first record out of tolerance says so in
one line on stderr, keeps it in ``RUN/dump/rank{R}/live_reference.json`` and, when asked, ends
the run (`tracer.ReferenceDiverged`, exit code `REFERENCE_EXIT`).

The comparison reads the step file back once it is on disk (with the synchronous writer at the
end of its step, with the asynchronous writer, whose file is written while the next step
trains, a step later), in a helper process (tracer.analysis._live_judge), so the diff's
Python does not hold the training thread: at each step boundary the run hands it the files
now on disk and takes its answers, waiting only while it is more than `LAG` steps behind; the
last steps are awaited when the Dumper closes. Where the helper cannot run, the same diff runs
in the run's own process. Nothing runs per record: a Dumper without a reference pays one
attribute test per step.

This module sits on the judging side (it runs the diff); the Dumper only calls the two methods
of the protocol below, so a traced run without a reference never imports it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

from sleuth.common import atomic_file, describe_error, go_off, warn
from tracer._errors import (REFERENCE_EXIT, ConfigError, ReferenceDiverged, TracerError,
                            UntrustedFileError)
from tracer.analysis._compare import Tolerance
from tracer.analysis._live_judge import Judge, judged
from tracer.storage import READ_ERRORS, open_dump

FORMAT_VERSION = 1
FILE_NAME = "live_reference.json"
ON_DIVERGENCE = ("continue", "stop")
ENV_VAR = "SLEUTH_REFERENCE"
ON_DIVERGENCE_ENV = "SLEUTH_REFERENCE_ON_DIVERGENCE"
MAP_ENV = "SLEUTH_REFERENCE_MAP"
LAG = 1
"""Steps the judge may be behind the run before a step boundary waits for its answer: a
divergence is said, and a "stop" run ends, at the end of its step or of the next one."""
ANSWER_TIMEOUT_S = 600.0


class LiveReference:
    """A known-good run a Dumper's steps are compared with as they are written.

    Args:
        run: the reference: a run directory, its dump folder or one rank's folder, dumped with
            the same config (level, mode, steps) as the run it checks.
        tolerance: as `tracer.diff`'s; unset fields take the per-dtype defaults.
        on_divergence: "continue" (default) says the first divergence and goes on; "stop"
            says it and ends the run with `tracer.ReferenceDiverged` (a SystemExit of code
            `REFERENCE_EXIT`, 3).
        module_map: a module map file (`sleuth map REFERENCE RUN > FILE`), as `sleuth diff
            --map` takes it, for a run whose code names its modules otherwise than the
            reference's (a port): each step is compared through it, the reference as A.

    A reference that does not exist or does not read is said in one line and compares nothing
    (the run goes on without it); under SLEUTH_STRICT=1 that raises instead. Raises
    ConfigError for an `on_divergence` other than "continue" or "stop", and for a module map
    that does not read (naming the file and what is wrong, as `sleuth diff --map` does).
    """

    def __init__(self, run: str | os.PathLike, *, tolerance: Tolerance | None = None,
                 on_divergence: Literal["continue", "stop"] = "continue",
                 module_map: str | os.PathLike | None = None) -> None:
        if on_divergence not in ON_DIVERGENCE:
            raise ConfigError(f"on_divergence: expected 'continue' or 'stop', got "
                              f"{on_divergence!r}")
        self.module_map: str | None = None
        """The module map file, read here once to refuse a bad one at the start, and by
        the judge (a path crosses to its process; the map's layouts and fused groups with
        it); None without one."""
        if module_map is not None:
            from tracer.analysis._map_file import read_module_map

            read_module_map(module_map, flag="module map")
            self.module_map = str(Path(module_map).resolve())
        self.run = Path(run)
        self.tolerance = tolerance or Tolerance()
        self.on_divergence = on_divergence
        self.first_divergence: dict[str, Any] | None = None
        """The first divergent record found (as `DiffResult.first_divergence`), or None."""
        self.compared: list[int] = []
        """The steps compared so far, in order."""
        self.setup: list[str] = []
        """The setup differences (as `sleuth diff` words them) of the first step that has
        any, or []."""
        self._pending: list[tuple[Path, int, int]] = []  # (step file, rank, step) not yet read
        self._missing_said = False
        self._dump: Any = None
        self._judge: Judge | None = None
        self._judge_failed = False
        self._said_stop = False
        try:
            self._dump = open_dump(self.run)
        except (TracerError, *READ_ERRORS) as e:
            self._off(e, f"reading the reference {self.run}")

    @classmethod
    def from_env(cls) -> LiveReference | None:
        """The reference $SLEUTH_REFERENCE names, stopping the run at a divergence when
        $SLEUTH_REFERENCE_ON_DIVERGENCE is "stop"; None when $SLEUTH_REFERENCE is unset or
        "0"; compared through the module map $SLEUTH_REFERENCE_MAP names, when set. Another
        $SLEUTH_REFERENCE_ON_DIVERGENCE, or a map that does not read, raises ConfigError."""
        run = os.environ.get(ENV_VAR, "").strip()
        if not run or run == "0":
            return None
        how = os.environ.get(ON_DIVERGENCE_ENV, "").strip() or "continue"
        if how not in ON_DIVERGENCE:
            raise ConfigError(f"${ON_DIVERGENCE_ENV}: expected 'continue' or 'stop', got "
                              f"{how!r}")
        mapped = os.environ.get(MAP_ENV, "").strip() or None
        return cls(run, on_divergence=how, module_map=mapped)  # type: ignore[arg-type]

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
        """Hand every ended step whose file is on disk to the judge, and take its answers: at
        most `LAG` steps stay unanswered (`final`: the Dumper closed its writer: none, and a
        step whose file is still missing then was not written and is dropped). Raises
        ReferenceDiverged at a divergence when `on_divergence` is "stop", except at `final`:
        the run is over, and at interpreter exit no exception could set its status."""
        while self._pending and self.active:
            path, rank, step = self._pending[0]
            if not path.is_file():  # the async writer has not renamed it into place yet
                if not final:
                    break
                self._pending.pop(0)
                continue
            self._pending.pop(0)
            self._send(path, rank, step)
        if final:
            self._pending.clear()
        self._collect(0 if final else LAG)
        if final or not self.active:
            self._close_judge()
        if self.first_divergence is not None and self.on_divergence == "stop" and not final \
                and not self._said_stop:
            raise ReferenceDiverged(self._stop_line())

    # -- comparing ------------------------------------------------------------------------------
    def _send(self, path: Path, rank: int, step: int) -> None:
        """Hand step `step` of `rank` to the judge (or compare it here, where no judge runs)."""
        if step not in self._dump.steps(rank):
            if not self._missing_said:
                self._missing_said = True
                _say(f"live reference: {self.run} has no step {step} of rank {rank}; steps it "
                     f"lacks are not compared (dump the reference with the same \"steps\" and "
                     f"ranks)")
            return
        reference = str(self._dump.path(rank, step))
        judge = self._started()
        if judge is not None:
            t = self.tolerance
            try:
                judge.send({"reference": reference, "path": str(path),
                            "tolerance": {"rtol": t.rtol, "atol": t.atol,
                                          "cosine_min": t.cosine_min},
                            "module_map": self.module_map},
                           (reference, path, rank, step))
                return
            except OSError as e:
                self._judge_lost(e)
        if self.active:
            self._compare_here(reference, path, rank, step)

    def _started(self) -> Judge | None:
        """The judge process, started at the first step it is given; None once it failed."""
        if self._judge is None and not self._judge_failed:
            try:
                self._judge = Judge()
            except OSError as e:
                self._judge_lost(e)
        return self._judge

    def _judge_lost(self, error: BaseException) -> None:
        """The judge cannot be used: steps are compared in the run's own process from now on
        (the same diff, paid by the training thread), said once; the steps it was given and
        did not answer first, in their order."""
        self._judge_failed = True
        lost = list(self._judge.waiting) if self._judge is not None else []
        self._close_judge()
        warn(f"live reference: its judge process failed ({describe_error(error)}); steps are "
             f"compared in the run's own process from now on", stacklevel=4)
        for reference, path, rank, step in lost:
            if self.active:
                self._compare_here(reference, path, rank, step)

    def _close_judge(self) -> None:
        judge, self._judge = self._judge, None
        if judge is not None:
            judge.close()

    def _collect(self, keep: int) -> None:
        """Take the judge's answers, waiting while more than `keep` steps are unanswered."""
        judge = self._judge
        if judge is None:
            return
        try:
            answered = judge.answers(keep, ANSWER_TIMEOUT_S)
        except (OSError, ValueError) as e:  # ValueError: an answer that is no JSON
            self._judge_lost(e)
            return
        for (_, path, rank, step), answer in answered:
            if not self.active:
                break  # answers after the first divergence are not needed
            if "error" in answer:
                self._off(TracerError(answer["error"]),
                          f"comparing step {step} with the reference {self.run}")
                break
            self._judged(path, rank, step, answer)

    def _compare_here(self, reference: str, path: Path, rank: int, step: int) -> None:
        try:
            answer = judged(reference, str(path), self.tolerance, self.module_map)
        except (TracerError, *READ_ERRORS) as e:
            self._off(e, f"comparing step {step} with the reference {self.run}")
            return
        self._judged(path, rank, step, answer)

    def _judged(self, path: Path, rank: int, step: int, answer: dict[str, Any]) -> None:
        """What the diff of step `step` found (`judged`): said, and kept at a divergence."""
        self.compared.append(step)
        setup = answer.get("setup") or []
        if setup and not self.setup:
            # said once, before any divergence it causes: the likeliest cause of it
            self.setup = list(setup)
            more = f"; and {len(setup) - 3} more" if len(setup) > 3 else ""
            _say(f"live reference: step {step} of rank {rank} is set up otherwise than "
                 f"{self.run}: {'; '.join(setup[:3])}{more}")
        fd = answer.get("first_divergence")
        if fd is None:
            if answer.get("unjudged"):  # never a silent "no alarm" over what was not judged
                _say(f"live reference: step {step} of rank {rank} was not judged whole against "
                     f"{self.run} ({answer.get('status')}: {answer['unjudged']})")
            return
        self.first_divergence = dict(fd)
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
                 "line": line, "setup": self.setup, "first_divergence": self.first_divergence}
        target = path.with_name(FILE_NAME)
        try:
            with atomic_file(target) as f:
                json.dump(found, f, indent=1, default=str)
        except OSError as e:
            _say(f"live reference: the first divergence was not kept in {target}: "
                 f"{describe_error(e)}")

    def _stop_line(self) -> str:
        self._said_stop = True
        fd = self.first_divergence or {}
        return (f"live reference: the run stops (exit code {REFERENCE_EXIT}): {fd.get('name')} "
                f"diverged from {self.run} at step {fd.get('step')}")

    def _off(self, error: BaseException, doing: str) -> None:
        self._dump = None
        self._pending.clear()
        self._close_judge()
        go_off(error, tool="live reference", off="the live reference is off",
               doing=doing, stacklevel=3)


def divergence_line(fd: dict[str, Any], step: int) -> str:
    """The first part of the line said at a live divergence: step, record, module, op, phase,
    the user's line, and why the record is out of tolerance."""
    op = fd.get("op") or "-"
    where = fd.get("source") or "unknown source"
    reason = fd.get("reason") or "out of tolerance"
    # through a module map the run names the record otherwise (a port): its name too
    theirs = fd.get("b_name")
    port = f"; in this run {theirs}" if theirs and theirs != fd.get("name") else ""
    return (f"live reference: first divergence at step {step}: {fd.get('name')} (module "
            f"{fd.get('module')}, op {op}, phase {fd.get('phase')}, at {where}{port}): {reason}")


def _say(text: str) -> None:
    """A finding is said at once on stderr, one line: not a warning a filter could hide."""
    print(f"sleuth: {text}", file=sys.stderr, flush=True)


def read_live_reference(run: str | os.PathLike) -> list[dict[str, Any]]:
    """What each rank's live reference kept in `run` (`RUN/dump/rank{R}/live_reference.json`,
    the first divergence), in rank order, read through the door: rank folders by their strict
    names, the file bounded and only while it is a regular file inside the run. Each entry is
    the file's object with `rank`; one that does not read, or is not the object this module
    writes, is `{"rank": R, "error": why}`. [] where no rank kept one."""
    from tracer.storage import (RANK_DIR, inside_run, kind_problem, load_bounded, number_of,
                                printable)

    dump = Path(run) / "dump"
    if not dump.is_dir():
        return []
    ranks = sorted((rank, f) for f in dump.iterdir()
                   if (rank := number_of(RANK_DIR, f.name)) is not None)
    out: list[dict[str, Any]] = []
    for rank, folder in ranks:
        path = folder / FILE_NAME
        if not (path.exists() or path.is_symlink()):
            continue
        problem = kind_problem(path)
        why = f"{printable(path)}: {problem}" if problem else None
        if why is None:
            try:
                inside_run(run, path, FILE_NAME)
            except UntrustedFileError as e:
                why = str(e)
        if why:
            out.append({"rank": rank, "error": why})
            continue
        try:
            found = load_bounded(path)
        except (OSError, ValueError, TracerError) as e:
            out.append({"rank": rank, "error": f"{printable(path)}: {describe_error(e)}"})
            continue
        if not (isinstance(found, dict) and isinstance(found.get("line"), str)
                and isinstance(found.get("step"), int)):
            out.append({"rank": rank, "error": f"{printable(path)}: not the first divergence "
                        f"a live reference writes (no line and step); was it edited?"})
            continue
        out.append({**found, "rank": rank})
    return out
