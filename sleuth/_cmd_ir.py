"""`sleuth ir`: export a model's graphs (.ir, .sorted.ir, .dot, .svg) without writing code.

The model comes from an importable factory (`MODULE:FACTORY`, called with no arguments) or from
one of the trainer's presets (`--preset tiny`); inputs are random tensors of `--input-shape`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

_STAGES = ("forward", "forward_aten_decomposed", "backward", "forward_eager")
_FORMATS = ("ir", "sorted", "dot", "svg")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "ir", help="export a model's forward/backward graphs as text, DOT and SVG",
        description="Capture a model's graphs (torch.export, falling back to one traced call) "
        "and write RUN/ir/{NN}_{stage}.{ir,sorted.ir,dot,svg}. Example: "
        "sleuth ir mypkg.models:make_model --input-shape 2,16 --out runs/a/ir")
    p.add_argument("factory", nargs="?", metavar="MODULE:FACTORY",
                   help="importable callable returning an nn.Module (the current directory is "
                   "importable), e.g. mypkg.models:make_model")
    p.add_argument("--preset", choices=("tiny", "small"),
                   help="use the trainer's GPT preset instead of a factory")
    p.add_argument("--input-shape", default=None,
                   help="comma-separated input shape, e.g. 2,16 (default for presets: "
                   "2,block_size)")
    p.add_argument("--dtype", default=None,
                   help="input dtype: float32 (default), float16, bfloat16, long, int ... "
                   "(presets: long)")
    p.add_argument("--high", type=int, default=None,
                   help="exclusive upper bound of random integer inputs (default 2; presets: "
                   "the vocabulary size)")
    p.add_argument("--out", default=None,
                   help="output folder (default $SLEUTH_SAVE_GRAPHS_PATH, else "
                   "$SLEUTH_RUN_DIR/ir, else sleuth_run/ir)")
    p.add_argument("--depth", type=int, default=None,
                   help="collapse modules nested deeper than this in .dot/.svg")
    p.add_argument("--stages", nargs="+", choices=_STAGES, default=list(_STAGES),
                   help="stages to write (default: all)")
    p.add_argument("--formats", nargs="+", choices=_FORMATS, default=list(_FORMATS),
                   help="formats to write (default: all; svg needs Graphviz `dot`)")
    p.add_argument("--sort-mode", choices=("module", "op"), default=None,
                   help=".sorted.ir grouping (default $SLEUTH_SAVE_GRAPHS_SORT_MODE or module)")
    p.add_argument("--eval", action="store_true", help="put the model in eval mode first")
    p.add_argument("--json", action="store_true", help="print the written paths as JSON")
    p.set_defaults(run=_run)


def _load_factory(spec: str) -> Any:
    import importlib

    from sleuth.cli import CliError

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"expected MODULE:FACTORY (e.g. mypkg.models:make_model), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise CliError(f"cannot import {module_name!r}: {e}; run from the folder that holds it "
                       "or set PYTHONPATH") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _build(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    from sleuth.cli import CliError

    torch.manual_seed(0)
    if bool(args.preset) == bool(args.factory):
        raise CliError("give exactly one of MODULE:FACTORY or --preset")
    dtype_name, high, shape_text = args.dtype, args.high, args.input_shape
    if args.preset:
        import trainer

        config = getattr(trainer, args.preset)().model
        model = trainer.GPT(config)
        dtype_name = dtype_name or "long"
        high = high or config.vocab_size
        shape_text = shape_text or f"2,{config.block_size}"
    else:
        model = _load_factory(args.factory)()
        if not isinstance(model, torch.nn.Module):
            raise CliError(f"{args.factory} returned {type(model).__name__}, not an nn.Module")
    if not shape_text:
        raise CliError("--input-shape is required with MODULE:FACTORY, e.g. --input-shape 2,16")
    try:
        shape = tuple(int(s) for s in shape_text.split(","))
    except ValueError as e:
        raise CliError(f"--input-shape must be comma-separated integers, got {shape_text!r}") from e
    dtype = getattr(torch, dtype_name or "float32", None)
    if not isinstance(dtype, torch.dtype):
        raise CliError(f"unknown --dtype {dtype_name!r}; use float32, bfloat16, long, ...")
    if dtype.is_floating_point:
        x = torch.randn(shape, dtype=dtype)
    elif dtype == torch.bool:
        x = torch.randint(0, 2, shape).bool()
    else:
        x = torch.randint(0, high or 2, shape, dtype=dtype)
    if args.eval:
        model.eval()
    return model, x


def _run(args: argparse.Namespace) -> int:
    import irdump
    from irdump._attach import output_dir
    from sleuth.cli import CliError

    model, x = _build(args)
    out = args.out or output_dir()
    try:
        paths = irdump.save_graphs(model, (x,), out, formats=tuple(args.formats),
                                   stages=tuple(args.stages), depth=args.depth,
                                   sort_mode=args.sort_mode)
    except irdump.IrDumpError as e:
        raise CliError(str(e)) from e
    if args.json:
        print(json.dumps([str(p) for p in paths]))
    else:
        for p in paths:
            print(p)
    return 0
