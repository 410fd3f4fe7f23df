"""Step files without tensor bytes, written from an image: HDF5 builds a file once for each table
shape, and later steps patch their values into a copy of it.

HDF5 takes ~2 ms inside a training step to build a statistics step file (the tiny preset at
module level, 204 rows: 0.6 ms for the root attributes, 0.9 ms to create and close the file,
0.4 ms for /records; benchmarks/RESULTS.md, eleventh session), while the training step itself
is 10-15 ms. Between two steps of one run such a file differs only in the `step`, `created`
and `complete` attributes and in the bytes of /records; as long as the table has the same
dtype (its string widths included) and length and `created` the same length, HDF5 lays out
the same file. So the file is built once, in memory (the core driver), and kept as a template
with the places of those values; a later step copies it and writes its values there (~0.1 ms).

A template is trusted only after it proved itself (`ImageCache._make`):
- two images of the same file are built with different random sentinels for the three
  attributes and zeroed /records data; each sentinel must occur once, at the same place in both;
- every other byte in which the two images differ must lie in a 4-byte checksum that HDF5 put
  after a metadata block (object header or superblock version 2), and the checksum must be the
  lookup3 of the block (tracer/_table.c) in both images; these are recomputed after a patch;
- the template patched with the real values must equal, byte for byte, the image HDF5 builds of
  them, which is also the file of the step that made the template.
Any failure marks the shape as not patchable and HDF5 writes its files as before, so a change
of layout in another HDF5 version costs speed, never a wrong file. A template is made at the
second file of a shape, not the first.
"""
from __future__ import annotations

import secrets
import string
import threading
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import numpy as np

try:
    from tracer._fused import lookup3 as _lookup3
except ImportError:  # the kernel is not built: HDF5 writes every file
    _lookup3 = None

_KEPT = 8  # templates (and shapes found not patchable) remembered, the latest used
_SIGNATURES = (b"OHDR", b"OCHK", b"\x89HDF\r\n\x1a\n")  # blocks HDF5 checksums at their end

Build = Callable[[dict, int, np.ndarray], tuple[bytes, int]]
"""(attributes, the `complete` attribute's value, /records table) -> (the file's image, offset
of /records' data)."""


class _Template(NamedTuple):
    image: bytes
    step: int  # offset of the int64 `step` value
    complete: int  # offset of the int64 `complete` value
    created: int  # offset of `created`'s UTF-8 bytes
    records: int  # offset of /records' data, -1 when the table is empty
    checksums: tuple[tuple[int, int], ...]  # (block start, checksum offset), in file order


_NEW, _ONCE = object(), object()


class _Values(NamedTuple):
    step: int
    complete: int
    created: str


class ImageCache:
    """Images of step files without tensor bytes or hits (see the module docstring).
    Thread-safe: the async writer's threads and the sync writers of several Dumpers share
    one."""

    def __init__(self, build: Build) -> None:
        self._build = build
        self._lock = threading.Lock()
        # shape -> its template, None (not patchable) or _ONCE (seen once, no template yet)
        self._templates: OrderedDict[tuple, Any] = OrderedDict()
        self.patched = 0
        """Files made by patching a template (for tests and benchmarks)."""

    def image(self, attrs: dict[str, Any], complete: bool, table: np.ndarray
              ) -> bytes | bytearray | None:
        """The bytes of the file with these root attributes, `complete` flag and /records
        table; None when this shape has no template (the caller has HDF5 write the file).
        The first file of a shape is left to HDF5, the second makes the template (three
        images, ~3 ms), so a run whose shapes keep changing pays what it paid without one."""
        step, created = attrs.get("step"), attrs.get("created")
        if _lookup3 is None or type(step) is not int or type(created) is not str or not created:
            return None
        key = _key(attrs, table)
        with self._lock:
            template = self._templates.get(key, _NEW)
            if template is _NEW:  # first seen: HDF5 writes it (a shape may never come back)
                self._templates[key] = _ONCE
                self._forget_oldest()
                return None
            self._templates.move_to_end(key)
        if template is None:
            return None  # not patchable
        values = _Values(step, int(complete), created)
        if template is not _ONCE:
            image = _patch(template, values, table)
            with self._lock:
                self.patched += 1
            return image
        template, image = self._make(attrs, values, table)
        with self._lock:
            self._templates[key] = template
        return image

    def _forget_oldest(self) -> None:
        while len(self._templates) > _KEPT:
            self._templates.popitem(last=False)

    def _make(self, attrs: dict[str, Any], values: _Values, table: np.ndarray
              ) -> tuple[_Template | None, bytes]:
        """A proven template for this shape, or None; and the image of this step's file."""
        width = len(values.created.encode())
        zeros = np.zeros_like(table)
        first, second = _sentinels(width), _sentinels(width)
        a, records = self._build(_with(attrs, first), first.complete, zeros)
        b, records_b = self._build(_with(attrs, second), second.complete, zeros)
        real, _ = self._build(attrs, values.complete, table)
        template = None
        if len(a) == len(b) and records == records_b:
            template = _derive(a, b, first, second, records)
        if template is not None and _patch(template, values, table) != real:
            template = None
        return template, real


