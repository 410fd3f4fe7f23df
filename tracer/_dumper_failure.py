"""How the Dumper goes off when its own work fails: raise, or warn once and let the run go on.

`FailureHandling` is the part of `tracer.Dumper` (tracer._dumper) that a failure of writing, a
hook, the optimizer hook or a claim on the run directory goes through (`_fail`, also a member
the capture hooks call: `tracer.capture.Recorder`): the config's on_error and SLEUTH_STRICT say
whether the run stops; otherwise the dump is FAILED at once and its hooks and writer come off
at the next step boundary (`_after_failure`), where taking them off is safe.
"""
from __future__ import annotations

from sleuth.common import go_off
from tracer._config import STOPPED_BY, DumpConfig
from tracer._errors import TracerError, WatchpointHit
from tracer._lifecycle import LIVE, Lifecycle


def disarm_flight_recorder(config: DumpConfig, rank: int) -> None:
    from tracer.storage import disarm_flight_recorder as disarm

    disarm(config, rank)


class FailureHandling:
    """A failure of `tracer.Dumper`'s own work, and the writer of a dump that failed."""

    def _fail(self, error: Exception) -> None:
        """A failure of the dump's own work (writing, a hook, the optimizer hook, a claim on the
        run directory): raised where the config `raises()` (on_error "raise", SLEUTH_STRICT=1)
        or a watchpoint asked to stop the run; otherwise the dump goes off with one warning,
        its flight recorder disarmed so nothing more is written, and the run goes on. Called
        again with the error it raised (a hook above the one that failed), it raises it again."""
        if isinstance(error, WatchpointHit):
            raise error
        off = f"the tensor dump is off from step {self.current_step} on"
        if self.config.raises():
            go_off(error, tool=f"dumping step {self.current_step}", off=off,
                   raise_as=TracerError, raises=True, stopped_by=STOPPED_BY)
        if self._state in LIVE:
            # hooks come off at the next step boundary (`_after_failure`): this may run inside
            # the dispatch mode's handler, where popping the mode would pop someone else's
            self._to(Lifecycle.FAILED)
        elif self._state is not Lifecycle.CLOSING:  # (closing: close() takes everything off)
            return  # switched off already, and said so
        try:
            disarm_flight_recorder(self.config, self.rank)
        except Exception:  # noqa: BLE001 - restoring the previous hooks is best effort
            pass
        go_off(error, tool="tensor dump", off=off, raises=False, stacklevel=3)

    def _after_failure(self) -> None:
        """At a step boundary after a failure: the hooks and the writer come off."""
        if self._state is Lifecycle.FAILED:
            self._uninstall()
            self._drop_writer()
            self._to(Lifecycle.OFF)

    def _drop_writer(self) -> None:
        """Close the writer of a dump that failed: its threads stop, its rank lock is released.
        What it still has to say was warned about already."""
        writer, self._writer = self._writer, None
        self._open = False
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - the dump is off; the failure is reported
                pass
