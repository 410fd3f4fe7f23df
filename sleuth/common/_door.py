"""The door every package reads a run's files through: which names are a run's files, which
paths a file's own content may send a reader to, which files may be opened at all, how a file
is written whole, and how a name is shown on a terminal. It lives in sleuth.common because every
package reads run files, the trainer (which imports no tool) included; the tools' face of it is
tracer.storage (the same functions, raising tracer.UntrustedFileError).

A run directory is written by sleuth, but whatever sits in it is read as untrusted:
- **Names.** `step{S}.h5`, `rank{R}`, `window{K}.json`, `rank{R}.seg{N}.h5`: the number is
  canonical ASCII decimal, no leading zero, at most 18 digits (`numbered`). Python's `\\d`
  also matches Unicode digits and `int()` reads them and leading zeros alike, so `step00.h5`,
  `step٠.h5` and `rank00/` each parsed as step or rank 0 and replaced the real one.
- **Paths from content.** A file may name another file (a profile window names its trace);
  such a name is resolved against the folder that holds it and kept inside the run: no `..`
  out of it, no absolute path, soft links followed only while they stay in (`inside_run`).
- **Kinds.** Only regular files are opened: a FIFO blocks the reader forever at `open`, a
  device reads without end, a folder fails later with a stranger error (`kind_problem`,
  `open_regular`, which opens without blocking and checks the opened descriptor, so a file
  swapped for a FIFO between the check and the open is refused all the same).
- **Outputs.** A file a command writes appears whole or not at all (`atomic_file`): on a full
  disk no truncated table and no temporary file stays behind.
- **Printing.** A run id, a path or a name taken from disk may hold control characters (which
  drive the terminal) or bytes that are not UTF-8 (surrogate escapes, which crash `print`);
  `printable` shows both escaped.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

from sleuth.common._errors import FormatError



class UntrustedFileError(FormatError):
    """A file of a run that the door refuses to open or follow: the message names it, says why
    and what to do. tracer.UntrustedFileError is this error as the tools raise it."""


_NUMBER = "(0|[1-9][0-9]{0,17})"


def numbered(pattern: str) -> re.Pattern[str]:
    """A strict file-name pattern: `pattern` is a regular expression in which each `{n}` stands
    for one canonical ASCII decimal number (a group); match it with `.fullmatch`.
    `numbered(r"step{n}\\.h5")` accepts `step0.h5` and `step12.h5`, not `step00.h5`,
    `step٠.h5` or `step 1.h5`."""
    return re.compile(pattern.replace("{n}", _NUMBER), re.ASCII)


STEP_FILE = numbered(r"step{n}\.h5")
"""A complete step file of a dump: `step{S}.h5`."""
STEP_PARTIAL = numbered(r"step{n}\.h5(?:\.data)?\.partial")
"""A step file being written, or left by a crash: `step{S}.h5.partial`, `step{S}.h5.data.partial`."""
RANK_DIR = numbered(r"rank{n}")
"""A rank's folder: `rank{R}`."""


def number_of(pattern: re.Pattern[str], name: str) -> int | None:
    """The first number of `name` when the whole name matches `pattern` (see `numbered`), else
    None."""
    m = pattern.fullmatch(name)
    return int(m.group(1)) if m else None


