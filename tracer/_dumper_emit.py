"""The Dumper's record path: what the capture hooks call for each record, handed to the writer.

`Emitting` is the part of `tracer.Dumper` (tracer._dumper) behind the members the hooks and the
dispatch mode use (`tracer.capture.Recorder`: `emit`, `emit_all`, `emit_call`, `forget`): each
record goes to the writer under the Dumper's lock with the op mode suspended, and the Dumper's
own work on tensors runs through `_quietly`, marked busy so that the hooks pass it by. A tensor
subclass without memory of its own is handed on as a plain tensor of its values (`_values`).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from tracer.capture import Site, encode_call, local_shard
from tracer.storage import stored_extent

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_new = tuple.__new__


def _values(t: torch.Tensor) -> torch.Tensor:
    """`t` where it holds memory of its own, else a plain tensor of its values on this rank.

    A wrapper tensor subclass (DTensor, a quantised or float8 weight, a user's own) has no
    memory behind it, and the writers read memory. A DTensor gives its local shard (the
    parameter records do the same); any other subclass copies its values into a plain tensor
    through its own `copy_`, which it implements as it implements every op. The copy runs
    without autograd so the run's graph is left as it was."""
    if _has_memory(t):
        return t
    with torch.no_grad():
        t = local_shard(t.detach())
        if type(t) is _Tensor or type(t) is _Parameter:
            return t
        return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _has_memory(t: torch.Tensor) -> bool:
    """True when `t`'s storage holds memory that covers its elements.

    The data pointer alone does not tell: a wrapper's storage is empty, but its data pointer
    is the storage's (null) plus its storage offset, and FSDP2 makes its gradient DTensors with
    the local shard's offset, so a reader trusting that pointer reads address 0x1000 and the
    run dies with SIGSEGV."""
    if not t.numel():
        return True
    try:
        storage = t.untyped_storage()
        if not storage.data_ptr():
            return False
        nbytes = storage.nbytes()
    except (RuntimeError, NotImplementedError):  # a wrapper's invalid storage, or none at all
        return False
    extent = stored_extent(tuple(t.shape), t.stride())
    return nbytes >= (t.storage_offset() + extent) * t.element_size()


def in_data_worker() -> bool:
    """True in a DataLoader worker process once its loop runs (see `Dumper._leave_process`)."""
    data = sys.modules.get("torch.utils.data")
    info = getattr(data, "get_worker_info", None)
    return info is not None and info() is not None


class Emitting:
    """The record path of `tracer.Dumper`: its hooks' calls, handed to the writer."""

    def emit(self, scope: str, module: str, op: str, phase: str, direction: str, index: int,
             call: int, source: str, tensor: torch.Tensor, stable: bool = True,
             version: int | None = None, stats: dict | None = None) -> None:
        """Hand one tensor to the writer under its record name (called from the hooks).

        `stable` False: the tensor is an argument or output of an in-place op running in the
        dispatch mode; torch bumps its version counter only after the op returns, so the writer
        must not match its statistics to (or offer them for) another record at that version.
        `version`: the output of a view op in the dispatch mode, which shares its base's
        version counter only after the mode returns: the base's version (see `Writer.add`).
        `stats`: statistics computed already (see `Writer.add`).
        """
        if self._busy or not self.capturing:
            return
        self.emit_all(scope, module, op, phase, direction, call, source, (tensor,), stable,
                      version, index, stats)

    def emit_all(self, scope: str, module: str, op: str, phase: str, direction: str,
                 call: int, source: str, tensors: Sequence[torch.Tensor], stable: bool = True,
                 version: int | None = None, first: int = 0, stats: dict | None = None
                 ) -> None:
        """`emit` for several tensors of one call, indexed from `first`: one pass through the
        lock and the dispatch-mode suspension for all of them. Inline, not through
        `_quietly`: each Python call level costs ~3 us on the caches an op just cooled."""
        if self._busy or not self.capturing or not tensors:
            return
        if phase == "backward":
            self._rule.ran_backward = True
        if not self._open and in_data_worker():
            self._leave_process()
            return
        error = None
        with self._lock:
            self._busy = True
            mode = self._mode
            suspended = False
            try:
                suspended = mode is not None and mode.suspend()
                if not self._open:
                    self._open_step()
                meta, add = self._meta, self._add
                prefix = f"{scope}.{phase}.{call}.{direction}."
                caller = source.caller if type(source) is Site else ""
                for i, t in enumerate(tensors, first):
                    if type(t) is not _Tensor and type(t) is not _Parameter:
                        t = _values(t)  # a tensor subclass
                    # RecordMeta(name, module, op, phase, direction, index, call, source,
                    # caller), made by tuple's own __new__: the named tuple's is a Python call
                    add(_new(meta, (prefix + str(i), module, op, phase, direction, i, call,
                                    source, caller)), t, stable, version, stats)
            except Exception as e:  # noqa: BLE001 - routed through on_error below
                error = e
            finally:
                if suspended:
                    mode.resume()
                self._busy = False
        if error is not None:
            self._fail(error)

    def emit_call(self, name: str, func: Any, args: tuple, kwargs: dict) -> None:
        """Record what re-running an op call needs (its overload and arguments, the tensors
        by input record: tracer.capture._calls) in the step's /calls, before its inputs are
        recorded (its seq is that of its first input record)."""
        if self._busy or not self.capturing:
            return
        if not self._open and in_data_worker():
            self._leave_process()
            return
        error = self._quietly(self._add_call, name, func, args, kwargs)
        if error is not None:
            self._fail(error)

    def _add_call(self, name: str, func: Any, args: tuple, kwargs: dict) -> None:
        if not self._open:
            self._open_step()
        self._writer.add_call(self._writer.next_seq, name, encode_call(func, args, kwargs))

    def _quietly(self, work: Any, *args: Any) -> Exception | None:
        """Run the dump's own `work(*args)` under the lock, marked busy (the hooks ignore what
        it runs) and with the op mode off the dispatch stack; returns its exception."""
        with self._lock:
            self._busy = True
            mode = self._mode
            suspended = False
            try:
                suspended = mode is not None and mode.suspend()
                work(*args)
            except Exception as e:  # noqa: BLE001 - the caller routes it through on_error
                return e
            finally:
                if suspended:
                    mode.resume()
                self._busy = False
        return None

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """Tell the writer these tensors are being written in place (see `Writer.forget`)."""
        if self._writer is not None:
            self._writer.forget(tensors)
