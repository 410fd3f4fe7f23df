"""Opening an HDF5 file a run wrote without trusting what it claims.

HDF5 lets a file point outside itself: an external link (`/records` -> `other.h5:/records`), a
dataset whose bytes are stored in other files (external storage), a virtual dataset mapped
onto other files. h5py follows each of them without a word, so a step file would present
another file's records as its own. And a dataset's shape is only a claim: a dataset of 10^10
rows that was never written costs 92 KB on disk and 2 TiB to read, as HDF5 hands back fill
values for storage that does not exist.

`open_h5` walks every link of the file before anything of it is read, and refuses (with
`UntrustedFileError`) external and user-defined links, external storage, virtual datasets and
any dataset that claims more bytes than the file stores for it or than lie inside the file.
What is left reads within the file's own size. Soft links are let be: HDF5 resolves them
inside the file, and the only way out of it, an external link, is refused wherever it is.
Every reader of a step file opens it here (`Dump`, the diff's tensor reader, the flight
recorder's reader).

The path itself is checked first (`path_problem`): a step file that is a soft link looping
back on itself, or pointing at nothing, would otherwise come back as HDF5's own error text.
"""
from __future__ import annotations

import errno
import math
import os
from pathlib import Path

import h5py
from h5py import h5d, h5g, h5l, h5o

from tracer._errors import DumpFormatError, UntrustedFileError
from tracer.storage._door import kind_problem, printable

MAX_LINKS = 4096
"""The most links a file may hold; a step file holds a handful."""
MAX_DEFLATE_RATIO = 1100
"""How many times its stored size a filtered (compressed) dataset read a slice at a time
(`/tensors`) may claim: deflate, the strongest filter HDF5 ships, reaches about 1032 on zeros."""
MAX_TABLE_RATIO = 64
"""How many times its stored size a filtered dataset read whole (a table: `/records`, `/hits`,
a summary's series) may claim. Sleuth writes no filters; a table repacked with deflate shrinks
about 8-fold (a records table at level 9), while a forged chunk of zeros inflates 1000-fold:
3.2 MB on disk read as 2.5 GiB."""
MAX_CHUNK_BYTES = 256 * 2**20
"""The largest chunk, inflated, of a filtered dataset: HDF5 inflates a whole chunk to read any
byte of it, so a 4 GiB chunk of zeros costs 4 GiB of memory for one small record."""
SLICED = frozenset({"/tensors"})
"""The datasets read a slice at a time, whose claims are bounded by deflate's ratio only."""


def open_h5(path: str | os.PathLike) -> h5py.File:
    """`h5py.File(path, "r")` once every link and dataset of the file is checked (see the
    module's docstring). Raises UntrustedFileError for a file that points outside itself or
    claims more than it stores, DumpFormatError when the path is a soft link that loops or
    leads nowhere (`path_problem`), OSError when HDF5 cannot open it."""
    path = Path(path)
    problem = path_problem(path)
    if problem:
        raise DumpFormatError(f"{path}: {problem}")
    f = h5py.File(path, "r")
    try:
        check_h5(f, path)
    except BaseException:
        f.close()
        raise
    return f


def path_problem(path: str | os.PathLike) -> str | None:
    """Why the file at `path` cannot be opened as a file, in words, with the fix; None when
    it can: a soft link that loops (to itself, or through others back to itself), a soft link
    to nothing, a soft link out of its folder, or anything but a regular file
    (`tracer.storage._door.kind_problem`: a FIFO, a device, a folder). Reads no byte of the
    file."""
    path = Path(path)
    try:
        path.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            return (f"a soft link that loops ({_chain(path)}), so it leads to no file; "
                    f"remove it, or point it at a step file")
        if e.errno == errno.ENOENT and path.is_symlink():
            return (f"a soft link to nothing ({_chain(path)}, which does not exist); remove "
                    f"it, or point it at a step file")
        return None  # HDF5 reports anything else (a missing file, no permission) by name
    return kind_problem(path)  # not a regular file, or a soft link out of its folder


def _chain(path: Path, most: int = 8) -> str:
    """`a -> b -> a`: a soft-link chain as the links spell it, up to its first repeat."""
    seen = [str(path)]
    visited = {os.path.abspath(path)}
    for _ in range(most):
        try:
            target = os.readlink(path)
        except OSError:
            return " -> ".join(seen)
        seen.append(target)
        path = path.parent / target
        if os.path.abspath(path) in visited:
            return " -> ".join(seen)
        visited.add(os.path.abspath(path))
    return " -> ".join(seen) + " -> ..."


