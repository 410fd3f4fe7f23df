"""Byte reuse: a tensor recorded again in the same step, unchanged, is not measured or stored
again.

Three indexes of the step's records, kept by `ReuseIndex`:
- by memory or identity (`reuse_key`): an op's output that is the next op's input, a
  module's output that is the next module's input, a view of either, takes the first record's
  statistics and, where both read the same bytes, its stored bytes;
- the latest CPU span records (tensor/full mode): a strided slice or a dense piece of a tensor
  stored already points into that record's bytes (`Within`) instead of storing its own;
- snapshots taken of a parameter before the optimizer changes it (`same_bytes`): the record of
  the snapshot points at the bytes of the record that read the parameter in forward.

A record's holder, `[statistics or None, (data_offset, data_nbytes, strides) or None]`, is
filled where the first record is written (`Writer._record`; the async writer's thread, in queue
order), and read by the records that reuse it. Both writers decide each record here, the same
way (`ReuseIndex.decide`), so both write the same files.
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Any, NamedTuple

import torch

from tracer.storage._elements import dense_span, memory_span
from tracer.storage._layout import stored_extent
from tracer.storage._stat_fields import shape_str

_STRIDED = torch.strided


def reuse_key(t: torch.Tensor, version: int | None = None) -> tuple[tuple, tuple] | None:
    """(where, state): records whose `where` and `state` are equal hold the same statistics.

    A tensor that the statistics read as one dense span of memory (contiguous, or on CPU a
    transpose/permutation of a dense block, read in memory order: see `_elements._flat`) is found
    by its span, so a view (`aten.view`, `aten.t`, ...) of a tensor recorded earlier reuses its
    statistics; any other by its identity. `state` is the version counter, shared by a tensor
    and all its views and bumped by every in-place op, plus shape and strides for identity
    keys. None for tensors without a version counter (inference mode) or plain storage: those
    are always computed afresh. A conjugate or negative view shares its base's memory but not
    its values, so it is only ever found by identity. `version` replaces `t._version`: a view
    made inside a dispatch mode gets its base's version counter only after the mode returns,
    so the mode passes the base's version (see `Writer.add`'s `version`)."""
    try:
        if t.layout != _STRIDED or t.is_inference() or t.is_meta:
            return None
        v = t._version if version is None else version
        dtype = t.dtype
        # the conjugate bit exists only on complex tensors; the negative bit on real ones
        # only through torch._neg_view, rare enough to test after is_contiguous
        if (t.is_contiguous() or (t.is_cpu and dense_span(t))) and not (
                (dtype.is_complex and t.is_conj()) or t.is_neg()):
            return ("span", t.data_ptr(), t.numel(), dtype, t.device), (v,)
        return ("id", id(t)), (v, t.data_ptr(), dtype, tuple(t.shape), t.stride())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


SAME_LAYOUT = "="
"""`shared` of a record that is the very tensor of the record it shares bytes with."""

# how many of the step's latest CPU span records a strided tensor's containing span is looked
# for among (see `ReuseIndex._within`): a slice is nearly always taken right after its base is made
_RECENT_SPANS = 64


def _storage_of(t: torch.Tensor) -> Any:
    """`t`'s untyped storage (one Python object while any tensor uses it), or None for a
    tensor without one (a wrapper subclass)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _partial(t: torch.Tensor, storage: Any) -> bool:
    """True when dense `t` covers only part of `storage`, its own (a piece of a larger
    tensor)."""
    return bool(t.storage_offset()) or storage.nbytes() > t.numel() * t.element_size()


def span_strides(t: torch.Tensor) -> str:
    """The strides a record of span `t` reads the span's stored bytes with (memory order): ""
    when contiguous, else (on CPU, a dense permutation) its own."""
    strided = not t.is_contiguous() and memory_span(t) is not None
    return shape_str(t.stride()) if strided else ""


class Within(NamedTuple):
    """`shared` of a record whose elements lie inside an earlier record's stored span, in
    tensor/full mode: it stores no bytes and points into that record's (docs/dump-format.md,
    3.0), while its statistics are its own."""

    holder: list
    """the holder of the record whose bytes hold this one's elements (`ReuseIndex.lookup`)"""
    delta: int
    """bytes from the start of that record's bytes to this tensor's first element"""
    nbytes: int
    """bytes from this tensor's first element to the end of its last one"""
    strides: str
    """this tensor's element strides over those bytes"""



