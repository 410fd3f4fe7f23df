"""Where a record is made: module hooks and the module stack, the op dispatch mode, record names
(`CallNames`, which the profiler and the IR exporter use too, so all three name a module call
alike), the user's source line, each optimizer step's parameter, gradient and update records,
the gradient scaler's skipped steps, and the setup around the model (optimizer, clipping,
config, module constants, buffers, flags) taken with each dumped step.

`tracer.Dumper` drives these and hands each record to `tracer.storage`; nothing here writes a
file. Names load lazily (sleuth.common.lazy_exports); a test pins this list.
"""
from __future__ import annotations

from sleuth.common import lazy_exports as _lazy_exports

_EXPORTS: dict[str, str] = {
    "CallNames": "tracer.capture._naming",
    "compiled_inner": "tracer.capture._naming",
    "encode_call": "tracer.capture._calls",
    "EagerWhileDumped": "tracer.capture._compiled",
    "fingerprint": "tracer.capture._setup",
    "KERNEL_OP": "tracer.capture._naming",
    "Kernels": "tracer.capture._param_records",
    "local_shard": "tracer.capture._param_records",
    "in_graph_capture": "tracer.capture._graphs",
    "ModuleTracker": "tracer.capture._module_hooks",
    "tool_range": "tracer.capture._module_hooks",
    "OpMode": "tracer.capture._op_mode",
    "on_clip": "tracer.capture._setup",
    "on_region": "tracer.capture._regions",
    "on_scaler_scale": "tracer.capture._scaler",
    "on_scaler_unscale": "tracer.capture._scaler",
    "on_scaler_update": "tracer.capture._scaler",
    "ParamRecords": "tracer.capture._param_records",
    "recording_closure": "tracer.capture._closure",
    "rewrap": "tracer.capture._scaler",
    "SetupRecorder": "tracer.capture._setup",
    "Site": "tracer.capture._source",
    "user_source": "tracer.capture._source",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
