"""Zero-code attach: `SLEUTH_SAVE_GRAPHS=1` saves the graphs of the first model a process runs.

How it works (kept simple on purpose):
1. A global forward pre-hook sees the first top-level module call of the process, with the
   positional and keyword arguments it was called with. A DistributedDataParallel (or
   DataParallel) wrapper is looked through: the module it wraps is captured at its own call,
   so no capture ever runs the wrapper's collectives. Its forward stages (`forward`,
   `forward_aten_decomposed`) are captured right there by torch.export on fake tensors, or, if
   export fails in a single process, by one traced call on cloned inputs; either way with the
   RNG (CPU and CUDA) forked and buffers restored, so the training step is not disturbed. In a
   run of several processes only rank 0 captures, so it never runs that extra forward (the
   model's own collectives, SyncBatchNorm's for one, would leave the ranks out of step), and
   FSDP models, whose every forward gathers parameters, are not captured.
2. That same real call then runs under the recording dispatch mode (which only observes), giving
   `forward_eager` and the link from each autograd node to its forward op.
3. The first `torch.autograd.backward` call afterwards (so `loss.backward()`) walks the autograd
   graph of the real loss before running it, writes `backward`, and removes the patch. If the
   model is called again before any backward, the backward stage is given up. A first call
   made without gradients (an evaluation before the first step, as nanoGPT does) has no
   backward: `forward_eager` and `backward` are then taken again from the first call made
   with gradients, so the backward graph belongs to a training step.
Only rank 0 (`RANK` unset or 0) writes. Failures warn and never stop the run: a stage that
cannot be captured is named and the others are saved; graphs that cannot be written (a full
disk, an unwritable folder) turn the saver off with one `sleuth: ...` warning. `SLEUTH_STRICT=1`
raises instead, the rule of every tool that observes a run (`sleuth.common.go_off`). Output
goes to `$SLEUTH_SAVE_GRAPHS_PATH`, else `$SLEUTH_RUN_DIR/ir`, else `./sleuth_run/ir`.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

from torch.compiler import is_compiling

from irdump._errors import IrDumpError, RenderError
from irdump._save import DEFAULT_FORMATS
from sleuth.common import SleuthWarning, go_off, strict

_TRUE = ("1", "true", "yes", "on")


def output_dir() -> Path:
    explicit = os.environ.get("SLEUTH_SAVE_GRAPHS_PATH")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("SLEUTH_RUN_DIR") or "sleuth_run") / "ir"


class GraphSaver:
    """Handle of an attached graph saver; `.remove()` is idempotent and it is a context manager."""

    def __init__(self, path: str | os.PathLike, sort_mode: str | None = None) -> None:
        from torch.nn.modules import module as nn_module

        self.path = Path(path)
        self.sort_mode = sort_mode
        self.written: list[Path] = []
        self._model: Any = None
        self._busy = False
        self._capture: Any = None
        self._backward_orig: Any = None
        self._backward_capture: Any = None
        self._await_grad_call = False
        self.removed = False
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._pre_hook),
            nn_module.register_module_forward_hook(self._post_hook, always_call=True),
        ]

    # -- context manager / handle --------------------------------------------------------------
    def __enter__(self) -> GraphSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove the hooks and the backward patch (safe to call twice)."""
        self.removed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._unpatch_backward()
        if self._capture is not None:
            try:
                self._capture.stop()
            except Exception:  # noqa: BLE001 - best effort while tearing down
                pass
            self._capture = None

    # -- hooks ---------------------------------------------------------------------------------
    def _write(self, graphs: list[Any]) -> None:
        """Write `graphs`; when they cannot be written, the saver goes off (`_fail`)."""
        from irdump._save import write_graphs

        try:
            try:
                self.written += write_graphs(graphs, self.path, DEFAULT_FORMATS, None,
                                             self.sort_mode)
            except RenderError as e:
                warnings.warn(f"IR graphs: {e}; writing without svg", SleuthWarning, stacklevel=3)
                formats = tuple(f for f in DEFAULT_FORMATS if f != "svg")
                self.written += write_graphs(graphs, self.path, formats, None, self.sort_mode)
        except OSError as e:
            stages = ", ".join(g.stage for g in graphs)
            self._fail(e, f"writing the {stages} graph(s) to {self.path}")

    def _fail(self, error: BaseException, doing: str) -> None:
        """A write that failed: raised as `_WriteFailed` under SLEUTH_STRICT=1; otherwise one
        `sleuth:` warning, every hook removed (nothing more is captured or written) and the
        run goes on."""
        if not strict():  # the run goes on: nothing more is captured or written
            self.remove()
        go_off(error, tool="IR graphs", off="the IR graphs are off", doing=doing,
               raise_as=_WriteFailed, stacklevel=4)

    def _pre_hook(self, module: Any, args: Any) -> None:
        if self._busy or is_compiling():  # traced by dynamo, the hook would break the graph
            return
        if self._model is not None:
            if module is self._model and self._backward_orig is not None:
                self._give_up_backward()  # called again before any backward
            elif module is self._model and self._await_grad_call and self._capture is None:
                self._capture_grad_call(module, tuple(args), _call_kwargs(sys._getframe(1)))
            return
        if _wrapped(module) is not None:
            return  # the wrapped module's own call comes next: it is the model
        kwargs = _call_kwargs(sys._getframe(1))
        self._model = module
        self._busy = True
        try:
            inner = _compiled(module)
            if inner is not None:
                self._capture_compiled(inner, tuple(args), kwargs)
                return
            self._capture_forward(module, tuple(args), kwargs)
        except _WriteFailed:
            raise
        except Exception as e:  # noqa: BLE001 - never break the user's run
            warnings.warn(f"IR graphs: graph capture failed: {e}", SleuthWarning, stacklevel=2)
            self._capture = None
        finally:
            self._busy = False

    def _capture_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        from irdump._errors import CaptureError
        from irdump._save import capture_graphs, rng_devices

        several = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        graphs = []
        if several and any(_is_fsdp(m) for m in module.modules()):
            # an extra forward would gather parameters on this rank alone: only the real call
            warnings.warn("IR graphs: an FSDP model in a run of several processes: the "
                          "forward and forward_aten_decomposed stages are not saved (their "
                          "capture runs an extra forward, whose all-gathers the other ranks "
                          "would not join); forward_eager and backward are, from the real call. "
                          "Capture the model unsharded with `sleuth ir` for the others",
                          SleuthWarning, stacklevel=4)
            self._capture_real_call(module, args, kwargs, graphs)
            return
        try:
            with _buffers_kept(module), \
                    torch.random.fork_rng(devices=rng_devices(module, (args, kwargs))):
                graphs = capture_graphs(module, args, ("forward", "forward_aten_decomposed"),
                                        example_kwargs=kwargs, fallback=not several)
        except CaptureError as e:  # several processes: no traced call to fall back on
            warnings.warn(f"IR graphs: {e}; the forward stages are not saved in a run of "
                          "several processes (forward_eager and backward still are)",
                          SleuthWarning, stacklevel=4)
        self._capture_real_call(module, args, kwargs, graphs)

    def _capture_compiled(self, module: Any, args: tuple, kwargs: dict) -> None:
        """A torch.compile'd model (`module`, the one its wrapper runs): its forward stages by
        torch.export on fake tensors, and no more. `forward_eager` and `backward` come from
        the real call run under a dispatch mode, which would make dynamo run it eagerly: the
        run would no longer be the compiled run the user trains."""
        from irdump._errors import CaptureError
        from irdump._save import capture_graphs

        graphs = []
        try:
            with _buffers_kept(module):
                graphs = capture_graphs(module, args, ("forward", "forward_aten_decomposed"),
                                        example_kwargs=kwargs, fallback=False)
        except CaptureError as e:
            warnings.warn(f"IR graphs: {e}; the forward stages of the torch.compile'd model "
                          "are not saved", SleuthWarning, stacklevel=5)
        warnings.warn("IR graphs: the model is torch.compile'd: its forward and "
                      "forward_aten_decomposed stages are saved (torch.export, fake tensors); "
                      "forward_eager and backward are not, since recording them runs the call "
                      "eagerly, which would change the compiled run. `sleuth ir` on the model "
                      "before torch.compile saves every stage", SleuthWarning, stacklevel=5)
        self._write(graphs)

    def _capture_real_call(self, module: Any, args: tuple, kwargs: dict, graphs: list) -> None:
        """Write `graphs`, then record the real call for `forward_eager` and `backward` (the
        first call with gradients, where this one has none)."""
        import torch

        from irdump._capture_dispatch import DispatchCapture

        self._write(graphs)
        if self.removed:  # the graphs could not be written: the saver is off
            return
        self._await_grad_call = not torch.is_grad_enabled()
        self._capture = DispatchCapture(module, args, kwargs, root_pushed=True)
        self._capture.start()

    def _capture_grad_call(self, module: Any, args: tuple, kwargs: dict) -> None:
        """The first call with gradients after a first call without: record it for
        `forward_eager` and `backward`."""
        import torch

        from irdump._capture_dispatch import DispatchCapture

        if not torch.is_grad_enabled():
            return
        self._await_grad_call = False
        self._busy = True
        try:
            self._capture = DispatchCapture(module, args, kwargs, root_pushed=True)
            self._capture.start()
        except Exception as e:  # noqa: BLE001 - never break the user's run
            warnings.warn(f"IR graphs: forward_eager capture failed: {e}", SleuthWarning, stacklevel=3)
            self._capture = None
        finally:
            self._busy = False

    def _post_hook(self, module: Any, args: Any, output: Any) -> None:
        if self._busy or is_compiling() or module is not self._model or self._capture is None:
            return
        capture, self._capture = self._capture, None
        try:
            graph = capture.stop(output)
            self._write([graph])
            if not self._await_grad_call and not self.removed:  # no backward without gradients
                self._patch_backward(capture)
        except _WriteFailed:
            raise
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"IR graphs: forward_eager capture failed: {e}", SleuthWarning, stacklevel=2)

    # -- backward ------------------------------------------------------------------------------
    def _patch_backward(self, capture: Any) -> None:
        import torch

        orig = torch.autograd.backward
        saver = self

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            saver._unpatch_backward()
            try:
                from irdump._capture_backward import capture_backward

                params = {id(p): n for n, p in saver._model.named_parameters()}
                graph = capture.graph
                saver._write([capture_backward(tensors, graph, capture.grad_fn_links, params,
                                               graph.modules)])
            except _WriteFailed:
                raise
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"IR graphs: backward capture failed: {e}", SleuthWarning, stacklevel=2)
            finally:
                capture.grad_fn_links.clear()  # do not keep the autograd graph alive
            return orig(tensors, *args, **kwargs)

        self._backward_orig = orig
        self._backward_capture = capture
        torch.autograd.backward = backward  # Tensor.backward looks it up here at each call

    def _unpatch_backward(self) -> None:
        if self._backward_orig is not None:
            import torch

            torch.autograd.backward = self._backward_orig
            self._backward_orig = None

    def _give_up_backward(self) -> None:
        self._unpatch_backward()
        self._backward_capture.grad_fn_links.clear()
        warnings.warn("IR graphs: the model ran again before any backward; the backward "
                      "graph is not saved", SleuthWarning, stacklevel=3)


