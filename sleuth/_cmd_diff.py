"""`sleuth diff A B`: compare two dumps record by record and name the first divergent record.

Exit codes: 0 every selected step of both dumps was read completely and agrees within
tolerance; 1 they diverge, or a step is on one side only; 2 something could not be read (a
truncated, unreadable, partial-only or interrupted step, damaged bytes) or an error (bad path,
missing rank/step, dumps that share no record).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Any

from sleuth._cmd_diff_ranks import run_ranks, wants_ranks
from sleuth.cli import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff", help="compare two dumps and name the first divergent record",
        description="Compare dump A with dump B (run directories, dump directories or step "
        "files): per record cosine similarity, max absolute/relative error, RMSE, share within "
        "tolerance, NaN/Inf differences (or statistics when a side has no tensor bytes), and "
        "the first divergent record in execution order. Exit code 0 same (every selected step read "
        "completely), 1 diverged or a step on one side only, 2 something could not be read "
        "(missing, truncated, damaged, partial-only or interrupted step files are named) or "
        "error.",
    )
    p.add_argument("a", metavar="A", help="run directory, dump directory or step file")
    p.add_argument("b", metavar="B", help="the run to compare with")
    p.add_argument("--step", type=int, help="step of A (default: every step either dump holds; a step on one side only is a problem)")
    p.add_argument("--rank", type=int, help="rank of A (default: every rank, each with the same "
                   "rank of B, and the earliest divergence across ranks)")
    p.add_argument("--b-step", type=int, help="step of B when it differs from --step")
    p.add_argument("--b-rank", type=int, help="rank of B when it differs from --rank")
    p.add_argument("--rtol", type=float, help="relative tolerance (default: per dtype)")
    p.add_argument("--atol", type=float, help="absolute tolerance (default: per dtype)")
    p.add_argument("--cosine-min", type=float, help="smallest cosine that counts as the same")
    p.add_argument("--allow-missing", action="store_true",
                   help="compare only the steps both dumps hold complete and readable; the "
                   "steps left out are listed, and do not change the exit code")
    p.add_argument("--top", type=int, default=10, help="worst records to list (default 10)")
    p.add_argument("--csv", metavar="FILE", help="write every record's row to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--workers", type=int, help="local processes for the ranks (default: one "
                   "per core; 1: in this process)")
    p.add_argument("--scheduler", metavar="ADDRESS", help="run the ranks on this Dask "
                   "scheduler (tcp://host:8786; default: $SLEUTH_DASK_SCHEDULER, else local "
                   "processes); workers must see the dumps at the same paths")
    p.add_argument("--progress", action="store_true",
                   help="show progress on stderr (default: only when stderr is a terminal)")
    p.add_argument("--map", metavar="FILE",
                   help="a module map (`sleuth map A B > FILE`): B's modules are read as the A "
                        "modules it pairs them with, to compare two codebases")
    p.set_defaults(run=_run)


def _fmt(v: Any, kind: str = "g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.6f}" if kind == "cos" else f"{v:.3g}"
    return str(v)


_STATUS_LINE = {
    "same": "SAME",
    "diverged": "DIVERGED",
    "incomplete": "INCOMPLETE (a step was not fully read, or was interrupted: see problems; "
                  "exit code 2)",
}


def setup_lines(change: dict[str, Any], most: int = 6) -> list[str]:
    """A setup change (`DiffResult.changes`, kind "setup") in words: one line a difference,
    likeliest cause first, at most `most` of them."""
    found = change["differences"]
    where = f"step {change['step']}" if change["step"] == change["b_step"] else \
        f"A's step {change['step']}, B's step {change['b_step']}"
    lines = [f"the runs were set up differently ({where}; likeliest cause first):"]
    lines += [f"  {d['text']}" for d in found[:most]]
    if len(found) > most:
        lines.append(f"  and {len(found) - most} more setup difference(s) (--json: changes)")
    return lines


def headline(changes: list[dict[str, Any]], explain: str | None = None) -> list[str]:
    """What changed between the runs, in words (`DiffResult.changes`), and the command whose
    verdict says whether that explains the divergence: the report's first lines."""
    lines = []
    for ch in changes:
        if ch["kind"] == "setup":
            lines += setup_lines(ch)
        elif ch["kind"] == "dtype":
            others = "".join(f"; {k.replace('->', ' to ')} in {n}"
                             for k, n in list(ch["others"].items())[:3])
            lines.append(f"B ran in {ch['b']} where A ran in {ch['a']}: {ch['records']} of "
                         f"{ch['paired']} matched records changed dtype{others}, the first at "
                         f"{ch['name']} ({ch['source'] or 'unknown source'}); differences "
                         f"of {ch['b']}'s rounding follow wherever it computes")
        elif ch["kind"] == "data" and ch.get("made_by") and ch.get("batch") == "same":
            # the model's own batch agrees (its fingerprint): no "different data" to speak of
            lines.append(f"{ch['name']} ({ch['dtype']}{' ' + ch['shape'] if ch['shape'] else ''}"
                         f"), made by {ch['made_by']} at {ch['source'] or 'an unknown line'} "
                         f"outside the model before its first call of the step, differs, while "
                         f"the model is given the same batch in both runs: a value the step "
                         f"reads beside the batch (labels, a mask); everything after it follows "
                         f"from it")
        elif ch["kind"] == "data" and ch.get("made_by"):
            detail = f" ({ch['batch_detail']})" if ch.get("batch_detail") else ""
            lines.append(f"the two runs were fed different data: {ch['name']} ({ch['dtype']}"
                         f"{' ' + ch['shape'] if ch['shape'] else ''}), made by {ch['made_by']} "
                         f"at {ch['source'] or 'an unknown line'} outside the model before its "
                         f"first call of the step (the batch), differs{detail}; everything "
                         f"after it follows from it")
        elif ch["kind"] == "data":
            detail = f" ({ch['batch_detail']})" if ch.get("batch_detail") else ""
            lines.append(f"the two runs were fed different data: {ch['name']} ({ch['dtype']}"
                         f"{' ' + ch['shape'] if ch['shape'] else ''}) differs before any "
                         f"recorded op made or changed it{detail}; everything after it follows "
                         f"from it")
        elif ch["kind"] == "written":
            lines.append(written_line(ch) + "; the runs began the step with the same weights, "
                         "and everything after the write follows from it")
        elif ch["kind"] == "parameter" and ch.get("when") == "in_step":
            lines.append(f"{ch['name']} differs when optimizer.step() reads it, while its "
                         f"module {ch['module']}'s forward outputs agree: the weight changed "
                         f"during step {ch['step']} after that forward read it (an in-place "
                         f"write module hooks do not see; level op or mix names it)")
        elif ch["kind"] == "parameter" and ch.get("when") == "unmatched":
            w = ch["write"]
            lines.append(f"{ch['name']} differs when optimizer.step() reads it at step "
                         f"{ch['step']}, and before anything else differed the runs wrote in "
                         f"place differently: {w['op']} at {w['source'] or 'an unknown line'} "
                         f"({w['name']}), a write the records do not tie to the weight (into a "
                         f"part of it, or its input not dumped); whether the runs began the "
                         f"step with different weights is not known")
        elif ch["kind"] == "parameter" and ch.get("when") == "unknown":
            lines.append(f"{ch['name']} differs when optimizer.step() reads it at step "
                         f"{ch['step']}: a module-level dump cannot tell whether the runs began "
                         f"the step with different weights or one wrote it in place during the "
                         f"step (level op or mix names any write)")
        elif ch["kind"] == "parameter":
            lines.append(f"the runs began step {ch['step']} with different weights: {ch['name']} "
                         f"differs before any op ran; everything after it follows from it")
    if explain:
        ask = "that change alone, or a bug too?" if changes else "a bug, or rounding?"
        lines.append(f"{ask} the verdict: {explain}")
    return lines