def check_h5(f: h5py.File, path: Path) -> None:
    """Raise UntrustedFileError unless every object of the open HDF5 file `f` (a step file, a
    summary) lies inside it and claims no more than it stores (see the module's docstring);
    `path` names the file in the message."""
    size = os.fstat(f.id.get_vfd_handle()).st_size if _has_fd(f) else path.stat().st_size
    links = 0
    groups: list[tuple[h5g.GroupID, str]] = [(f.id, "/")]
    while groups:
        gid, where = groups.pop()
        found: list[tuple[bytes, int]] = []
        gid.links.iterate(lambda name, info: found.append((name, info.type)), info=True)
        links += len(found)
        if links > MAX_LINKS:
            raise UntrustedFileError(_refusal(path, f"it holds more than {MAX_LINKS} links"))
        for name, kind in found:
            full = where + name.decode("utf-8", "replace")
            if kind == h5l.TYPE_SOFT:
                continue  # resolved inside this file (see the module's docstring)
            if kind == h5l.TYPE_EXTERNAL:
                target = gid.links.get_val(name)
                where_to = ":".join(t.decode("utf-8", "replace") if isinstance(t, bytes)
                                    else str(t) for t in target)
                raise UntrustedFileError(_refusal(
                    path, f"{full} is an external link to {where_to}, another file"))
            if kind != h5l.TYPE_HARD:
                raise UntrustedFileError(_refusal(path, f"{full} is a user-defined link "
                                                        f"(type {kind})"))
            kind_of = h5o.get_info(gid, name).type
            if kind_of == h5o.TYPE_GROUP:
                groups.append((h5g.open(gid, name), full + "/"))
            elif kind_of == h5o.TYPE_DATASET:
                _check_dataset(h5d.open(gid, name), full, path, size)


def _has_fd(f: h5py.File) -> bool:
    try:
        return f.driver == "sec2"
    except Exception:  # noqa: BLE001 - any other driver: stat the path instead
        return False


def _check_dataset(did: h5d.DatasetID, name: str, path: Path, size: int) -> None:
    dcpl = did.get_create_plist()
    layout = dcpl.get_layout()
    if layout == h5d.VIRTUAL:
        raise UntrustedFileError(_refusal(path, f"{name} is a virtual dataset, mapped onto "
                                                f"other files"))
    if dcpl.get_external_count():
        raise UntrustedFileError(_refusal(path, f"{name} keeps its bytes in another file "
                                                f"(HDF5 external storage)"))
    claimed = math.prod(did.shape or ()) * did.get_type().get_size()
    stored = did.get_storage_size()
    if not dcpl.get_nfilters():
        if claimed > stored:
            raise UntrustedFileError(_refusal(
                path, f"{name} claims {_human(claimed)} (shape {tuple(did.shape)}, "
                      f"{did.get_type().get_size()}-byte elements) but the file stores "
                      f"{_human(stored)} of it"))
    else:
        ratio = MAX_DEFLATE_RATIO if name in SLICED else MAX_TABLE_RATIO
        if claimed > stored * ratio:
            raise UntrustedFileError(_refusal(
                path, f"{name} claims {_human(claimed)} (shape {tuple(did.shape)}, "
                      f"{did.get_type().get_size()}-byte elements) from {_human(stored)} "
                      f"compressed, more than {ratio} times its size (the bound for "
                      f"{'tensor bytes' if name in SLICED else 'a table'})"))
        chunk = math.prod(dcpl.get_chunk() or ()) * did.get_type().get_size()
        if chunk > MAX_CHUNK_BYTES:
            raise UntrustedFileError(_refusal(
                path, f"{name} is compressed in chunks of {_human(chunk)}, more than the "
                      f"{_human(MAX_CHUNK_BYTES)} a chunk may inflate to (each read inflates "
                      f"a whole chunk)"))
    if layout == h5d.CONTIGUOUS:
        offset = did.get_offset()
        if offset is not None and offset + stored > size:
            raise UntrustedFileError(_refusal(
                path, f"{name} claims {_human(stored)} at byte {offset:,}, past the end of "
                      f"the file ({size:,} bytes)"))


def _refusal(path: Path, what: str) -> str:
    return (f"{printable(path)}: refused: {what}; a run's file holds its own data within its "
            f"size, so this file is damaged or forged and was not read: write it again (dump "
            f"that step again), or move the file away to read the others")


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            return f"{n:,} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"
