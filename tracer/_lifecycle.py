"""`Lifecycle`: where a `tracer.Dumper` is in its life, and the transitions it may make.

One field instead of a row of flags (capturing, enabled, failed, closed, ...): each state says
what is installed and what may still happen, and every change goes through `Lifecycle.to`,
which refuses a transition this table does not list::

    IDLE <-> CAPTURING          a selected step begins (hooks in) / ends (step written)
    IDLE, CAPTURING -> FAILED   the dump's own work failed (on_error "warn")
    FAILED -> OFF               at the next step boundary: hooks and writer taken off
    IDLE -> OFF                 the writer switched the dump off after an error it reported
    any but CLOSED -> CLOSING   close() begins: the last step is written
    CLOSING -> CLOSED           close() is done
    any -> CLOSED               the Dumper leaves the process (a fork's child, a DataLoader
                                worker) without touching the dump; the only way out of
                                CLOSED is this, to CLOSED

Beside the state the Dumper keeps whether the writer holds the current step open (the writer
begins a step at its first record): a step can be open only while CAPTURING, or after a failure
or at close, until it is written or its writer dropped. No torch here.
"""
from __future__ import annotations

import enum


class Lifecycle(enum.Enum):
    """The states of a Dumper (`Dumper.state`)."""

    IDLE = "idle"
    """Attached; the current step is not dumped: only the optimizer, scaler and crash hooks."""
    CAPTURING = "capturing"
    """A selected step runs: the module hooks (and the op mode) record into the writer."""
    FAILED = "failed"
    """The dump's own work failed: nothing more is recorded; the hooks and the writer come off
    at the next step boundary (the failure may be inside a hook, where they cannot)."""
    OFF = "off"
    """Attached but recording nothing: a rank not selected, a failure cleaned up, or a writer
    that switched itself off. Only `close()` is left to do."""
    CLOSING = "closing"
    """`close()` is writing the last step and removing the hooks."""
    CLOSED = "closed"
    """Closed, or gone from this process: the end."""

    def to(self, new: Lifecycle, *, step_open: bool = False) -> Lifecycle:
        """`new`, where the Dumper may go there from this state with a step open or not;
        else AssertionError (a bug in the tracer, which a hook reports through on_error)."""
        if new not in _LEGAL[self] or (step_open and new not in STEP_MAY_BE_OPEN):
            raise AssertionError(f"tracer bug: a Dumper went from {self.value} to {new.value}"
                                 + (" with a step open" if step_open else ""))
        return new


_LEGAL: dict[Lifecycle, frozenset[Lifecycle]] = {
    Lifecycle.IDLE: frozenset({Lifecycle.CAPTURING, Lifecycle.FAILED, Lifecycle.OFF,
                               Lifecycle.CLOSING, Lifecycle.CLOSED}),
    Lifecycle.CAPTURING: frozenset({Lifecycle.IDLE, Lifecycle.FAILED, Lifecycle.CLOSING,
                                    Lifecycle.CLOSED}),
    Lifecycle.FAILED: frozenset({Lifecycle.OFF, Lifecycle.CLOSING, Lifecycle.CLOSED}),
    Lifecycle.OFF: frozenset({Lifecycle.CLOSING, Lifecycle.CLOSED}),
    Lifecycle.CLOSING: frozenset({Lifecycle.CLOSED}),
    # a fork while close() finishes: the child's copy, closed but still listed, leaves too
    Lifecycle.CLOSED: frozenset({Lifecycle.CLOSED}),
}

STEP_MAY_BE_OPEN = frozenset({Lifecycle.CAPTURING, Lifecycle.FAILED, Lifecycle.CLOSING})
"""The states in which the writer may hold a step open."""

LIVE = frozenset({Lifecycle.IDLE, Lifecycle.CAPTURING})
"""The states in which the dump still records (`Dumper.enabled`)."""