def written_line(ch: dict[str, Any]) -> str:
    """A weight written in place during the step (`changes` kind "written"), in words: which
    run wrote it, with which op, where."""
    who = {"A": "A wrote {} in place during step {}, B did not",
           "B": "B wrote {} in place during step {}, A did not",
           "both": "both runs wrote {} in place during step {}, to different values"}
    called = f", called from {ch['caller']}" if ch.get("caller") else ""
    return (who[ch["written_by"]].format(ch["param"], ch["step"]) + f": {ch['op']} at "
            f"{ch['source'] or 'an unknown line'}{called} (module {ch['module']}, {ch['name']})")


def explain_command(a: str, b: str, step: int | None = None, rank: int | None = None,
                    module_map: str | None = None, b_step: int | None = None,
                    b_rank: int | None = None) -> str:
    """The `sleuth explain` command line for the runs a diff compared (through the same map),
    with the diff's rank and step selection, so that running it compares the same pair."""
    return _command("explain", a, b, step, rank, module_map, b_step, b_rank)


def diff_command(a: str, b: str, step: int | None = None, rank: int | None = None,
                 b_step: int | None = None, b_rank: int | None = None) -> str:
    """The `sleuth diff` command line for one rank and step pair of A and B."""
    return _command("diff", a, b, step, rank, None, b_step, b_rank)


