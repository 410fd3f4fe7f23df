"""A profile's summary in words: the one text `sleuth profile` prints and the dashboard shows."""
from __future__ import annotations

import math
from typing import Any


def _fmt(v: Any, unit: str = "", scale: float = 1.0) -> str:
    """Three significant digits in `unit`, or n/a for what was not measured."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v):
        return "n/a"
    return f"{v * scale:.3g}{unit}"


def summary_lines(s: dict[str, Any]) -> list[str]:
    """`Profile.summary` as lines: ranks, windows and steps; step time in ms, tokens/s, MFU and
    communication share in percent; clamped profiler times; and Sleuth's own work per step
    (which the phases include and the op table leaves out); the GPU figures, or a line saying
    the trace has none (profiler._gpu_time.gpu_lines)."""
    from profiler._gpu_time import gpu_lines

    lines = [f"{s.get('ranks', 'n/a')} rank(s), {s.get('windows', 'n/a')} window(s), "
             f"{s.get('steps', 'n/a')} step(s)",
             f"step time {_fmt(s.get('step_time_s'), ' ms', 1e3)}   tokens/s "
             f"{_fmt(s.get('tokens_per_s'))} (per rank)   MFU {_fmt(s.get('mfu'), ' %', 100)} "
             f"(peak {_fmt(s.get('peak_tflops'))} TFLOP/s)   comm share "
             f"{_fmt(s.get('comm_share'), ' %', 100)}"]
    if s.get("clamped_events"):
        lines.append(f"note: {s['clamped_events']} negative profiler times were clamped to 0")
    tools = s.get("tools") or {}
    if tools:
        per_step = sum(tools.values())
        parts = ", ".join(f"{name} {_fmt(us, ' ms', 1e-3)}" for name, us in tools.items())
        step = s.get("step_time_s")
        without = step - per_step / 1e6 if isinstance(step, (int, float)) else None
        lines.append(f"{'the dump was on in these steps: ' if s.get('dump_on') else ''}Sleuth's "
                     f"own work took {_fmt(per_step, ' ms', 1e-3)} a step ({parts}; "
                     f"{_fmt(s.get('tool_share'), ' %', 100)} of the step time), inside the "
                     f"phases below (tools_us) and left out of the op table; the model's step "
                     f"without it: {_fmt(without, ' ms', 1e3)}")
    if "gpu" in s:  # summaries written before GPU figures existed say nothing about them
        lines.extend(gpu_lines(s["gpu"]))
    return lines
