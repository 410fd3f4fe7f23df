"""attach_from_env: the profiler and the summary writer for a script nobody edited.

`SLEUTH_PROFILE` ("1" or the path of a JSON CollectorConfig) starts a Collector whose steps are
counted by the global optimizer post-step hook; `SLEUTH_SUMMARY=1` starts a SummaryWriter that
logs, at each optimizer step, what is visible without code changes: learning rates, the global
parameter and gradient norms, and (at the histogram frequency) weight and gradient histograms.
The loss is not visible from outside and is not logged. Nothing is installed when neither
variable is set. Files go to $SLEUTH_RUN_DIR (default ./sleuth_run); everything is flushed at
exit.
"""
from __future__ import annotations

import atexit
import os
import weakref
from typing import Any

from profiler._config import CollectorConfig
from profiler._own import own_work

_TRUE = ("1", "true", "yes", "on")


class AttachHandle:
    """What attach_from_env installed; `.remove()` (idempotent) closes and unhooks everything."""

    def __init__(self, run_dir: str, collector: Any, writer: Any) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        self.run_dir = run_dir
        self.collector = collector
        self.writer = writer
        self.steps = 0
        self._primary: Any = None
        self._names: dict[int, str] = {}
        self._roots: weakref.WeakSet[Any] = weakref.WeakSet()
        self._depth = 0
        self._removed = False
        self._handles = [register_optimizer_step_post_hook(self._on_step)]
        if writer is not None:  # find the model's roots to name parameters in histograms
            from torch.nn.modules.module import (register_module_forward_hook,
                                                 register_module_forward_pre_hook)
            self._module_handles = [register_module_forward_pre_hook(self._pre),
                                    register_module_forward_hook(self._post, always_call=True)]
        else:
            self._module_handles = []
        if collector is not None:
            collector.start()
        atexit.register(self.remove)

    def _pre(self, module: Any, args: Any) -> None:
        if self._depth == 0:
            self._roots.add(module)
        self._depth += 1

    def _post(self, module: Any, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _drop_module_hooks(self) -> None:
        handles, self._module_handles = self._module_handles, []
        for h in handles:
            h.remove()

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._primary is None:
            self._primary = weakref.ref(optimizer)
            self._drop_module_hooks()
            for root in list(self._roots):
                for name, p in root.named_parameters():
                    self._names.setdefault(id(p), name)
        if self._primary() is not optimizer:  # several optimizers: count steps of the first
            return
        step = self.steps
        self.steps += 1
        if self.writer is not None:
            self._log(optimizer, step)
        if self.collector is not None:
            self.collector.step()

    def _log(self, optimizer: Any, step: int) -> None:
        import torch
        w = self.writer
        if step % w.frequency["scalar"] == 0:
            values: dict[str, float] = {}
            with torch.no_grad(), own_work("summary"):  # an lr may be a tensor: float() is an op
                for i, group in enumerate(optimizer.param_groups):
                    if "lr" in group:
                        values[f"lr/group{i}"] = float(group["lr"])
                params = [p for g in optimizer.param_groups for p in g["params"]]
                grads = [p.grad for p in params if p.grad is not None]
                if params:
                    values["param_norm"] = torch.linalg.vector_norm(
                        torch.stack([torch.linalg.vector_norm(p.detach().float()) for p in params])).item()
                if grads:
                    values["grad_norm"] = torch.linalg.vector_norm(
                        torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])).item()
            w.add_scalars(values, step)
        if step % w.frequency["histogram"] == 0:
            n = 0
            for g in optimizer.param_groups:
                for p in g["params"]:
                    name = self._names.get(id(p), f"param{n}")
                    n += 1
                    w.add_histogram(f"weights/{name}", p, step)
                    if p.grad is not None:
                        w.add_histogram(f"grads/{name}", p.grad, step)

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        self._drop_module_hooks()
        for h in self._handles:
            h.remove()
        try:
            if self.collector is not None:
                self.collector.close()
        finally:
            if self.writer is not None:
                self.writer.close()
        atexit.unregister(self.remove)

    def __enter__(self) -> AttachHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


_active: AttachHandle | None = None


def attach_from_env() -> AttachHandle | None:
    """Start what SLEUTH_PROFILE / SLEUTH_SUMMARY ask for; None (and no cost) when unset.

    Idempotent: while a handle is attached (e.g. by sleuth's start-up hook), later calls return
    it instead of starting a second profiler, which torch would refuse.
    Raises profiler.ConfigError when SLEUTH_PROFILE names a config file that is invalid.
    """
    global _active
    if _active is not None and not _active._removed:
        return _active
    prof = os.environ.get("SLEUTH_PROFILE", "").strip()
    summ = os.environ.get("SLEUTH_SUMMARY", "").strip().lower()
    want_prof = bool(prof) and prof.lower() not in ("0", "false", "no", "off")
    want_summ = summ in _TRUE
    if not (want_prof or want_summ):
        return None
    run_dir = os.environ.get("SLEUTH_RUN_DIR") or "./sleuth_run"
    collector = writer = None
    if want_prof:
        from profiler._collector import Collector
        config = CollectorConfig() if prof.lower() in _TRUE else CollectorConfig.from_json(prof)
        collector = Collector(run_dir, config=config)
    if want_summ:
        from profiler._summary import SummaryWriter
        kwargs: dict[str, Any] = {}
        if os.environ.get("SLEUTH_SUMMARY_MAX_BYTES"):
            kwargs["max_bytes"] = int(os.environ["SLEUTH_SUMMARY_MAX_BYTES"])
        writer = SummaryWriter(run_dir, **kwargs)
    _active = AttachHandle(run_dir, collector, writer)
    return _active
