"""`sleuth map A B`: which module of dump B is which module of dump A, for two codebases.

Prints an editable YAML module map (tracer.analysis._map) for `sleuth diff --map FILE A B`.
Exit codes: 0 the map was written; 2 an error (a path, rank or step that is not there).
"""
from __future__ import annotations

import argparse
import sys

from sleuth.cli import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "map", help="pair the modules of two codebases' dumps (for diff --map)",
        description="Pair the modules of dump A with those of dump B, two dumps of the same "
        "weights fed the same batch from two codebases: by parameter values (the checksum, so a "
        "weight stored transposed pairs too), a fused parameter with the parameters it "
        "concatenates (a qkv projection against q, k and v: element counts and checksums add "
        "up), then by forward outputs in execution order. "
        "Prints an editable YAML map; `sleuth diff --map FILE A B` reads it.",
    )
    p.add_argument("a", metavar="A", help="run directory, dump directory or step file")
    p.add_argument("b", metavar="B", help="the other codebase's dump")
    p.add_argument("--rank", type=int, default=0, help="rank of A (default 0)")
    p.add_argument("--step", type=int, help="step of A (default: its first)")
    p.add_argument("--b-rank", type=int, help="rank of B (default: --rank)")
    p.add_argument("--b-step", type=int, help="step of B (default: --step, else its first)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the map to FILE, not stdout")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from tracer import TracerError
    from tracer.analysis import map_modules

    try:
        m = map_modules(args.a, args.b, rank=args.rank, step=args.step, b_rank=args.b_rank,
                        b_step=args.b_step)
    except TracerError as e:
        raise CliError(str(e)) from e
    text = m.to_yaml()
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise CliError(f"cannot write {args.output}: {e.strerror or e}") from e
    else:
        sys.stdout.write(text)
    print(f"sleuth map: {len(m.pairs)} module pair(s), {len(m.fused)} fused module(s) with "
          f"their parts, {len(m.only_a)} module(s) of A and {len(m.only_b)} of B unpaired, "
          f"{len(m.permuted)} parameter(s) stored in another layout", file=sys.stderr)
    return 0