def _command(verb: str, a: str, b: str, step: int | None, rank: int | None,
             module_map: str | None, b_step: int | None, b_rank: int | None) -> str:
    import shlex

    words = ["sleuth", verb, *(["--map", module_map] if module_map else []), a, b]
    for flag, value in (("--rank", rank), ("--b-rank", b_rank), ("--step", step),
                        ("--b-step", b_step)):
        if value is not None:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def format_report(result: Any, top: int = 10, explain: str | None = None) -> str:
    """The terminal report: status line, what changed (`headline`: dtypes, data, weights) and
    `explain`, the command that gives the verdict, when the runs diverged; problems (files not
    fully read), first divergence, the steps compared when one was interrupted, then the
    table: the first divergent record, the worst others, and the records without a partner."""
    c = result.counts()
    problems = list(getattr(result, "problems", []))
    left_out = list(getattr(result, "left_out", []))
    status = _STATUS_LINE.get(result.status, result.status.upper())
    if left_out:
        status += f" (on the steps both hold complete; {len(left_out)} left out by --allow-missing)"
    lines = [f"status: {status}   compared: "
             f"{result.compared}   records: {sum(c.values())} ({c['same']} same, "
             f"{c['diverged']} diverged, {c['only_a']} only in A, {c['only_b']} only in B)"]
    fd = result.first_divergence
    changes = getattr(result, "changes", [])
    if explain and fd and fd["kind"] not in ("data", "parameter", "written") and (
            result.compared != "tensor" or not fd["op"]) and \
            not any(c["kind"] == "setup" for c in changes):
        explain += " (it re-runs ops: dump both runs at level op or mix, mode tensor or full)"
    lines += headline(changes, explain if fd else None)
    if problems:
        lines += ["", f"problems ({len(problems)}): steps not fully read, or on one side only"]
        lines += [f"  {p.line()}" for p in problems]
    if left_out:
        lines += ["", f"left out by --allow-missing ({len(left_out)}):"]
        lines += [f"  {p.line()}" for p in left_out]
    if fd:
        op = f"   op {fd['op']}" if fd["op"] else ""
        cross = ""
        if (fd["b_step"], fd["b_rank"]) != (fd["step"], fd["rank"]):
            cross = f" vs B step {fd['b_step']}, rank {fd['b_rank']}"
        b_name = fd.get("b_name") or ""
        also = f"\n  in B: {b_name}" if b_name and b_name != fd["name"] else ""
        lines += ["", f"first divergence ({fd['kind']}): {fd['name']}{also}",
                  f"  module {fd['module']}{op}   phase {fd['phase']}   step {fd['step']}   "
                  f"rank {fd['rank']}{cross}",
                  f"  source {fd['source'] or '-'}"
                  + (f"   called from {fd['caller']}" if fd.get("caller") else ""),
                  f"  {fd['reason']}"]
        before = fd.get("unpaired_before") or []
        if before:
            def ops(side: str) -> str:
                mine = [b for b in before if b["side"] == side]
                names = ", ".join(dict.fromkeys(b["op"] or b["name"] for b in mine))
                where = ", ".join(dict.fromkeys(b["source"] for b in mine if b["source"]))
                return f"{side}: {names} ({where or 'unknown source'})" if mine else ""
            sides = "; ".join(x for x in (ops("A"), ops("B")) if x)
            lines.append(f"  right before it the runs ran different ops, which have no partner "
                         f"({sides}): the difference may be made there")
    steps = list(getattr(result, "steps", []))
    if any(s["status"] != "complete" for s in steps):
        lines += ["", "steps compared:"]
        for s in steps:
            verdict = "diverged" if s["diverged"] else "no divergence in the records read"
            mark = f"   {s['status'].upper()}: {s['reason']}" if s["status"] != "complete" else ""
            lines.append(f"  step {s['step']}: {verdict} ({s['same']} same, {s['diverged']} "
                         f"diverged){mark}")
    for note in result.notes:
        lines.append(f"note: {note}")
    c = result.counts()
    lines += _table(result.shown, top, c["only_a"] + c["only_b"])
    return "\n".join(lines)