class ReuseIndex:
    """The step's records by memory, by recent span and by parameter snapshot (see the
    module's docstring). Used from the training thread only; `reset` at each step."""

    def __init__(self, keep_bytes: bool) -> None:
        self.keep_bytes = keep_bytes
        # reuse_key "where" -> (weak reference, "state", holder) of this step's records (the
        # reference: to the storage of a span, to the tensor of an identity key); public for
        # the writers' one-call record of a plain tensor (`Writer._plain`), which looks its
        # span key up here inline, in statistics mode (no `_recent`, no `same_bytes`)
        self.seen: dict[Any, tuple] = {}
        # the `where` of this step's latest CPU span entries, newest last, in tensor/full mode
        # (None otherwise): where a strided slice's elements may already be stored (`_within`)
        self._recent: deque | None = deque(maxlen=_RECENT_SPANS) if keep_bytes else None
        # id(snapshot) -> (weak reference, its version, holder, strides) (`same_bytes`)
        self._same: dict[int, tuple] = {}

    def reset(self) -> None:
        """Forget the step's records (a new step begins)."""
        self.seen.clear()
        self._same.clear()
        if self._recent is not None:
            self._recent.clear()

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """Drop what the step knew of these tensors' values (an op that may not bump their
        version counter is about to change them)."""
        seen = self.seen
        for t in tensors:
            seen.pop(("id", id(t)), None)
            key = reuse_key(t)
            if key is not None:
                seen.pop(key[0], None)

    def same_bytes(self, snapshot: torch.Tensor, source: torch.Tensor) -> None:
        """`snapshot` is a copy of `source` as `source` is now (a parameter's value before the
        optimizer changes it). In tensor/full mode, where a record of this step stores
        `source`'s memory unchanged (the op that read the weight in forward), the next record
        of `snapshot`, which comes with its statistics (`add`'s `stats`), points at those bytes
        instead of storing the same ones again; without statistics (no kernel), it takes that
        record's too. Forgotten once used, or once `snapshot` is written (its version
        changes)."""
        if self._recent is None:
            return
        holder, hit, kind, _ = self.lookup(source, True, insert=False)
        if hit and kind == "span":
            self._same[id(snapshot)] = (weakref.ref(snapshot), snapshot._version, holder,
                                        span_strides(source))

    def take_same(self, t: torch.Tensor) -> tuple[list, str] | None:
        """(holder, strides) that `same_bytes` left for this snapshot, once."""
        if not self._same:
            return None
        entry = self._same.pop(id(t), None)
        if entry is None or entry[0]() is not t or entry[1] != t._version:
            return None
        return entry[2], entry[3]

    def lookup(self, t: torch.Tensor, stable: bool, version: int | None = None,
               insert: bool = True) -> tuple[list | None, bool, str | None, Any]:
        """(holder, hit, kind, storage): the holder of an earlier identical record's statistics
        and bytes (hit True), or a new empty holder that this record fills (hit False; with
        `insert` False, None and nothing is noted), or None when not reusable. On a hit the
        earlier record's stored bytes are this record's too: a span is always stored in memory
        order, and this record reads it with its own strides (docs/dump-format.md, /tensors).
        `kind`: "span" (found by its memory) or "id" (by identity: on a hit, the same tensor
        object, stored in whatever layout its first record chose), None when not reusable.
        `storage`: `t`'s, for a span key (None otherwise)."""
        key = reuse_key(t, version) if stable else None
        if key is None:
            return None, False, None, None
        where, state = key
        kind = where[0]
        storage = None
        if kind == "span":
            # the storage is alive (a tensor uses it), so the span's memory is still its: the
            # record that made the entry may have died (a saved output, an mm output that
            # _unsafe_view made matmul's result of, a gradient detach()ed into p.grad).
            # Inline, not _storage_of: this runs for every record
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                return None, False, None, None
        entry = self.seen.get(where)
        if entry is not None and entry[1] == state:
            owner = entry[0]()
            # for an identity key: the very tensor (its id may have been given to another)
            if owner is (storage if kind == "span" else t):
                return entry[2], True, kind, storage
        if not insert:
            return None, False, kind, storage
        holder: list = [None, None]
        self.seen[where] = (weakref.ref(storage if kind == "span" else t), state, holder)
        if kind == "span" and self._recent is not None and where[4].type == "cpu":
            self._recent.append(where)
        return holder, False, kind, storage

    def _within(self, t: torch.Tensor, version: int | None, own: list | None, storage: Any
                ) -> Within | None:
        """Where an earlier record of this step already stores all of `t`'s elements, `t` a
        strided CPU tensor (a slice, a view of one, an expansion, a dense piece of a larger
        tensor): among the latest CPU span records, one of the same dtype and storage (alive,
        so the memory is still its) whose memory holds `t`'s, at the same version (unchanged
        since). Such a span is stored as its memory, in memory order, so `t` is read from it at
        its own offset with its own strides. `own`: the holder `t`'s record just made, which
        is not a candidate; `storage`: `t`'s, or None when not looked up yet."""
        if not t.is_cpu or t.is_neg() or (t.dtype.is_complex and t.is_conj()):
            return None
        if not t.numel():
            return None
        if storage is None and (storage := _storage_of(t)) is None:
            return None
        size = t.element_size()
        strides = t.stride()
        lo = t.data_ptr()
        hi = lo + size * stored_extent(tuple(t.shape), strides)
        dtype = t.dtype
        state = (t._version if version is None else version,)
        seen = self.seen
        for where in reversed(self._recent):  # type: ignore[arg-type]
            start = where[1]
            if start <= lo and where[3] is dtype and hi <= start + where[2] * size:
                entry = seen.get(where)
                if entry is not None and entry[1] == state and entry[2] is not own \
                        and entry[0]() is storage:
                    return Within(entry[2], lo - start, hi - lo,
                                  "" if t.is_contiguous() else shape_str(strides))
        return None

    def plan(self, t: torch.Tensor, stable: bool, version: int | None = None
             ) -> tuple[list | None, str | Within | None, bool]:
        """(share, shared, skip) of one record (a plain tuple: this runs for every record).

        `share`: the holder this record fills, or the one of the earlier record it reuses;
        None when the record takes no part in reuse. `shared`: None when the record stores its
        own bytes (if any are kept); a string when it points at the bytes of the record that
        filled `share`, read with these strides ("" for C order, SAME_LAYOUT for the very same
        tensor); a `Within` when it points into an earlier record's bytes and takes its own
        statistics. `skip`: the record needs no snapshot and no statistics of its own."""
        if (same := self.take_same(t)) is not None:
            # a parameter snapshot without the kernel's statistics (`same_bytes`): the record
            # holding the parameter's memory has its statistics and bytes
            return same[0], same[1], True
        holder, hit, kind, storage = self.lookup(t, stable, version)
        if not hit:
            # a strided slice, or a dense piece of a larger storage (x[i], x[:2], a chunk): its
            # elements may be stored already (a tensor owning all of its storage never is)
            if self._recent and (kind == "id" or (kind == "span" and _partial(t, storage))):
                return holder, self._within(t, version, holder, storage), False
            return holder, None, False
        if not self.keep_bytes:
            return holder, None, True
        if kind == "id":
            return holder, SAME_LAYOUT, True
        # a span hit: contiguous, or (on CPU) a dense permutation of the span, which is stored
        # in memory order
        return holder, span_strides(t), True

    def decide(self, t: torch.Tensor, stable: bool, version: int | None, measured: bool
               ) -> tuple[list | None, str | Within | None, bool, bool]:
        """(share, shared, measure, copy): what one record needs, decided once for both writers
        (each then does it its way: now, or in the async writer's thread). `share` and
        `shared` as `plan` says; `measure`: it needs statistics of its own (else it has them:
        the caller's, or the holder's); `copy`: it needs a snapshot of its bytes (tensor/full
        mode, stored nowhere yet). `measured`: the caller brings the record's statistics
        (`Writer.add`'s `stats`); such a record reuses only the bytes `same_bytes` pointed it
        at, and offers nothing for reuse."""
        if measured:
            same = self.take_same(t)
            if same is not None:
                return same[0], same[1], False, False
            return None, None, False, self.keep_bytes
        share, shared, skip = self.plan(t, stable, version)
        if skip:
            return share, shared, False, False
        # a `Within` has its bytes stored already: statistics only
        return share, shared, True, self.keep_bytes and shared is None
