"""The `sleuth` entry point: one argparse parser, one sub-command per module.

Each sub-command lives in `sleuth/_cmd_<name>.py` and exposes `register(subparsers)`, which adds
its parser and sets `run=<function(args) -> int>` as a default. Command modules import torch and
the tool packages inside `run`, never at module level, so `sleuth --help` stays fast.

Exit codes: 0 success, 1 a finding (for `diff`: the runs diverge; for `check`: a watchpoint
hit), 2 an error the message explains, 130 Ctrl-C, 141 the reader of stdout went away.

Bad input never ends in a traceback: Sleuth's own errors (each package's base error) and known
bad input (OSError on a user's path, an unreadable HDF5 or JSON file) become one line naming
what is wrong, exit 2. `--debug` or SLEUTH_DEBUG=1 lets them through with their traceback, for
bug reports. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from sleuth import __version__

# Base classes of the errors each package raises on purpose (their messages say how to fix).
_PACKAGE_ERRORS = (("tracer", "TracerError"), ("profiler", "ProfilerError"),
                   ("trainer", "TrainerError"), ("irdump", "IrDumpError"),
                   ("dashboard", "DashboardError"),
                   ("sleuth.common", "UntrustedFileError"))  # the door's refusal, any package's

# Order here is the order in `sleuth --help`.
_COMMAND_MODULES = (
    "sleuth._cmd_demo",
    "sleuth._cmd_train",
    "sleuth._cmd_generate",
    "sleuth._cmd_run",
    "sleuth._cmd_dump",
    "sleuth._cmd_diff",
    "sleuth._cmd_map",
    "sleuth._cmd_explain",
    "sleuth._cmd_audit",
    "sleuth._cmd_check",
    "sleuth._cmd_profile",
    "sleuth._cmd_ir",
    "sleuth._cmd_dashboard",
    "sleuth._cmd_docs",
)


class CliError(Exception):
    """A user-facing error: printed as `sleuth: error: <message>` with exit code 2."""


_EXTRAS_OWNER = "_sleuth_extras_owner"


class _Parser(argparse.ArgumentParser):
    """The parser of `sleuth` and of every sub-command (argparse makes sub-parsers of the
    parent's class): no abbreviations, since `--ste 2` silently taken as `--step 2` hides a
    typo; a misspelled command or option gets "did you mean"; every error is one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is None or value in action.choices:
            return
        choices = [str(c) for c in action.choices]
        close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise argparse.ArgumentError(action, f"invalid choice {value!r}{hint} (choose from "
                                             f"{', '.join(choices)})")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = super().parse_known_args(args, namespace)
        # a sub-command's parser returns its unknown arguments to its parent, which reports
        # them: remember the innermost parser that had them, whose options a typo is close to
        if extras and not hasattr(namespace, _EXTRAS_OWNER):
            setattr(namespace, _EXTRAS_OWNER, self)
        return namespace, extras

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = self.parse_known_args(args, namespace)
        owner = vars(namespace).pop(_EXTRAS_OWNER, self)
        if extras:
            owner.error(owner._unrecognized(extras))
        return namespace

    def _unrecognized(self, extras: list[str]) -> str:
        options = [e for e in extras if e.startswith("-") and len(e) > 1]
        if not options:
            return f"unrecognized arguments: {' '.join(extras)}"
        typo = options[0].split("=", 1)[0]
        hint = f"; did you mean {close}?" if (close := self._closest_option(typo)) else ""
        return f"unrecognized option {typo}{hint}"

    def _closest_option(self, typo: str) -> str | None:
        """The option `typo` most likely meant: the one it abbreviates, else the closest in
        spelling (compared without the dashes, which every option shares)."""
        known = [o for o in self._option_string_actions if o.startswith("--")]
        prefixed = [o for o in known if o.startswith(typo)] if typo.startswith("--") else []
        if len(prefixed) == 1:
            return prefixed[0]
        names = {o.lstrip("-"): o for o in known}
        close = difflib.get_close_matches(typo.lstrip("-"), list(names), n=1, cutoff=0.7)
        return names[close[0]] if close else None

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sleuth",
        description="Debug and profile PyTorch training runs: dump tensors, find where two runs "
        "diverge, profile steps, export graphs, and browse it all in a dashboard.",
        epilog="Every command reads or writes a run directory (`sleuth docs readme`). "
        "`sleuth COMMAND --help` for a command's options; `sleuth docs` lists the guides.",
    )
    parser.add_argument("--version", action="version", version=f"sleuth {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (also SLEUTH_DEBUG=1), for "
                        "bug reports")
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
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "run", None):
            parser.print_help()
            return 2
    except BrokenPipeError:  # `sleuth --help | head -1`
        return _stdout_closed()
    debug = args.debug or os.environ.get("SLEUTH_DEBUG", "").strip() not in ("", "0")
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except CliError as e:
        if debug:
            raise
        print(f"sleuth {args.command}: error: {_printable(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sleuth {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _stdout_closed()
    except Exception as e:
        message = None if debug else user_error_message(e)
        if message is None:
            raise
        print(f"sleuth {args.command}: error: {_printable(message)}", file=sys.stderr)
        return 2


def _printable(message: object) -> str:
    """An error's text as the terminal may show it: run ids, paths and names from disk carry
    control characters and undecodable bytes (tracer.storage.printable)."""
    from tracer.storage import printable

    return printable(message)


def user_error_message(e: BaseException) -> str | None:
    """One line for an error caused by bad input, or None for a bug (which keeps its traceback).

    Bad input is an error a package raises on purpose, an OSError (a missing or unreadable
    path, an HDF5 file h5py cannot open), or a file that is not valid JSON or UTF-8."""
    for package, name in _PACKAGE_ERRORS:
        module = sys.modules.get(package)  # an error of a package that was never imported
        base = getattr(module, name, None)  # cannot be one of its errors
        if base is not None and isinstance(e, base):
            return str(e)
    if isinstance(e, json.JSONDecodeError):
        return f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
    if isinstance(e, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({e.reason} at byte {e.start}); is it the right file?"
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        what = e.strerror or str(e) or type(e).__name__
        return f"{where}{what}; check the path and that the file is complete and readable"
    return None


def _stdout_closed() -> int:
    """The reader of stdout (`| head`) went away: stop quietly. Point stdout at devnull so the
    interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real file (a test's capture): nothing will flush it at exit
    return 141


def entry() -> None:
    """Console-script entry point. Ctrl-C at any point (while the commands load, too) is one
    line and exit code 130."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("sleuth: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)
