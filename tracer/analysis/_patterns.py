"""Name patterns a file brought with it, matched with a time bound.

A dump's config travels inside its step files, and its `nan_allow` patterns may be regular
expressions (`"re:<regex>"`). Python's `re` backtracks: a pattern such as `re:^(a+)+$` takes
longer than the age of the universe on a 40-character name, and it runs in C, where no other
thread can stop it. So the regular expressions a file stores are matched in a child process that
is killed after `PATTERN_SECONDS`, one batch of names per step (and each name's answer is kept:
the same names come back every step). Globs (`fnmatch`) cannot backtrack like this and are
matched here, as are the patterns the user typed (`--nan-allow`): those are the user's own.
"""
from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
from typing import Iterable

from tracer._errors import UntrustedFileError

PATTERN_SECONDS = 3.0
"""How long the stored regular expressions of one step may take over its names, the child
process's start (about 0.05 s) included."""

_CHILD = (
    "import json, re, sys\n"
    "job = json.load(sys.stdin)\n"
    "regexes = [re.compile(p) for p in job['patterns']]\n"
    "json.dump([any(r.search(n) for r in regexes) for n in job['names']], sys.stdout)\n"
)
_KNOWN: dict[tuple[str, ...], dict[str, bool]] = {}
"""Per tuple of stored regular expressions: each name's answer so far."""


def stored_matches(patterns: Iterable[str], names: Iterable[str], source: str) -> set[str]:
    """The `names` that any of `patterns` (globs, or `re:<regex>` run in a child process with
    a time bound) matches. `source` names the file the patterns came from, for the error.

    Raises UntrustedFileError when the regular expressions do not finish in PATTERN_SECONDS.
    """
    patterns = tuple(patterns)
    globs = [p for p in patterns if not p.startswith("re:")]
    regexes = tuple(p[3:] for p in patterns if p.startswith("re:"))
    names = list(dict.fromkeys(names))
    out = {n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs)}
    if not regexes:
        return out
    known = _KNOWN.setdefault(regexes, {})
    todo = [n for n in names if n not in known and n not in out]
    if todo:
        known.update(zip(todo, _run_bounded(regexes, todo, source)))
    return out | {n for n in names if known.get(n)}


def _run_bounded(regexes: tuple[str, ...], names: list[str], source: str) -> list[bool]:
    job = json.dumps({"patterns": list(regexes), "names": names})
    shown = ", ".join(repr("re:" + r) for r in regexes)
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD], input=job,
                              capture_output=True, text=True, timeout=PATTERN_SECONDS)
    except subprocess.TimeoutExpired:
        raise UntrustedFileError(
            f"{source}: refused: its dump config's nan_allow pattern(s) {shown} did not finish "
            f"matching {len(names)} record name(s) in {PATTERN_SECONDS:g} s (a regular "
            f"expression that backtracks without end, such as '(a+)+$'); write it as a glob or "
            f"a simpler expression in the dump config, or give the patterns you want with "
            f"`sleuth check --nan-allow`") from None
    try:
        answer = json.loads(done.stdout)
        if done.returncode or len(answer) != len(names):
            raise ValueError(done.stderr.strip().splitlines()[-1:] or "no answer")
    except ValueError as e:
        raise UntrustedFileError(f"{source}: refused: its dump config's nan_allow pattern(s) "
                                 f"{shown} could not be matched ({e}); fix them in the dump "
                                 f"config") from None
    return [bool(a) for a in answer]