class _WriteFailed(IrDumpError):
    """Graphs that could not be written, under SLEUTH_STRICT=1: passes the handlers that keep
    a failed capture from breaking the run."""


def _wrapped(module: Any) -> Any:
    """The module a DistributedDataParallel or DataParallel wrapper runs, else None."""
    parallel = sys.modules.get("torch.nn.parallel")
    wrappers = tuple(c for c in (getattr(parallel, "DistributedDataParallel", None),
                                 getattr(parallel, "DataParallel", None)) if c is not None)
    return module.module if wrappers and isinstance(module, wrappers) else None


@contextlib.contextmanager
def _buffers_kept(module: Any) -> Iterator[None]:
    """The module's buffers as found, put back after a capture's extra forward (BatchNorm's
    running statistics as the real call finds them)."""
    import torch

    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                if not torch.equal(b, saved):
                    b.copy_(saved)


def _compiled(module: Any) -> Any:
    """The module a torch.compile wrapper runs compiled (tracer.capture.compiled_inner), else
    None (as well where the compiler's stance is ``force_eager``: the dump config's
    "compiled": "eager" runs a dumped step's call eagerly anyway)."""
    from tracer.capture import compiled_inner

    inner = compiled_inner(module)
    if inner is None:
        return None
    stance = getattr(sys.modules.get("torch._dynamo.eval_frame"), "_stance", None)
    return None if getattr(stance, "stance", "default") == "force_eager" else inner


