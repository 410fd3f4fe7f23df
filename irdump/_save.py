"""`save_graphs`: capture the requested stages of a model and write them in every format.

Stage files are `PATH/{number:02d}_{stage}.{ir,sorted.ir,dot,svg}`; the numbers are fixed per
stage so a stage always sorts to the same place whatever else was saved.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from irdump._errors import CaptureError, IrDumpError
from irdump._graph import Graph

Stage = Literal["forward", "forward_aten_decomposed", "backward", "forward_eager"]
Format = Literal["ir", "sorted", "dot", "svg"]
STAGES: dict[str, int] = {"forward": 0, "forward_aten_decomposed": 1, "backward": 2,
                          "forward_eager": 3}
EXTENSIONS: dict[str, str] = {"ir": ".ir", "sorted": ".sorted.ir", "dot": ".dot", "svg": ".svg"}
DEFAULT_STAGES: tuple[Stage, ...] = ("forward", "forward_aten_decomposed", "backward",
                                     "forward_eager")
DEFAULT_FORMATS: tuple[Format, ...] = ("ir", "sorted", "dot", "svg")


def normalize_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """A tensor, a tuple/list of positional arguments, or a dict of keyword arguments."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def default_loss(output: Any) -> Any:
    """Sum of every floating-point output tensor that requires grad (a `loss` key wins)."""
    import torch
    from torch.utils._pytree import tree_leaves

    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    parts = [t.float().sum() for t in tree_leaves(output)
             if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not parts:
        raise CaptureError("the backward stage needs an output that requires grad; pass "
                           "loss_fn=... or leave 'backward' out of stages")
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def rng_devices(model: Any, inputs: Any) -> list[int]:
    """The CUDA devices whose RNG a call of `model` on `inputs` may draw from (dropout), for
    `torch.random.fork_rng`, which forks the CPU generator in any case."""
    import torch
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    tensors += list(model.parameters()) + list(model.buffers())
    return sorted({torch.cuda.current_device() if t.device.index is None else t.device.index
                   for t in tensors if t.device.type == "cuda"})


def _check(values: Sequence[str], allowed: Sequence[str], what: str) -> None:
    import difflib

    for v in values:
        if v not in allowed:
            close = difflib.get_close_matches(v, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; use {', '.join(allowed)}"
            raise IrDumpError(f"unknown {what} {v!r}{hint}")


def capture_graphs(model: Any, example_inputs: Any, stages: Sequence[str] = DEFAULT_STAGES,
                   loss_fn: Callable[[Any], Any] | None = None, *,
                   example_kwargs: dict | None = None, fallback: bool = True) -> list[Graph]:
    """Capture `stages` of `model` called on `example_inputs`, without changing the model.

    Export runs on fake tensors. The traced call (fallback forward, `forward_eager`, and the
    loss for `backward`) runs on cloned inputs with the RNG state (CPU and every CUDA device
    the model or inputs are on) forked and buffers restored afterwards, and never calls
    backward, so parameters, gradients and RNG are left as found.

    `example_kwargs` are keyword arguments passed with positional `example_inputs`.
    `fallback=False` never runs the model on real tensors for the forward stages: when export
    fails they raise CaptureError instead (one process of several must not run a forward the
    others do not, whose collectives would leave the ranks out of step).
    """
    import torch

    from irdump._capture_backward import capture_backward
    from irdump._capture_dispatch import capture_dispatch
    from irdump._capture_export import export_program, graph_from_export

    _check(stages, list(STAGES), "stage")
    args, kwargs = normalize_inputs(example_inputs)
    kwargs.update(example_kwargs or {})
    graphs: dict[str, Graph] = {}
    program, fell_back = None, ""
    if {"forward", "forward_aten_decomposed"} & set(stages):
        try:
            program = export_program(model, args, kwargs)
        except CaptureError as e:
            if not fallback:
                raise
            fell_back = f"{e}; fell back to one traced call (dispatch)"
    if program is not None and "forward" in stages:
        graphs["forward"] = graph_from_export(program, model, "forward", "torch.export")
    if program is not None and "forward_aten_decomposed" in stages:
        with warnings.catch_warnings():  # torch's own pytree deprecation noise
            warnings.simplefilter("ignore", FutureWarning)
            decomposed = program.run_decompositions()
        graphs["forward_aten_decomposed"] = graph_from_export(
            decomposed, model, "forward_aten_decomposed", "torch.export+decompositions")
    if fell_back or {"backward", "forward_eager"} & set(stages):
        cargs, ckwargs = torch.utils._pytree.tree_map(
            lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        try:
            with torch.random.fork_rng(devices=rng_devices(model, (cargs, ckwargs))), \
                    torch.enable_grad():
                capture, output = capture_dispatch(model, cargs, ckwargs, "forward_eager")
                eager = capture.graph
                assert eager is not None
                if "backward" in stages:
                    loss = (loss_fn or default_loss)(output)
                    params = {id(p): n for n, p in model.named_parameters()}
                    graphs["backward"] = capture_backward(loss, eager, capture.grad_fn_links,
                                                          params, eager.modules)
        finally:
            with torch.no_grad():
                for n, b in model.named_buffers():
                    if n in buffers:
                        b.copy_(buffers[n])
        if "forward_eager" in stages:
            graphs["forward_eager"] = eager
        for stage in ("forward", "forward_aten_decomposed"):
            if fell_back and stage in stages:
                notes = (fell_back,) + (("the traced call already records dispatched aten ops",)
                                       if stage == "forward_aten_decomposed" else ())
                graphs[stage] = dataclasses.replace(eager, stage=stage, notes=notes)
    return [graphs[s] for s in sorted(graphs, key=STAGES.__getitem__)]


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (the door's atomic_file: a full disk leaves
    no half-written graph behind)."""
    from tracer.storage import atomic_file

    with atomic_file(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def write_graphs(graphs: Sequence[Graph], path: str | os.PathLike,
                 formats: Sequence[str] = DEFAULT_FORMATS, depth: int | None = None,
                 sort_mode: str | None = None) -> list[Path]:
    """Write each graph in each format under `path`; return the written paths in order."""
    from irdump._dot import render_svg, to_dot
    from irdump._text import to_ir, to_sorted_ir

    _check(formats, list(EXTENSIONS), "format")
    mode = sort_mode or os.environ.get("SLEUTH_SAVE_GRAPHS_SORT_MODE") or "module"
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for g in graphs:
        stem = f"{STAGES[g.stage]:02d}_{g.stage}"
        dot = to_dot(g, depth=depth) if {"dot", "svg"} & set(formats) else ""
        for fmt in formats:
            if fmt == "ir":
                text = to_ir(g)
            elif fmt == "sorted":
                text = to_sorted_ir(g, mode)  # type: ignore[arg-type]
            else:
                text = dot if fmt == "dot" else render_svg(dot)
            target = out / (stem + EXTENSIONS[fmt])
            write_atomic(target, text)
            written.append(target)
    return written


def save_graphs(model: Any, example_inputs: Any, path: str | os.PathLike,
                formats: Sequence[Format] = DEFAULT_FORMATS,
                stages: Sequence[Stage] = DEFAULT_STAGES, depth: int | None = None,
                loss_fn: Callable[[Any], Any] | None = None,
                sort_mode: Literal["module", "op"] | None = None) -> list[Path]:
    """Capture `model` on `example_inputs` and write the requested stages and formats.

    Args:
        model: an `nn.Module`; it is left unchanged (see `capture_graphs`).
        example_inputs: a tensor, a tuple of positional arguments or a dict of keywords.
        path: output folder (a run directory's `ir/`); created if missing.
        formats: any of `ir`, `sorted`, `dot`, `svg` (`svg` needs Graphviz `dot`).
        stages: any of `forward`, `forward_aten_decomposed`, `backward`, `forward_eager`.
        depth: collapse modules nested deeper than this in `.dot`/`.svg` (None: automatic).
        loss_fn: output -> scalar loss for `backward` (default: sum of float outputs).
        sort_mode: `.sorted.ir` grouping, `module` or `op` (default:
            `$SLEUTH_SAVE_GRAPHS_SORT_MODE` or `module`).

    Returns: the written files, stage by stage, format by format.
    Raises: CaptureError (nothing could be captured), RenderError (no `dot` for svg),
        IrDumpError (an unknown stage, format or sort mode).
    """
    graphs = capture_graphs(model, example_inputs, stages, loss_fn)
    return write_graphs(graphs, path, formats, depth, sort_mode)