_HEAD = ("order", "step", "name", "phase", "dtype", "nan/+inf/-inf A | B", "error", "cosine",
         "max_abs", "max_rel", "within", "compared")


def _table(df: Any, top: int, n_unpaired: int) -> list[str]:
    """The first divergent record, the worst others (by `error`), then the records without a
    partner (named, after every real divergence, never ranked among them): `DiffResult.shown`,
    whose divergent rows come first, then worst first."""
    rows = df[df["verdict"] == "diverged"].to_dict("records")
    unpaired = df[df["verdict"].isin(["only_a", "only_b"])].to_dict("records")
    if not rows and not unpaired:
        return []
    table = rows[:max(top, 1)] if rows else []
    table += unpaired[:top]
    cells = [[str(r["order"]), _step(r), r["name"] or r["b_name"], r["phase"],
              r["dtype"] if r["dtype"] == r["b_dtype"] else f"{r['dtype'] or '-'}/"
              f"{r['b_dtype'] or '-'}", _counts(r), _fmt(r["error"]),
              _fmt(r["cosine"], "cos"), _fmt(r["max_abs_err"]),
              _fmt(r["max_rel_err"] if r["compared"] in ("tensor", "sketch")
                   else r["max_rdiff"]),
              _fmt(r["within"]), r["compared"] or r["verdict"]] for r in table]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(_HEAD)]
    widths[2] = min(widths[2], 70)
    title = (f"divergent records (first, then the worst {max(len(table) - len(unpaired[:top]) - 1, 0)})"
             if rows else "records")
    if unpaired:
        title += f"; then {min(len(unpaired), top)} of {n_unpaired} without a partner"
    lines = ["", title + ":", "  ".join(h.ljust(w) for h, w in zip(_HEAD, widths))]
    for cell in cells:
        if len(cell[2]) > widths[2]:
            cell[2] = "..." + cell[2][-(widths[2] - 3):]
        lines.append("  ".join(v.ljust(w) for v, w in zip(cell, widths)).rstrip())
    return lines


def _step(r: dict) -> str:
    if (r["b_step"], r["b_rank"]) != (r["step"], r["rank"]):
        return f"{r['step']}/{r['b_step']}"
    return str(r["step"])


def _counts(r: dict) -> str:
    """NaN/+Inf/-Inf counts of each side ("-" for a side without the record)."""
    def side(prefix: str) -> str:
        n = r.get(prefix + "nan")
        if n is None or (isinstance(n, float) and math.isnan(n)) or int(n) < 0:
            return "-"
        return f"{int(n)}/{int(r[prefix + 'posinf'])}/{int(r[prefix + 'neginf'])}"
    return f"{side('')} | {side('b_')}"