def _is_fsdp(module: Any) -> bool:
    # FSDP1's wrapper class, or the class FSDP2's fully_shard gives the module (FSDP<Name>)
    return any(c.__name__ in ("FullyShardedDataParallel", "FSDPModule")
               for c in type(module).__mro__)


def _call_kwargs(frame: Any) -> dict:
    """The keyword arguments of the module call whose global forward pre-hooks run now.

    Global pre-hooks get the positional arguments only; the frame of torch's
    `Module._call_impl` that calls them holds the keyword ones. Empty where it cannot be read.
    """
    from torch.nn.modules import module as nn_module

    if frame is None or frame.f_code.co_filename != nn_module.__file__:
        return {}
    kwargs = frame.f_locals.get("kwargs")
    return dict(kwargs) if isinstance(kwargs, dict) else {}


_ATTACHED: GraphSaver | None = None


def attach_from_env() -> GraphSaver | None:
    """Attach when `SLEUTH_SAVE_GRAPHS=1`; return the handle, or None (and do nothing).

    Idempotent: `sleuth._autoattach` may already have attached in this process, in which case
    the same live handle is returned (two savers would nest torch.export calls).
    """
    global _ATTACHED
    if os.environ.get("SLEUTH_SAVE_GRAPHS", "").strip().lower() not in _TRUE:
        return None
    if os.environ.get("RANK", "0") != "0":
        return None
    # importing torch may itself run sleuth's auto-attach, which calls this function: let it
    # finish first so that it and this call share one saver
    import torch  # noqa: F401

    if _ATTACHED is None or _ATTACHED.removed:
        _ATTACHED = GraphSaver(output_dir(),
                               os.environ.get("SLEUTH_SAVE_GRAPHS_SORT_MODE") or None)
    return _ATTACHED
