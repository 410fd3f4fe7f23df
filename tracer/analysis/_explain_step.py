"""The divergence's step as the explanation reads it (`Step`): both runs' statistics rows, which
of them the diff paired, and where a record's value came from.

Values are followed by their statistics, as the first-NaN search follows them
(tracer.analysis._origin): a record with the dtype, element count, NaN/Inf counts, checksum,
minimum and maximum of an earlier op's output holds that output (`sig`). From there `Step`
names the op that made a value (through ops that pass it on unchanged), the calls only one run
runs that made it, the in-place writes into it, and the unpaired calls inside a module's call;
tracer.analysis._explain_lead judges the first divergence with them.
"""
from __future__ import annotations

from typing import Any

from tracer.analysis._origin import call_stem, sig
from tracer.storage import config_of


def region_op(op: Any) -> bool:
    """Whether a record's op is a compiled region's (``compiled``, ``compiled.{function}``:
    tracer.capture._regions), whose call no re-run repeats."""
    return str(op or "").startswith("compiled")


class Step:
    """Both runs' statistics rows of the divergence's step, and which of them the diff
    paired (`records`: the diff's rows)."""

    def __init__(self, da: Any, db: Any, fd: dict[str, Any], records: Any) -> None:
        self.rows: dict[str, list[dict]] = {}
        self.at: dict[str, dict[str, int]] = {}
        self.calls: dict[str, dict[str, list[dict]]] = {}
        self.modes: list[str] = []
        self.filters: list[str] = []
        """The dump config keys that leave calls or tensors out, on either side."""
        for side, d, key in (("a", da, (fd["rank"], fd["step"])),
                             ("b", db, (fd["b_rank"], fd["b_step"]))):
            attrs = d.attrs(*key)
            self.modes.append(str(attrs.get("mode", "")))
            config = config_of(attrs)
            for k in ("modules", "exclude_modules", "ops", "exclude_ops"):
                if config.get(k):
                    self.filters.append(f"{side.upper()} {k} {config[k]}")
            if config.get("io", "both") != "both":
                self.filters.append(f"{side.upper()} io {config['io']}")
            rows = sorted(d.stats(*key).to_dict("records"), key=lambda r: int(r["seq"]))
            self.rows[side] = rows
            self.at[side] = {str(r["name"]): i for i, r in enumerate(rows)}
            self.calls[side] = {}
            for r in rows:
                self.calls[side].setdefault(call_stem(r), []).append(r)
        mine = records[(records["step"] == fd["step"]) & (records["rank"] == fd["rank"])]
        self.verdict: dict[str, dict[str, str]] = {"a": {}, "b": {}}
        for name, b_name, v in zip(mine["name"], mine["b_name"], mine["verdict"]):
            if v != "only_b":
                self.verdict["a"][str(name)] = v
            if v != "only_a":
                self.verdict["b"][str(b_name or name)] = v

    def get(self, side: str, name: str) -> dict | None:
        i = self.at[side].get(name)
        return None if i is None else self.rows[side][i]

    def source(self, side: str, name: str) -> str:
        rec = self.get(side, name)
        return str(rec["source"]) if rec is not None else ""

    def unpaired(self, side: str, rec: dict) -> bool:
        return self.verdict[side].get(str(rec["name"])) == f"only_{side}"

    def producer(self, side: str, rec: dict) -> dict | None:
        """The latest op output before `rec` (another call's) holding its values, or None."""
        value, own = sig(rec), call_stem(rec)
        for r in reversed(self.rows[side][:self.at[side][str(rec["name"])]]):
            if r["op"] and r["direction"] == "output" and sig(r) == value \
                    and call_stem(r) != own:
                return r
        return None

    def maker(self, side: str, rec: dict) -> dict | None:
        """The op output that first held `rec`'s values: its producer, followed back through
        ops that pass values on unchanged (a detach, a view); None when no recorded op made
        them (a view of a batch made outside the recorded calls is still the batch)."""
        p = self.producer(side, rec)
        for _ in range(64):
            if p is None:
                return None
            same = [r for r in self.calls[side][call_stem(p)] if r["direction"] == "input"
                    and sig(r) == sig(p)]
            if not same:
                return p
            p = self.producer(side, same[0])
        return p

    def region(self, side: str, rec: dict) -> dict | None:
        """The compiled region (tracer.capture._regions) whose call was running when `rec` was
        made: the latest region record before it that opens a call (a forward input; in
        backward, the gradient of its output) with no record closing that call in between.
        Such a region's fused kernels are no records: what they made has no maker."""
        phase = rec["phase"]
        opens, closes = (("input", "output") if phase == "forward" else ("output", "input"))
        closed: set[str] = set()
        for r in reversed(self.rows[side][:self.at[side][str(rec["name"])]]):
            if not region_op(r["op"]) or r["phase"] != phase:
                continue
            key = call_stem(r)
            if r["direction"] == closes:
                closed.add(key)
            elif r["direction"] == opens and key not in closed:
                return r
        return None

    def made_by(self, side: str, rec: dict | None) -> list[dict]:
        """The calls only `side` runs that made `rec`'s value, back through their inputs as
        long as unpaired calls made those: one output record each, in execution order."""
        first = self.producer(side, rec) if rec is not None else None
        todo, out, seen = [first] if first is not None else [], [], set()
        while todo and len(out) < 16:
            p = todo.pop()
            key = call_stem(p)
            if key in seen or not self.unpaired(side, p):
                continue
            seen.add(key)
            out.append(p)
            for r in self.calls[side][key]:
                if r["direction"] == "input" and (q := self.producer(side, r)) is not None:
                    todo.append(q)
        return sorted((r for r in out if not self.passes_on(side, r)),
                      key=lambda r: int(r["seq"]))

    def passes_on(self, side: str, out: dict) -> bool:
        """Whether the call of output record `out` passes an input's values on unchanged (a
        detach, a view, a clone): it makes no value of its own."""
        return any(r["direction"] == "input" and sig(r) == sig(out)
                   for r in self.calls[side][call_stem(out)])

    def written(self, side: str, rec: dict | None) -> list[dict]:
        """Where no recorded op made `rec`'s value: the in-place calls only `side` runs in its
        module before it, or outside every module on a tensor of its dtype (`mask[0] = nan` is
        an `aten.copy_` into a view, whose output is the view, not the tensor `rec` reads):
        one output record each."""
        if rec is None or self.maker(side, rec) is not None:
            return []
        stems: dict[str, dict] = {}
        for r in self.rows[side][:self.at[side][str(rec["name"])]]:
            if r["op"] and str(r["op"]).endswith("_") and r["phase"] == rec["phase"] \
                    and self.unpaired(side, r) and (
                        r["module"] == rec["module"]
                        # the user's loop, outside every module, editing a tensor of this
                        # dtype before the model reads it (`mask[:, 0] = 0`)
                        or (str(r["module"]) in ("<none>", "") and r["dtype"] == rec["dtype"])):
                stems.setdefault(call_stem(r), r)
        return list(stems.values())

    def inside(self, side: str, rec: dict) -> list[dict]:
        """The unpaired op calls inside a module record's call, before it, that make values
        of their own: one record each (an output where the call has one)."""
        module, key = str(rec["module"]), call_stem(rec)
        start = min(int(r["seq"]) for r in self.calls[side][key])
        stems: dict[str, None] = {}
        for r in self.rows[side]:
            if not start < int(r["seq"]) < int(rec["seq"]) or not r["op"] \
                    or r["phase"] != rec["phase"] or not self.unpaired(side, r):
                continue
            if module == "<root>" or r["module"] == module or \
                    str(r["module"]).startswith(module + "."):
                stems[call_stem(r)] = None
        out = []
        for k in stems:
            recs = self.calls[side][k]
            made = [r for r in recs if r["direction"] == "output"]
            if not made or not self.passes_on(side, made[0]):
                out.append(made[0] if made else recs[0])
        return out


CASTS = ("aten._to_copy", "aten.to", "aten.type_as")
"""The ops that only change a value's dtype: what autocast adds, and `.float()`."""
