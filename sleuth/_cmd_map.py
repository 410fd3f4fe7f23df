"""`sleuth map A B`: which module of dump B is which module of dump A, for two codebases.

Prints an editable YAML module map (tracer.analysis._map) for `sleuth diff --map FILE A B`,
and on stderr how sure the pairs are and which were picked among equal candidates. A file the
user edited is theirs: `-o FILE` refuses to overwrite it, `--keep FILE` maps around it.
Exit codes: 0 the map was written; 2 an error (a path, rank or step that is not there, a map
file that would be overwritten or does not read).
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from sleuth.cli import CliError

_LISTED = 10  # ambiguous pairs printed on stderr; the file lists them all


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "map", help="pair the modules of two codebases' dumps (for diff --map)",
        description="Pair the modules of dump A with those of dump B, two dumps of the same "
        "weights fed the same batch from two codebases: by parameter values (the checksum, so a "
        "weight stored transposed pairs too), a fused parameter with the parameters it "
        "concatenates (a qkv projection against q, k and v: element counts and checksums add "
        "up), then by forward inputs and outputs together and by place in the module tree, so "
        "that a dropout at p = 0 or an Identity never takes a container's place. Each pair "
        "says how sure it is (high, medium, low); pairs picked among equal candidates are "
        "listed as ambiguous. Prints an editable YAML map; `sleuth diff --map FILE A B` "
        "reads it.",
    )
    p.add_argument("a", metavar="A", help="run directory, dump directory or step file")
    p.add_argument("b", metavar="B", help="the other codebase's dump")
    p.add_argument("--rank", type=int, default=0, help="rank of A (default 0)")
    p.add_argument("--step", type=int, help="step of A (default: its first)")
    p.add_argument("--b-rank", type=int, help="rank of B (default: --rank)")
    p.add_argument("--b-step", type=int, help="step of B (default: --step, else its first)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write the map to FILE, not stdout; a FILE edited by hand is not "
                   "overwritten unless it is also --keep")
    p.add_argument("--keep", metavar="FILE",
                   help="a map file whose pairs, fused groups and unpaired lists stand as "
                   "written: only the modules it does not name are paired")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from tracer import TracerError
    from tracer.analysis import map_modules

    try:
        m = map_modules(args.a, args.b, rank=args.rank, step=args.step, b_rank=args.b_rank,
                        b_step=args.b_step, keep=args.keep)
        if args.output:
            m.save(args.output)
        else:
            sys.stdout.write(m.to_yaml())
    except TracerError as e:  # ConfigError: a --keep file that is not a map, an edited -o
        raise CliError(str(e)) from e
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}") from e
    sure = Counter(m.confidence.values())
    levels = ", ".join(f"{sure[k]} {k}" for k in ("given", "high", "medium", "low") if sure[k])
    print(f"sleuth map: {len(m.pairs)} module pair(s) ({levels or 'none'}), {len(m.fused)} fused "
          f"module(s) with their parts, {len(m.only_a)} module(s) of A and {len(m.only_b)} of "
          f"B unpaired, {len(m.permuted)} parameter(s) stored in another layout, "
          f"{len(m.ambiguous)} ambiguous pair(s)", file=sys.stderr)
    paired = {a: b for a, b, _ in m.pairs}
    for a, others, _ in m.ambiguous[:_LISTED]:
        print(f"  ambiguous: {a} -> {paired.get(a, '?')} (as good: {', '.join(others)})",
              file=sys.stderr)
    if len(m.ambiguous) > _LISTED:
        print(f"  ... and {len(m.ambiguous) - _LISTED} more under `ambiguous:` in the map",
              file=sys.stderr)
    return 0
