"""The report of `sleuth diff` in words: what changed between the runs (`headline`), the first
divergence, the worst records, the rank x step grid of a diff of several ranks, and the
`sleuth diff` / `sleuth explain` command lines that look closer. Pure functions of a
DiffResult or RanksResult (its dicts), shared by `sleuth diff`, `sleuth demo` and the rank
report."""
from __future__ import annotations

import math
from typing import Any

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


def _has_ops(result: Any) -> bool:
    """Whether the dumps hold op records (level op or mix), which explain re-runs."""
    return any(step.get("op_records") for step in getattr(result, "steps", []) or []) or \
        bool((result.first_divergence or {}).get("op"))


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
            result.compared != "tensor" or not _has_ops(result)) and \
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


_CELL = {"same": ".", "diverged": "X", "interrupted": "i", "missing": "-"}
"""One character per rank x step cell; any other problem state (truncated, unreadable,
damaged, ...) is "?"."""


def format_rank_report(result: Any, a: str = "A", b: str = "B") -> str:
    """Status, what changed on the rank that diverged first (and the `sleuth explain` command
    for it), the earliest divergence across ranks, each rank's line, then the grid."""
    ranks = result.ranks
    diverged = [r for r in ranks if r["status"] == "diverged"]
    unread = [r for r in ranks if r["status"] == "incomplete"]
    lines = [f"status: {result.status.upper()}   ranks: {len(ranks)} compared "
             f"({len(ranks) - len(diverged) - len(unread)} same, {len(diverged)} diverged, "
             f"{len(unread)} incomplete)   on: {result.engine}"]
    fd = result.earliest
    if fd:
        first = next(r for r in ranks if r["rank"] == fd["rank"])
        lines += headline(first.get("changes") or [],
                          explain_command(a, b, fd["step"], fd["rank"]))
    for side, only in (("A", result.only_a), ("B", result.only_b)):
        if only:
            lines.append(f"rank(s) only in {side}, not compared: {', '.join(map(str, only))}; "
                         f"compare one pair with --rank R --b-rank R2")
    if fd:
        op = f"   op {fd['op']}" if fd["op"] else ""
        lines += ["", f"earliest divergence ({fd['kind']}): rank {fd['rank']} step {fd['step']}: "
                  f"{fd['name']}", f"  module {fd['module']}{op}   phase {fd['phase']}",
                  f"  source {fd['source'] or '-'}", f"  {fd['reason']}",
                  f"  all of it: {diff_command(a, b, fd['step'], fd['rank'])}"]
    lines += ["", "per rank:"]
    for r in ranks:
        first = r["first_divergence"]
        what = (f"first divergence step {first['step']}: {first['name']}" if first else
                r["error"] or ("; ".join(f"{p['side']} step {p['step']}: {p['state']}"
                                         for p in r["problems"][:3]) or "no divergence"))
        lines.append(f"  rank {r['rank']}: {r['status']:<10} {what}")
    lines += ["", "rank x step (. same, X diverged, i interrupted, - missing, ? unreadable):"]
    lines += _grid(result.table())
    return "\n".join(lines)


def _grid(table: dict[int, dict[int, str]]) -> list[str]:
    steps = sorted({s for row in table.values() for s in row})
    if not steps:
        return ["  (no step compared)"]
    shown = steps[:60]
    head = "  rank  " + " ".join(f"{s:>3}" for s in shown)
    out = [head + (f"  (+{len(steps) - 60} steps: see --json)" if len(steps) > 60 else "")]
    for rank, row in table.items():
        out.append(f"  {rank:>4}  " + " ".join(f"{_CELL.get(row.get(s, ''), '?') if s in row else ' ':>3}"
                                             for s in shown))
    return out