class _RowSinks:
    """Where a streamed diff's rows go, step by step, so that memory holds one step's rows
    whatever the dump's size: the --csv file, and for --json a temporary file spliced into the
    JSON object at the end (the answer's status is known only then)."""

    def __init__(self, csv_path: str | None, json_rows: bool) -> None:
        self.csv_path, self.json_rows = csv_path, json_rows
        self.csv = self.tmp = None
        self.csv_file: Any = None  # tracer.storage.atomic_file: the rows appear whole or not
        self.header = True
        self.first = True

    def __enter__(self) -> "_RowSinks":
        if self.csv_path:
            # beside the target, renamed over it once the diff ends: a diff that fails leaves
            # a file the user had there as it was
            folder = os.path.dirname(os.path.abspath(self.csv_path))
            if not os.path.isdir(folder):
                raise CliError(f"cannot write {self.csv_path}: the folder {folder} does not "
                               "exist")
            from tracer.storage import atomic_file

            try:
                self.csv_file = atomic_file(self.csv_path, "w", newline="")
                self.csv = self.csv_file.__enter__()
            except OSError as e:
                raise CliError(f"cannot write {self.csv_path}: {e}") from e
        if self.json_rows:
            self.tmp = tempfile.TemporaryFile("w+")
        return self

    def add(self, rows: list[dict]) -> None:
        from tracer import DiffResult

        if self.csv is not None:
            try:
                DiffResult.frame(rows).to_csv(self.csv, index=False, header=self.header)
            except OSError as e:
                raise CliError(f"cannot write {self.csv_path}: {e}") from e
            self.header = False
        if self.tmp is not None:
            for r in DiffResult.json_rows(rows):
                self.tmp.write(("" if self.first else ", ") + json.dumps(r, allow_nan=False))
                self.first = False

    def print_json(self, head: dict) -> None:
        """`head` with "records": every row written so far."""
        text = json.dumps(head, allow_nan=False)
        sys.stdout.write(text[:-1] + (', "records": [' if head else '"records": ['))
        self.tmp.seek(0)
        while chunk := self.tmp.read(1 << 20):
            sys.stdout.write(chunk)
        sys.stdout.write("]}\n")
        sys.stdout.flush()

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if self.csv is not None:
            try:
                if self.header and kind is None:  # no step compared: the header alone
                    from tracer import DiffResult

                    DiffResult.frame([]).to_csv(self.csv, index=False)
            except BaseException as e:
                self.csv_file.__exit__(type(e), e, e.__traceback__)  # removes the partial
                raise CliError(f"cannot write {self.csv_path}: {e}") from e
            try:  # renamed into place, or (after an error, or a full disk now) removed
                self.csv_file.__exit__(kind, *exc)
            except OSError as e:
                raise CliError(f"cannot write {self.csv_path}: {e}") from e
            if kind is None:
                print(f"sleuth diff: the records' rows written to {self.csv_path}",
                      file=sys.stderr)
        if self.tmp is not None:
            self.tmp.close()


def _run(args: argparse.Namespace) -> int:
    import tracer
    from tracer import TracerError

    if args.workers is not None and args.workers < 1:
        raise CliError(f"--workers {args.workers}: give 1 or more")
    try:
        tol = tracer.Tolerance(rtol=args.rtol, atol=args.atol, cosine_min=args.cosine_min)
        module_map = None
        if args.map:
            from tracer.analysis import read_module_map

            module_map = read_module_map(args.map)
            if args.rank is None:
                args.rank = 0  # a map pairs one rank's modules: the other ranks have the same
        if wants_ranks(args):
            if args.csv:
                raise CliError("--csv writes one rank pair's records: choose it with --rank R")
            return run_ranks(args, tol)
        progress = args.progress or sys.stderr.isatty()
        with _RowSinks(args.csv, args.json) as sinks:
            result = tracer.diff(args.a, args.b, step=args.step, rank=args.rank,
                                 b_step=args.b_step, b_rank=args.b_rank, tolerance=tol,
                                 progress=progress, allow_missing=args.allow_missing,
                                 module_map=module_map, keep_records=False,
                                 keep_worst=max(args.top, 1), on_rows=sinks.add)
            if args.json:
                sinks.print_json(result.to_dict(records=False))
    except TracerError as e:
        raise CliError(str(e)) from e
    if not args.json:
        print(format_report(result, args.top,
                            explain_command(args.a, args.b, args.step, args.rank,
                                            args.map, args.b_step, args.b_rank)))
    return result.exit_code
