"""`tracer.explain`: is a divergence a bug or rounding, and which op introduced it.

`diff` names the first record where two runs part. Comparing bf16 with float32, a GPU with a CPU
or two torch versions, every record after the first rounding op differs, so that record alone
does not say whether anything is wrong. With op-level dumps that hold tensors and each call's
spec (/calls), every op on the divergence chain can be re-run (tracer.analysis._replay):

- received: how far the op's inputs in B are from A's (the error it inherited);
- introduced: B's call re-run on A's recorded inputs (cast to B's input dtypes) against A's
  recorded output: the error the op itself adds on identical inputs;
- entitled: the rounding the op may add, measured, not assumed: A's call re-run on A's inputs
  in B's dtypes against the same call in float64, plus A's own recorded output against float64
  (and, where two re-runs of B's call differ, that difference: a non-deterministic op).

An op whose introduced error exceeds `factor` times what it is entitled to (plus two units of
roundoff of its output dtype) changes the result on identical inputs: a bug there (a wrong
constant, a changed formula, an argument changed or lost). When every op stays within its
rounding, the difference is precision, and the ops that lose the most are named. A first
divergence in the data or the weights means the inputs differ from the start.

A first divergence that is an op's input, or a module record (a mix dump), is first judged by
where its value came from (tracer.analysis._explain_lead): an op only one run runs (added,
removed, replaced), nothing recorded (inputs differ), a value rounded (precision), or another
value passed at that call (operands swapped, an argument lost). Lines named are B's: the run
being explained is where a fix goes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from tracer._errors import TracerError
from tracer.analysis._compare import Tolerance
from tracer.analysis._diff import diff
from tracer.analysis._diff_result import _jsonable, compiled_apart, unpaired_most
from tracer.analysis._explain_hidden import Hidden, Search, lower_dtypes
from tracer.analysis._explain_kernel import kernel_op, kernel_verdict, kernels_of
from tracer.analysis._explain_lead import Finding, Lead
from tracer.analysis._explain_sides import Sides, stem
from tracer.analysis._explain_step import Step
from tracer.analysis._map import ModuleMap
from tracer.analysis._optimizer_replay import replay_update, replay_words
from tracer.analysis._origin import _in_place
from tracer.analysis._replay import NotReplayable
from tracer.analysis._setup import (can_make, compare_inputs, inputs_words, read, setup_of,
                                    with_setup)
from tracer.analysis._written import written_verdict
from tracer.storage import open_dump

Status = Literal["same", "bug", "precision", "inputs", "setup", "unexplained", "incomplete"]


@dataclass
class Explanation:
    """What `explain` found."""

    status: Status
    verdict: str
    """One sentence a user can act on."""
    blamed: dict[str, Any] | None = None
    """The op call blamed as a bug: name (A's call, or B's for an op only B runs), b_name,
    op, module, phase, step, source (B's line; A's for an op only A runs), judged, why, and
    fault: "computes" (other results on identical inputs), "arguments" (called with other
    arguments), "swapped", "argument" (one of A's inputs passed in place of another), "passed"
    (another value passed), "added", "removed" or "replaced" (ops only one run runs; their
    names in `added` and `removed`), "written" (an in-place op wrote a weight during the step:
    `param` names it, `written_by` the run that wrote it, A, B or both), "no_gradient" (one
    run's optimizer step read no gradient of the parameter: `side` names that run). A re-run
    call adds the chain entry's fields."""
    chain: list[dict[str, Any]] = field(default_factory=list)
    """One entry per op call on the divergence chain, in execution order: name, b_name, op,
    module, phase, step, source (B's line), a_source, received, introduced, entitled,
    amplification, dtype, b_dtype, nondeterministic, device (where B ran the call),
    replayed_on (where it was re-run: that device when this process has it, else the CPU,
    which `why` then says), changes (how B's arguments differ from A's), judged ("bug",
    "rounding", "not replayed"), why."""
    first_divergence: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    setup: list[dict[str, Any]] = field(default_factory=list)
    """How the runs were set up differently (tracer.analysis._setup.differences), the ones
    that can change what a step computes, likeliest cause of this divergence first."""

    @property
    def exit_code(self) -> int:
        """As `sleuth diff`: 0 same, 1 the runs differ, 2 not everything could be read."""
        return {"same": 0, "incomplete": 2}.get(self.status, 1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (non-finite errors as "inf" or None, as `DiffResult.to_dict` writes)."""
        return {"status": self.status, "exit_code": self.exit_code, "verdict": self.verdict,
                "blamed": _jsonable(self.blamed) if self.blamed else None,
                "chain": [_jsonable(e) for e in self.chain],
                "first_divergence": self.first_divergence, "notes": self.notes,
                "setup": [_jsonable(d) for d in self.setup]}


def explain(a: str | os.PathLike, b: str | os.PathLike, *, step: int | None = None,
            rank: int = 0, b_step: int | None = None, b_rank: int | None = None,
            limit: int = 20, factor: float = 4.0,
            tolerance: Tolerance | None = None,
            module_map: ModuleMap | dict[str, str] | None = None) -> Explanation:
    """Explain the first divergence between dumps A (the reference) and B (module doc).

    Both must be op-level dumps (level op or mix); re-running ops needs mode tensor or full,
    which keep each op's inputs and /calls. `step`, `rank`, `b_step`, `b_rank` select the
    records as `diff` does: B's step and rank default to A's, and differ to explain two ranks
    or two steps of one run (DDP ranks that drift apart). `limit`: op calls followed along the chain;
    `factor`: how many times its measured rounding an op's error on identical inputs may be
    before it is a bug; `module_map`: for dumps of two codebases, as `diff` takes it
    (`map_modules`, `read_module_map`).
    Raises TracerError (a DiffError) as `diff` does, or when the dumps cannot be replayed.
    """
    res = diff(a, b, step=step, rank=rank, b_step=b_step, b_rank=b_rank, tolerance=tolerance,
               module_map=module_map)
    setup = setup_of(res.changes)
    fd = res.first_divergence
    try:
        lines = frozenset(line for d in (setup or {}).get("differences", [])
                          for line in d.get("lines") or () if line)
        found = _explain(a, b, res, limit, factor, module_map, _setups_at(a, b, fd), lines)
    except TracerError as e:
        at_line = fd is not None and bool(fd.get("source")) and any(
            fd["source"] in (d.get("source"), d.get("a_source"))
            for d in (setup or {}).get("differences", []))
        if not setup or fd is None or not (fd["phase"] == "optimizer" or at_line
                                           or can_make(setup, fd)):
            raise
        # the optimizer step's records, the ops of a setup call (a clipping call with other
        # arguments), or an op a setup difference can make (a module in eval mode), need no
        # re-run to be judged by the setup; what the records alone would need is said after
        found = Explanation("unexplained", str(e), first_divergence=fd, notes=list(res.notes))
    if _apart(res.counts(), module_map is not None, setup):
        return found  # records that do not pair say nothing a setup could explain
    return with_setup(found, setup, _replayed(a, b, fd, setup), _after_backward(res.records, fd),
                      _updates(res.records, fd))


def _updates(records: Any, fd: dict[str, Any] | None) -> str:
    """How the optimizer's updates of first divergence `fd`'s step compare, in words; "" where
    the step has none."""
    if fd is None or records is None or not len(records):
        return ""
    ups = records[(records["step"] == fd["step"]) & (records["phase"] == "optimizer")
                  & (records["direction"] == "update")]
    if ups.empty:
        return ""
    bad = ups[ups["verdict"] == "diverged"].sort_values("order")
    if bad.empty:
        return (f"the optimizer's updates agree ({len(ups)} compared): after unscaling, the "
                f"scaler changes nothing the step keeps")
    return (f"the optimizer's updates differ ({len(bad)} of {len(ups)}, the first "
            f"{bad.iloc[0]['name']}): what B does to its gradients before they are unscaled "
            f"(a clipping call before unscale_) sees them scaled")


def _after_backward(records: Any, fd: dict[str, Any] | None) -> bool:
    """Whether first divergence `fd` is in or after its step's backward (a backward record of
    that step comes before it)."""
    if fd is None or records is None or not len(records):
        return False
    if fd["phase"] in ("backward", "optimizer"):
        return True
    at = records[(records["name"] == fd["name"]) & (records["step"] == fd["step"])]
    if at.empty:
        return False
    order = at["order"].iloc[0]
    return bool(((records["step"] == fd["step"]) & (records["phase"] == "backward")
                 & (records["order"] < order)).any())


def _replayed(a: str | os.PathLike, b: str | os.PathLike, fd: dict[str, Any] | None,
              setup: dict[str, Any] | None) -> str:
    """Where the first divergence is an optimizer update and the setups say its
    hyperparameters differ: the update re-run with B's (tracer.analysis._optimizer_replay),
    in words; else ""."""
    if fd is None or setup is None or fd["phase"] != "optimizer" \
            or fd.get("direction") != "update":
        return ""
    param = str(fd["name"]).rpartition(".optimizer.")[0]
    changed = list(dict.fromkeys(
        str(d["key"]).rpartition(".")[2] for d in setup["differences"]
        if d["kind"] == "hyperparameter" and param in (d.get("params") or [param])))
    if not changed:
        return ""
    da, db = open_dump(a), open_dump(b)
    try:
        modes = {d.attrs(*key).get("mode") for d, key in (
            (da, (fd["rank"], fd["step"])), (db, (fd["b_rank"], fd["b_step"])))}
        if "statistics" in modes:
            return ("re-running the update with B's hyperparameters needs the optimizer's "
                    "records with tensors: dump both runs with mode tensor (or full) at level "
                    "mix, every step from the optimizer's first")
        try:
            return replay_words(replay_update(da, db, fd, changed))
        except NotReplayable as e:
            return f"the update was not re-run with B's hyperparameters: {e}"
    finally:
        da.close()
        db.close()


def _setups_at(a: str | os.PathLike, b: str | os.PathLike, fd: dict[str, Any] | None
               ) -> list[dict[str, Any] | None]:
    """The two setups of the first divergence's step pair (tracer.analysis._setup.read); None
    where a step has no setup or does not read (the diff already said so)."""
    if fd is None:
        return [None, None]
    sides: list[dict[str, Any] | None] = []
    for path, key in ((a, (fd["rank"], fd["step"])), (b, (fd["b_rank"], fd["b_step"]))):
        try:
            d = open_dump(path)
            try:
                sides.append(read(d.attrs(*key).get("setup"), "")[0])
            finally:
                d.close()
        except (TracerError, OSError, KeyError, ValueError):
            sides.append(None)
    return sides


def _explain(a: str | os.PathLike, b: str | os.PathLike, res: Any, limit: int, factor: float,
             module_map: Any, setups: list[dict[str, Any] | None],
             setup_lines: frozenset[str] = frozenset()) -> Explanation:
    """`explain`'s verdict from the records alone (`setups`: the step pair's, which say which
    of the batch and the buffers differ as the step began, and name a buffer written in
    place; `setup_lines`: where a setup the runs differ in runs its own ops, no place for a
    bug hidden under rounding)."""
    inputs = compare_inputs(*setups)
    fd = res.first_divergence
    notes = list(res.notes)
    if res.exit_code == 2:
        what = "; ".join(f"{p.side} {p.reason}" for p in res.problems[:3])
        return Explanation("incomplete", f"not everything could be read, so nothing is "
                           f"explained: {what}", first_divergence=fd, notes=notes)
    apart = _apart(res.counts(), module_map is not None, setup_of(res.changes))
    if apart:
        return Explanation("unexplained", apart, first_divergence=fd, notes=notes)
    if fd is None:
        if res.status == "same":
            counts = res.counts()
            alone = counts["only_a"] + counts["only_b"]
            return Explanation("same", "the runs agree on every record compared" + (
                f" ({alone} record(s) without a partner were not compared: `sleuth diff` "
                "lists them)" if alone else ""), notes=notes)
        alone = _computed_alone(res)
        if alone is not None:
            return Explanation("bug", alone[0], alone[1], notes=notes)
        return Explanation("unexplained", "no record diverged, but the runs' steps differ: a "
                           "step one run dumped is missing in the other (see `sleuth diff`)",
                           notes=notes)
    weight = written_verdict(fd)
    if weight is not None:
        # a weight written in place during the step (named, never "inputs differ"), or one a
        # module dump cannot date: nothing to re-run, so any mode will do
        return Explanation(*weight, [], fd, notes)
    lost = _gradients_lost(res.records, fd)
    if lost is not None:
        return Explanation("bug", lost[0], lost[1], [], fd, notes)
    which = inputs_words(inputs)
    if fd["kind"] in ("data", "parameter") and not fd["op"]:
        # an op's input the diff marks as data (token ids) goes on to the lead, which says
        # which op it enters and that no recorded op made it
        what = "the model's input differs" if fd["kind"] == "data" else "the weights differ"
        writes = _writes_alone(res.records, fd) if fd["kind"] == "parameter" else ""
        return Explanation("inputs", f"inputs differ from the start: {what} already at "
                           f"{fd['name']} ({which or 'data, seed or weights'}), before any op "
                           f"ran{writes}", first_divergence=fd, notes=notes)
    if fd["kind"] == "data" and fd["direction"] == "output":
        # made outside the model before its first call (a sampler, torch.randn): its op is no
        # computation of the model's to judge, and cannot be re-run alike
        made = (f"{fd['name']}, made by {fd['op']} at {fd['source'] or 'an unknown line'} "
                f"outside the model before its first call")
        if inputs["batch"] == "same":
            # the model's own batch agrees: what differs is a value the step reads beside it
            return Explanation("inputs", f"inputs differ from the start: {made}, differs, "
                               f"while the model is given the same batch in both runs (its "
                               f"fingerprint): a value the step reads beside the batch "
                               f"(labels, a mask), from other data or another seed",
                               first_divergence=fd, notes=notes)
        return Explanation("inputs", f"inputs differ from the start: the batch differs already "
                           f"at {made} ({which or 'data or seed'}), before any op of the model "
                           f"ran", first_divergence=fd, notes=notes)
    if kernel_op(fd["op"]):
        # one of Inductor's kernels: what it fused is in the setups, and its call is not
        # re-run, so a module-level dump says as much as an op-level one
        status, verdict, blamed = kernel_verdict(fd, setups)
        return Explanation(status, verdict, blamed, [], fd, notes)
    da, db = open_dump(a), open_dump(b)
    try:
        _need_op_records(da, db, fd)
        rows = Step(da, db, fd, res.records)
        sides = Sides(da, db, fd, factor)
        lead = Lead(rows, sides, factor, which,
                    tuple((s or {}).get("buffers") or {} for s in setups),
                    tuple(kernels_of(s) for s in setups))
        start, found = fd, lead.judge(fd)
        if found is not None and found.judged == "descend":
            start = _first_op_after(res.records, fd)
            if start is None:
                return Explanation("unexplained", f"{found.why}, and no op record differs "
                                   "after it", None, [], fd, notes)
            notes.append(f"{found.why}: judged at the first op record that differs after it, "
                         f"{start['name']}")
            found = lead.judge(start)
        if found is not None and found.judged == "inputs":
            return Explanation("inputs", f"inputs differ: {found.why}", None, [], fd, notes)
        if not (sides.specs["a"] and sides.specs["b"]):
            if found is None or found.judged == "rounding":
                sides.require_calls()
            return _verdict([], found, start, fd, notes)
        chain = [sides.entry(r, rows.source("b", str(r["b_name"] or r["name"])))
                 for r in _chain(res.records, start, limit)]
        out = _verdict(chain, found, start, fd, notes)
        lows = lower_dtypes(res.records, fd)
        if out.status == "precision" or (out.status == "unexplained" and found is None):
            # the diff's tolerance for B's precision may hide where a bug begins, or where the
            # difference the chain's first op receives was made
            hidden = Search(rows, res.records, sides, lead, fd, factor, setup_lines).find(
                {e["name"] for e in chain}, limit)
            if hidden is not None:
                out = _under_rounding(hidden, lows, out)
        elif out.status == "bug" and lows:
            out.verdict += f" (B also computes in {', '.join(lows)}: rounding is present too)"
    finally:
        da.close()
        db.close()
    return out


def _computed_alone(res: Any) -> tuple[str, dict[str, Any]] | None:
    """(verdict, blamed) where no record both runs made differs, but one run made records
    whose values the other never holds (an op it alone runs, a weight its optimizer alone
    steps): the first of them, as the diff found it (`DiffResult.computed_alone`); None where
    there is none (the steps differ instead)."""
    r = res.computed_alone
    if r is None:
        return None
    side, other = ("A", "B") if r["verdict"] == "only_a" else ("B", "A")
    name = str(r["name"] if side == "A" else r["b_name"])
    c = res.counts()
    tally = f"{c['only_a']} records only in A, {c['only_b']} only in B"
    if r["phase"] == "optimizer":
        what = (f"{side}'s optimizer step reads {name.split('.optimizer.')[0]} ({name}) and "
                f"{other}'s does not")
        fault = "no_gradient"
    else:
        what = (f"op {'removed' if side == 'A' else 'added'}: {side} runs {r['op'] or name} at "
                f"{r['source'] or 'an unknown line'} ({name}) and {other} does not")
        fault = "removed" if side == "A" else "added"
    blamed = {"name": name, "b_name": name, "op": str(r["op"]), "module": str(r["module"]),
              "phase": str(r["phase"]), "step": int(r["step"]), "source": str(r["source"]),
              "fault": fault, "side": side, "why": what}
    return (f"bug: {what}, and no record both runs made differs: the runs differ only in what "
            f"one computes and the other does not ({tally})", blamed)


def _gradients_lost(records: Any, fd: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(verdict, blamed) where the first divergence is an optimizer update and one run's
    optimizer step read no gradient of that parameter that the other's did (its `grad`
    record has no partner): the gradients were cleared, set to None or never made between the
    backward and the step; else None."""
    if records is None or not len(records) or fd["phase"] != "optimizer" \
            or fd["direction"] != "update":
        return None
    rows = records[(records["step"] == fd["step"]) & (records["rank"] == fd["rank"])
                   & (records["phase"] == "optimizer")
                   & records["verdict"].isin(("only_a", "only_b"))]
    grads = rows[rows["name"].astype(str).str.endswith(".grad.0")]
    param = str(fd["name"]).rpartition(".optimizer.")[0]
    mine = grads[grads["name"].astype(str).str.startswith(param + ".optimizer.")]
    if not len(mine):
        return None
    side = "B" if mine["verdict"].iloc[0] == "only_a" else "A"
    other = "A" if side == "B" else "B"
    same = grads[grads["verdict"] == mine["verdict"].iloc[0]]
    more = f" and {len(same) - 1} more parameters" if len(same) > 1 else ""
    why = (f"{side}'s optimizer step reads no gradient of {param}{more}, which {other}'s "
           f"reads (at {fd['source'] or 'its optimizer step'}): {side}'s gradients were "
           f"cleared or set to None (a zero_grad before the step) or never made (no backward, "
           f"a frozen parameter, an output detached) between the backward and the optimizer "
           f"step, so its update differs")
    blamed = {"name": str(fd["name"]), "b_name": str(fd["b_name"] or fd["name"]), "op": "",
              "module": fd["module"], "phase": "optimizer", "step": fd["step"],
              "source": fd["source"], "judged": "bug", "fault": "no_gradient", "side": side,
              "why": why}
    return f"bug: {why}", blamed


def _writes_alone(records: Any, fd: dict[str, Any]) -> str:
    """Where weights differ as a step begins: the in-place ops of the model's forward or
    backward that only one run runs in that step, in words ("" for none). Such a write,
    made in the steps before too, is where weights part that the dump saw only afterwards."""
    if records is None or not len(records):
        return ""
    rows = records[(records["step"] == fd["step"]) & (records["rank"] == fd["rank"])
                   & records["verdict"].isin(("only_a", "only_b"))
                   & (records["phase"] != "optimizer")]
    found: dict[tuple[str, str, str], None] = {}
    for verdict, op, source in zip(rows["verdict"], rows["op"], rows["source"]):
        if op and _in_place(str(op)):
            found[("B" if verdict == "only_b" else "A", str(op), str(source or "?"))] = None
    if not found:
        return ""
    sides = {side for side, _, _ in found}
    who = next(iter(sides)) if len(sides) == 1 else "each run"
    ops = ", ".join(f"{op} at {source}" for _, op, source in list(found)[:3])
    return (f"; {who} also writes in place in this step what the other run does not ({ops}): "
            f"made in the steps before it too, such a write is where the weights part; dump "
            f"from the first step (\"steps\") to see it written")


def _apart(counts: dict[str, int], mapped: bool, setup: dict[str, Any] | None) -> str | None:
    """The verdict when most records of each side have no partner (as `diff` judges it): two
    codebases, whose records a module map pairs; None where they pair, or where one side ran
    compiled regions the other ran as modules (`setup`, the diff's setup change)."""
    tally = unpaired_most(counts)
    if tally is None or compiled_apart(setup):
        return None
    if mapped:
        return (f"{tally.replace('no partner', 'no partner even through the module map')}: "
                "pair more modules in the map (`sleuth map A B` writes one to edit), then "
                "explain again")
    return (f"{tally}: the dumps record different modules, so no divergence between them can "
            "be judged. Two codebases? `sleuth map A B > map.yaml`, then "
            "`sleuth explain --map map.yaml A B`")


def _need_op_records(da: Any, db: Any, fd: dict[str, Any]) -> None:
    """TracerError when a dump has no op records to follow (level module), saying so."""
    for side, d, key in (("A", da, (fd["rank"], fd["step"])),
                         ("B", db, (fd["b_rank"], fd["b_step"]))):
        attrs = d.attrs(*key)
        if attrs.get("level") == "module":
            raise TracerError(f"sleuth explain follows op records, and dump {side} is level "
                              f"module (mode {attrs.get('mode', '?')}): dump both runs at level "
                              'op or mix with {"mode": "tensor"} (or "full")')


def _first_op_after(records: Any, fd: dict[str, Any]) -> dict[str, Any] | None:
    """The first divergent op record after module record `fd` (same step), as a first
    divergence (the records without a partner right before it included), or None."""
    rows = records[records["step"] == fd["step"]].sort_values("order", kind="stable")
    rows = rows.to_dict("records")
    at = next((i for i, r in enumerate(rows) if r["name"] == fd["name"]), None)
    if at is None:
        return None
    for i in range(at + 1, len(rows)):
        r = rows[i]
        if r["verdict"] == "diverged" and r["op"]:
            out = {k: r[k] for k in ("name", "module", "op", "phase", "step", "rank", "source",
                                     "b_name", "b_step", "b_rank", "seq", "direction", "index",
                                     "dtype", "b_dtype", "compared", "reason")}
            out["kind"] = "compute"
            before, j = [], i - 1
            while j > at and rows[j]["verdict"] in ("only_a", "only_b"):
                side = "A" if rows[j]["verdict"] == "only_a" else "B"
                before.append({"side": side, "name": str(rows[j]["name"] if side == "A"
                                                          else rows[j]["b_name"]),
                               "op": str(rows[j]["op"]), "source": str(rows[j]["source"])})
                j -= 1
            out["unpaired_before"] = before[::-1]
            return _jsonable(out)
    return None


def _chain(records: Any, fd: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """The op calls whose records diverged from the first divergence on, in execution order:
    one row (the first divergent record) per call, at most `limit`."""
    rows = records[(records["verdict"] == "diverged") & (records["op"] != "")
                   & (records["step"] == fd["step"])]
    rows = rows.sort_values("order", kind="stable")
    start = records.index[(records["name"] == fd["name"]) & (records["step"] == fd["step"])]
    if len(start):
        rows = rows[rows["order"] >= records.loc[start[0], "order"]]
    out, seen = [], set()
    for r in rows.to_dict("records"):
        key = stem(r["name"])
        if key in seen:
            continue
        seen.add(key)
        out.append(r)
        if len(out) >= limit:
            break
    return out


def _where(e: dict[str, Any]) -> str:
    return f"{e['op']} at {e['source'] or 'an unknown line'} ({e['name']})"


def _verdict(chain: list[dict[str, Any]], found: Finding | None, start: dict[str, Any],
             fd: dict[str, Any], notes: list[str]) -> Explanation:
    if found is not None and found.judged == "bug":
        blamed = found.blamed or {}
        if blamed.get("fault") in ("added", "removed", "replaced", "written") \
                or not blamed.get("op"):
            text = f"bug: {found.why}"
        else:
            text = (f"bug: op {_where(blamed)} receives a different input on otherwise "
                    f"identical records: {found.why}")
        return Explanation("bug", text, blamed, chain, fd, notes)
    if found is not None and found.judged == "unknown":
        return Explanation("unexplained", found.why, found.blamed, chain, fd, notes)
    bug = next((e for e in chain if e["judged"] == "bug"), None)
    if bug is not None:
        bug["fault"] = "arguments" if bug.get("changes") else "computes"
        how = (f"is called with other arguments in B ({'; '.join(bug['changes'])}), which "
               "change the result" if bug["changes"] else "changes the result on identical "
               "inputs")
        return Explanation("bug", f"bug: op {_where(bug)} {how}: {bug['why']}", bug, chain, fd,
                           notes)
    replayed = [e for e in chain if e["judged"] == "rounding"]
    if not replayed and not (found is not None and found.judged == "rounding"):
        why = "; ".join(f"{e['name']}: {e['why']}" for e in chain[:3]) or "no op to re-run"
        return Explanation("unexplained", f"no op on the chain could be re-run: {why}",
                           None, chain, fd, notes)
    skipped = [e for e in chain if e["judged"] == "not replayed"]
    if found is None and chain and chain[0]["judged"] == "not replayed":
        # where the runs first part is where an error would be made: not judged, not known
        first = chain[0]
        return Explanation("unexplained", f"the op where the runs first part, {_where(first)}, "
                           f"could not be re-run ({first['why']}); the ops after it stay within "
                           "their rounding, so whether it made the difference is not known",
                           None, chain, fd, notes)
    worst = [e for e in sorted(replayed, key=lambda e: -(e["introduced"] or 0.0))[:3]
             if e["introduced"]]
    dtypes = sorted({d for e in worst for d in e.get("b_dtypes") or [e["b_dtype"]] if d})
    lose = ("those that lose the most on identical inputs: "
            + ", ".join(f"{e['op']} ({e['name']}, {e['introduced']:.3g})" for e in worst)
            + f" (B computes in {', '.join(dtypes) or '?'})") if worst else \
        "none of them adds error on identical inputs"
    mixed = next((n for n in notes if "differ in dtype" in n), "")
    received = float(chain[0].get("received") or 0.0) if chain else 0.0
    if found is None and not worst and not mixed and received > 0:
        # no op re-run on the chain adds any error and no dtype differs: rounding made none of
        # it, so the chain's first op received a difference made before it (in records the
        # diff judged within tolerance), which calling it precision would hide
        first = chain[0]
        return Explanation(
            "unexplained", f"the chain's first op, {_where(first)}, already receives inputs "
            f"that differ by {received:.3g} (relative), and no op re-run on the chain adds any "
            "error, with no dtype differing between the runs: the difference was made before "
            "it, in records the diff judged within tolerance; diff again with tighter "
            "tolerances (--rtol, --atol) to see where it begins", None, chain, fd, notes)
    cast = (f". B's precision first differs at {mixed.split(', the first at ', 1)[1]}"
            if ", the first at " in mixed else "")
    if found is not None and found.judged == "rounding":
        at = (f"{start['op']} ({stem(start['name'])}, {start['source'] or 'unknown line'})"
              if start["op"] else f"module record {start['name']}")
        begin = (f"precision: it starts at {at}, where {found.why}; every op re-run after it "
                 "on the chain stays within its own rounding")
    else:
        begin = ("precision: the difference comes from rounding; every op re-run on the chain "
                 "stays within what its dtype accounts for")
    unjudged = (f"; {len(skipped)} op(s) on the chain could not be re-run and are not judged: "
                + ", ".join(f"{e['op']} ({e['why']})" for e in skipped[:3])) if skipped else ""
    return Explanation("precision", f"{begin}, {lose}{unjudged}{cast}", None, chain, fd,
                       notes)


def _under_rounding(hidden: Hidden, lows: list[str], before: Explanation) -> Explanation:
    """The bug a precision (or unexplained) verdict would have hidden, saying the rounding is
    there too where B computes in a lower precision than A."""
    fd = before.first_divergence or {}
    first = fd.get("name", "?")
    where = (f"the diff, whose first divergence is {first}, judged it within its tolerance: "
             f"{hidden.record} differs by {hidden.error:.3g}" if hidden.verdict == "same" else
             f"{hidden.record} differs by {hidden.error:.3g}; the diff's first divergence, "
             f"{first}, is an earlier record that differs by rounding")
    also = f"B also computes in {', '.join(lows)}: rounding is present too, and " if lows else ""
    notes = [*before.notes, "without this bug the chain would read: "
             + before.verdict.split(",", 1)[0]]
    return Explanation("bug", f"bug: {hidden.why} ({also}{where})", hidden.blamed, before.chain,
                       before.first_divergence, notes)
