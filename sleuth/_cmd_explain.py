"""`sleuth explain A B`: is the first divergence a bug or rounding, and which op introduced it.

Exit codes as for `sleuth diff`: 0 the runs agree, 1 they differ (whatever the verdict), 2 error
or not everything could be read.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sleuth.cli import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain", help="tell a bug from rounding: re-run the ops where two runs part",
        description="Diff two op-level tensor dumps (A the reference), then re-run each op on "
        "the divergence chain on A's recorded inputs: B's call in B's dtypes (the error the op "
        "itself adds), and A's call in B's dtypes and in float64 (the rounding it is entitled "
        "to). A first divergence at an op's input or a module record is first judged by where "
        "its value came from. Ends with one verdict: bug (an op that changes the result on "
        "identical inputs, is called with other arguments, is passed another value, or that "
        "only one run runs: added or removed; named with B's line), precision (every op within "
        "its rounding; the ops that lose the most), or inputs differ (a value no recorded op "
        "made). Needs both runs dumped at level op (or mix) with mode tensor (or full).")
    p.add_argument("a", metavar="A", help="the reference run (run, dump directory or step file)")
    p.add_argument("b", metavar="B", help="the run to explain")
    p.add_argument("--step", type=int, help="step of A (default: every step; the first "
                   "divergence's)")
    p.add_argument("--rank", type=int, default=0, help="rank of A (default 0)")
    p.add_argument("--b-step", type=int, help="step of B when it differs from --step")
    p.add_argument("--b-rank", type=int, help="rank of B when it differs from --rank (two "
                   "ranks of one run: A A --rank 0 --b-rank 1)")
    p.add_argument("--limit", type=int, default=20,
                   help="op calls to follow along the chain (default 20)")
    p.add_argument("--factor", type=float, default=4.0,
                   help="how many times its measured rounding an op's error on identical "
                   "inputs may be before it is called a bug (default 4)")
    p.add_argument("--repro", metavar="DIR",
                   help="for a bug, write a one-op repro into DIR: repro_<op>.py and its inputs "
                   "(repro_<op>.h5), runnable with torch, numpy and h5py alone")
    p.add_argument("--map", metavar="FILE",
                   help="a module map (`sleuth map A B > FILE`): B's modules are read as the A "
                        "modules it pairs them with, to explain two codebases")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from tracer import TracerError
    from tracer.analysis import explain

    if args.limit < 1 or not args.factor >= 1:
        raise CliError("--limit must be 1 or more and --factor at least 1")
    try:
        module_map = None
        if args.map:
            from tracer.analysis import read_module_map

            module_map = read_module_map(args.map)
        result = explain(args.a, args.b, step=args.step, rank=args.rank, b_step=args.b_step,
                         b_rank=args.b_rank, limit=args.limit, factor=args.factor,
                         module_map=module_map)
    except TracerError as e:
        raise CliError(str(e)) from e
    repro = _repro(args, result) if args.repro else None
    if args.json:
        out = result.to_dict()
        if repro is not None:
            out["repro"] = repro
        print(json.dumps(out, allow_nan=False))
        return result.exit_code
    print(result.verdict)
    if result.setup and result.status != "setup":
        print("\nthe runs were also set up differently (`sleuth diff` lists each):")
        for d in result.setup[:5]:
            print(f"  {d['text']}")
    if result.chain:
        print("\nthe chain, in execution order (relative errors; received: the inputs', "
              "introduced: B's call on A's inputs, entitled: its measured rounding):")
        rows = [(e["name"], _f(e["received"]), _f(e["introduced"]), _f(e["entitled"]),
                 e["judged"] + (" (non-deterministic)" if e["nondeterministic"] else ""))
                for e in result.chain]
        head = ("op call", "received", "introduced", "entitled", "judged")
        widths = [min(max(len(str(r[i])) for r in (head, *rows)), 70) for i in range(5)]
        for r in (head, *rows):
            print("  " + "  ".join(str(v)[-w:].ljust(w) for v, w in zip(r, widths)).rstrip())
        skipped = [e for e in result.chain if e["judged"] == "not replayed"]
        for e in skipped[:5]:
            print(f"  not re-run: {e['name']}: {e['why']}")
    if result.blamed:
        b = result.blamed
        other = f"only in {b['side']}" if b.get("side") else f"B: {b['b_name']}"
        print(f"\nblamed: {b['name']} ({other})\n  module {b['module']}   phase "
              f"{b['phase']}   step {b['step']}\n  source {b['source'] or '-'}")
    if repro is not None:
        print(f"\n{repro}")
    if result.status == "incomplete":
        print(f"sleuth explain: {result.verdict}", file=sys.stderr)
    return result.exit_code


def _repro(args: argparse.Namespace, result: Any) -> str:
    """Write the one-op repro of the blamed call; what was written, or why nothing was."""
    import tracer
    from tracer import TracerError
    from tracer.analysis import write_repro

    blamed = result.blamed
    if result.status != "bug" or blamed is None:
        return f"no repro: the verdict is {result.status}, no op is blamed"
    if blamed.get("fault") in ("added", "removed", "replaced"):
        return (f"no repro: the ops are blamed for being {blamed['fault']} (one run runs them, "
                "the other does not), not for what they compute; their lines are the place to "
                "look")
    if blamed.get("fault") == "written":
        return (f"no repro: {blamed['op']} is blamed for writing {blamed['param']} in place "
                "during the step, not for what it computes; its line is the place to look")
    if not blamed.get("op"):
        return (f"no repro: module {blamed.get('module')} is blamed for the value it passes on, "
                "not for what an op computes; its line is the place to look")
    if blamed.get("introduced") is None:
        return ("no repro: the op is blamed for the input it receives (an argument passed "
                "wrongly), not for what it computes; its line is the place to look")
    a, b = tracer.open_dump(args.a), tracer.open_dump(args.b)
    try:
        script, data = write_repro(a, b, blamed, result.first_divergence, args.repro)
    except (TracerError, OSError) as e:
        raise CliError(f"--repro {args.repro}: {e}") from e
    finally:
        a.close()
        b.close()
    return f"repro written: python {script}  (inputs in {data})"


def _f(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}"

