"""Run the ```bash blocks of the docs as a new user would, top to bottom.

A document's blocks run in order in one folder (a later block may read what an earlier one
wrote), which holds a copy of `examples/` as a fresh clone does. `sleuth`, `python` and
`torchrun` on PATH run this checkout with this interpreter, so an installed copy can never
answer for it.

Rules the docs follow, enforced here:
- Each line (with its `\\` continuations) is one command and must exit 0. `sleuth diff`,
  `sleuth check` and `sleuth profile` (`profile diff`) may exit 1 too: that is their documented
  "diverged" / "found something" / "slower". A
  comment `# exit N ...` on the command declares the one exit code it must give instead.
- `sleuth dashboard` serves: it runs with `--host 127.0.0.1 --port 0 --no-browser` appended
  (argparse keeps the last value), must print its address and answer HTTP 200 there, and is
  then stopped with Ctrl-C.
- A block that cannot run on a CPU machine without network (installing packages, GPUs, several
  nodes) has `<!-- norun: REASON -->` on the line before its fence; the reason is required.
- The README and then every guide run one after another in one clone, as a new user reads them,
  so no document may write into another's run dirs: a guide `docs/G.md` keeps its runs under
  `runs/G/`, and the README never writes there (`run_dirs` finds what a document names).
"""
from __future__ import annotations

import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```(bash|sh|shell)\s*$")
# a comment such as `# exit 2: the damaged file is named` declares the exit code the docs show
_DECLARED_EXIT = re.compile(r"#\s*exit (\d+)\b")
_NORUN = re.compile(r"^<!--\s*norun:(.*?)-->\s*$")
_FINDING_OK = (("sleuth", "diff"), ("sleuth", "check"), ("sleuth", "profile"))
_URL = re.compile(r"http://[\w.]+:\d+/")
COMMAND_TIMEOUT_S = 300


class BlockError(AssertionError):
    """A block that did not run as written; the message starts with FILE:LINE."""


@dataclass(frozen=True)
class Command:
    path: Path
    line: int  # 1-based line of the command's first line in the document
    text: str  # continuation lines joined

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path}:{self.line}"


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # line of the opening fence
    commands: tuple[Command, ...]
    norun: str | None  # the reason, when marked


def extract_blocks(path: Path) -> list[Block]:
    """Every ```bash block of a Markdown file, with its commands and its norun marker."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not _FENCE.match(lines[i].strip()):
            i += 1
            continue
        start = i
        marker = _NORUN.match(lines[i - 1].strip()) if i else None
        if marker and not marker.group(1).strip():
            raise BlockError(f"{path}:{i}: a norun marker needs a reason: <!-- norun: why -->")
        commands, pending, pending_line = [], "", 0
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            text = lines[i]
            if not pending and not text.strip():
                i += 1
                continue
            if not pending:
                pending_line = i + 1
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
            else:
                commands.append(Command(path, pending_line, pending + text))
                pending = ""
            i += 1
        if i == len(lines):
            raise BlockError(f"{path}:{start + 1}: the block is never closed")
        blocks.append(Block(path, start + 1, tuple(commands),
                            marker.group(1).strip() if marker else None))
        i += 1
    return blocks


_RUN_DIR = re.compile(r"(?<![\w./-])runs/([\w.-]+)")


def run_dirs(path: Path) -> set[str]:
    """The first folder under `runs/` of every run dir a document's blocks name."""
    return {m.group(1) for block in extract_blocks(path) for cmd in block.commands
            for m in _RUN_DIR.finditer(cmd.text)}


def tool_bin(folder: Path) -> Path:
    """A folder of `sleuth`, `python`, `python3` and `torchrun` that run this checkout."""
    folder.mkdir(parents=True, exist_ok=True)
    scripts = {"sleuth": "-m sleuth", "python": "", "python3": "",
               "torchrun": "-m torch.distributed.run"}
    for name, args in scripts.items():
        f = folder / name
        f.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {args} "$@"\n')
        f.chmod(0o755)
    return folder


def environment(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLEUTH_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def _words(text: str) -> list[str]:
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return []
    return [w for w in words if "=" not in w or w.startswith("-")]  # drop VAR=value prefixes


def _fail(cmd: Command, why: str, proc_out: str = "") -> BlockError:
    tail = proc_out[-3000:]
    return BlockError(f"{cmd.where}: `{cmd.text.strip()}` {why}" + (f"\n{tail}" if tail else ""))


def _serve_and_stop(cmd: Command, cwd: Path, env: dict[str, str]) -> str:
    """Start a dashboard command, check it answers, stop it as Ctrl-C would; return its URL."""
    # the command's own comment would swallow flags appended after it
    argv = [*shlex.split(cmd.text, comments=True), "--host", "127.0.0.1", "--port", "0",
            "--no-browser"]
    proc = subprocess.Popen(["bash", "-c", f"exec {shlex.join(argv)}"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            url = _URL.search(line)
            if url:
                with urllib.request.urlopen(url.group(0), timeout=60) as response:
                    if response.status != 200:
                        raise _fail(cmd, f"served HTTP {response.status}", "".join(seen))
                return url.group(0)
        else:
            raise _fail(cmd, f"exited {proc.wait()} before serving", "".join(seen))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    raise AssertionError("unreachable")  # the loop returns or raises


def run_command(cmd: Command, cwd: Path, env: dict[str, str]) -> str | None:
    """Run one command by the rules above; raise BlockError naming its file and line. Returns
    the address a dashboard command served on."""
    words = _words(cmd.text)
    if words[:2] == ["sleuth", "dashboard"]:
        return _serve_and_stop(cmd, cwd, env)
    try:
        proc = subprocess.run(["bash", "-c", cmd.text], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise _fail(cmd, f"ran past {COMMAND_TIMEOUT_S} s") from e
    declared = _DECLARED_EXIT.search(cmd.text)
    if declared:
        allowed = {int(declared.group(1))}
    else:
        allowed = {0, 1} if tuple(words[:2]) in _FINDING_OK else {0}
    out = proc.stdout + proc.stderr
    if proc.returncode not in allowed:
        raise _fail(cmd, f"exited {proc.returncode}", out)
    if "Traceback (most recent call last)" in out:
        raise _fail(cmd, "printed a traceback", out)
    return None


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_document(path: Path, workdir: Path, bin_dir: Path) -> list[Block]:
    """Run every unmarked block of `path` in order in `workdir`; return the blocks skipped."""
    workdir.mkdir(parents=True, exist_ok=True)
    if (REPO / "examples").is_dir():
        shutil.copytree(REPO / "examples", workdir / "examples", dirs_exist_ok=True)
    env = environment(bin_dir)
    skipped = []
    for block in extract_blocks(path):
        if block.norun:
            skipped.append(block)
            continue
        for cmd in block.commands:
            start, cpu = time.perf_counter(), _children_cpu()
            run_command(cmd, workdir, env)
            # the CI budget: CPU seconds tell what a command costs on a machine however busy
            print(f"{cmd.where}: {time.perf_counter() - start:.1f} s, "
                  f"{_children_cpu() - cpu:.1f} s CPU", flush=True)
    return skipped