def _key(attrs: dict[str, Any], table: np.ndarray) -> tuple:
    """What the layout of a file depends on: every attribute but the patched ones (name, type
    and value, in order), the length of `created`, the table's dtype with its string
    encodings (numpy's dtype equality ignores them), and its length."""
    dtype = table.dtype
    encodings = tuple((dtype[n].metadata or {}).get("h5py_encoding") for n in dtype.names or ())
    fixed = tuple((k, type(v).__name__, v) for k, v in attrs.items()
                  if k not in ("step", "created"))
    return (fixed, tuple(attrs), len(attrs["created"].encode()), dtype, encodings, len(table))


def _sentinels(width: int) -> _Values:
    """Random values nothing else in a file holds: int64s with their high bits set, and an
    ASCII string of `width` bytes."""
    letters = string.ascii_letters
    return _Values(step=(1 << 62) | secrets.randbits(61), complete=(1 << 62) | secrets.randbits(61),
                   created="".join(secrets.choice(letters) for _ in range(width)))


def _with(attrs: dict[str, Any], values: _Values) -> dict[str, Any]:
    out = dict(attrs)
    out["step"], out["created"] = values.step, values.created
    return out


def _int64(value: int) -> bytes:
    return value.to_bytes(8, "little", signed=True)


def _derive(a: bytes, b: bytes, first: _Values, second: _Values, records: int
            ) -> _Template | None:
    """The template of image `a` (sentinels `first`), checked against image `b` (`second`);
    None unless they differ exactly in the sentinels and in checksums that lookup3 gives."""
    places = []
    for one, other in ((_int64(first.step), _int64(second.step)),
                       (_int64(first.complete), _int64(second.complete)),
                       (first.created.encode(), second.created.encode())):
        at = a.find(one)
        if at < 0 or a.find(one, at + 1) >= 0 or b[at:at + len(other)] != other:
            return None
        places.append((at, len(one)))
    differ = np.flatnonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8))
    covered = np.zeros(len(a), dtype=bool)
    for at, n in places:
        covered[at:at + n] = True
    checksums: list[tuple[int, int]] = []
    for i in differ.tolist():
        if covered[i]:
            continue
        found = _checksum_at(a, b, i)
        if found is None:
            return None
        checksums.append(found)
        covered[found[1]:found[1] + 4] = True
    (step, _), (complete, _), (created, _) = places
    return _Template(a, step, complete, created, records, tuple(sorted(set(checksums),
                                                                       key=lambda c: c[1])))


def _checksum_at(a: bytes, b: bytes, i: int) -> tuple[int, int] | None:
    """(block start, checksum offset) of a checksum holding byte `i` of both images: 4 bytes
    that are, in each image, the lookup3 of the bytes from a block signature up to them."""
    for pos in range(max(0, i - 3), i + 1):
        if pos + 4 > len(a):
            break
        for signature in _SIGNATURES:
            start = a.rfind(signature, 0, pos)
            if start < 0:
                continue
            if all(int.from_bytes(x[pos:pos + 4], "little") == _lookup3(x, start, pos)
                   for x in (a, b)):
                return start, pos
    return None


def _patch(template: _Template, values: _Values, table: np.ndarray) -> bytearray:
    """A copy of the template's image holding `values` and `table`, checksums recomputed."""
    out = bytearray(template.image)
    out[template.step:template.step + 8] = _int64(values.step)
    out[template.complete:template.complete + 8] = _int64(values.complete)
    created = values.created.encode()
    out[template.created:template.created + len(created)] = created
    if template.records >= 0 and len(table):
        data = memoryview(np.ascontiguousarray(table)).cast("B")
        out[template.records:template.records + data.nbytes] = data
    for start, pos in template.checksums:
        out[pos:pos + 4] = _lookup3(out, start, pos).to_bytes(4, "little")
    return out
