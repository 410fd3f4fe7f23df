"""The `sleuth` entry point: one argparse parser, one sub-command per module.

Each sub-command lives in `sleuth/_cmd_<name>.py` and exposes `register(subparsers)`, which adds
its parser and sets `run=<function(args) -> int>` as a default. Command modules import torch and
the tool packages inside `run`, never at module level, so `sleuth --help` stays fast.

Exit codes: 0 success, 1 a finding (for `diff`: the runs diverge; for `check`: a watchpoint
hit), 2 an error the message explains.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from sleuth import __version__

# Order here is the order in `sleuth --help`.
_COMMAND_MODULES = (
    "sleuth._cmd_demo",
    "sleuth._cmd_train",
    "sleuth._cmd_generate",
    "sleuth._cmd_run",
    "sleuth._cmd_dump",
    "sleuth._cmd_diff",
    "sleuth._cmd_check",
    "sleuth._cmd_profile",
    "sleuth._cmd_ir",
    "sleuth._cmd_dashboard",
    "sleuth._cmd_docs",
)


class CliError(Exception):
    """A user-facing error: printed as `sleuth: error: <message>` with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sleuth",
        description="Debug and profile PyTorch training runs: dump tensors, find where two runs "
        "diverge, profile steps, export graphs, and browse it all in a dashboard.",
        epilog="Every command reads or writes a run directory (`sleuth docs readme`). "
        "`sleuth COMMAND --help` for a command's options; `sleuth docs` lists the guides.",
    )
    parser.add_argument("--version", action="version", version=f"sleuth {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a real missing dependency inside the command, not its absence
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with `argv` (default: sys.argv[1:]) and return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except CliError as e:
        print(f"sleuth {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