def kind_problem(path: str | os.PathLike) -> str | None:
    """Why the file at `path` (soft links followed) is not a regular file, or a soft link
    leading out of its folder, in words with the fix; None for a regular file, and for a path
    that cannot be stat'ed (the open then names the OS's reason). Reads no byte of the file."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return _link_out(path) if stat.S_ISREG(mode) else _kind_text(mode)


def _link_out(path: str | os.PathLike) -> str | None:
    """Why the soft link `path` is not followed: its target lies outside the folder that holds
    it (sleuth writes no links, so a run's file that is one was put there, and one leading
    elsewhere would show another file as the run's); None for a file that is no link, or a
    link that stays in its folder."""
    if not os.path.islink(path):
        return None
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    target = os.path.realpath(path)
    if os.path.commonpath([folder, target]) == folder:
        return None
    return (f"a soft link leading out of its folder (to {printable(target)}), so it was not "
            f"followed: a run's files are its own; copy the file in, or move the link out of "
            f"the run")


def _kind_text(mode: int) -> str:
    kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")
    return (f"not a regular file ({kind}), so it was not opened; sleuth writes regular files "
            f"only: move it out of the run")


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """The regular file at `path`, open for binary reading; UntrustedFileError naming `path`
    and the fix for a FIFO, device, socket or folder. The open never blocks (O_NONBLOCK) and
    the kind is checked on the opened descriptor, so nothing swapped in after a check is read.
    A soft link is followed only while it stays in its folder (`kind_problem`)."""
    out = _link_out(path)
    if out:
        raise UntrustedFileError(f"{printable(path)}: {out}")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UntrustedFileError(f"{printable(path)}: {_kind_text(mode)}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def left_open_for_write(error: OSError) -> bool:
    """Whether HDF5 refused to open a file only because a writer killed mid-run left its SWMR
    "open for write" flag set: the one case in which a reader should open it again as SWMR.
    Any other failure (a truncated file, a checksum that does not match) must not: opened as
    SWMR, HDF5 retries each damaged read with sleeps between, for minutes."""
    return "already open for write" in str(error)


def read_bounded(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path` (`open_regular`), refused when it holds more than
    `max_bytes`: measured on the opened file first, so nothing of a larger one is read, then
    read with the same bound, so a file that grows meanwhile is cut off. UntrustedFileError
    naming the file and the bound; OSError when it cannot be opened."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
    if size > max_bytes or len(data) > max_bytes:
        held = f"{size:,} bytes," if size > max_bytes else "grew while read to"
        raise UntrustedFileError(f"{printable(path)}: {held} more than the {max_bytes:,} sleuth "
                                 f"reads for this file; this is not a file sleuth wrote, and it "
                                 f"was not read")
    return data


def inside_run(run_dir: str | os.PathLike, source: str | os.PathLike, name: object) -> Path:
    """The path that `name`, read from the file `source`, names: resolved against the folder
    of `source` (soft links followed) and required to lie inside `run_dir` (resolved the same
    way). UntrustedFileError naming `source`, the name and the fix for an absolute path, a `..`
    out of the run, a soft link leading out, or a name that is no file name."""
    def refuse(what: str) -> UntrustedFileError:
        return UntrustedFileError(f"{printable(source)} names {printable(repr(name))}, {what}; "
                                  f"a run's files name files inside the run only, so it was "
                                  f"not followed: write this file again, or move it out of "
                                  f"the run")

    if not isinstance(name, str) or not name or "\0" in name:
        raise refuse("which is no file name")
    if os.path.isabs(name):
        raise refuse("an absolute path")
    try:
        root = Path(run_dir).resolve()
        target = (Path(source).parent / name).resolve()
    except (RuntimeError, OSError) as e:  # a loop of soft links (RuntimeError before 3.13)
        raise refuse(f"a soft link that loops ({e})") from None
    if root not in target.parents:
        raise refuse(f"which leads out of the run {printable(root)} (to {printable(target)})")
    return target


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", **open_args: Any) -> Iterator[IO]:
    """A file open for writing whose content appears at `path` only whole: written under a
    unique temporary name beside it, fsync'd and renamed over `path` when the block ends
    without an error. On any error (a full disk at a write, at the flush or at the rename) the
    temporary file is removed and the error raised, and a file already at `path` stays as it
    was. The file gets the permissions a plain `open` would give."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # mkstemp's 0600 would outlive the rename
        with os.fdopen(fd, mode, **open_args) as f:
            fd = -1
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def printable(text: object) -> str:
    """`text` (a str, a path or anything `str()` takes) safe to print on a terminal: control
    characters shown as `\\x1b`, `\\n`, ..., and bytes that are not UTF-8 (surrogate escapes of
    a file name) as `\\xff`. Printable text is returned unchanged."""
    s = os.fsdecode(text) if isinstance(text, (bytes, os.PathLike)) else str(text)
    return _CONTROL.sub(_escape, s) if _CONTROL.search(s) else s


def _escape(m: re.Match[str]) -> str:
    c = m.group(0)
    if "\ud800" <= c <= "\udfff":
        code = ord(c)
        return f"\\x{code - 0xdc00:02x}" if 0xdc80 <= code <= 0xdcff else f"\\u{code:04x}"
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
        f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
