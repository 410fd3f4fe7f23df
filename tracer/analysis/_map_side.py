"""One dump's modules as `sleuth map` sees them (tracer.analysis._map): each module's first
forward input and output, its parameters, where it sits in the module tree, and whether it
only hands on a tensor computed before it.

The tree comes from the dotted names (`blocks.0.attn` lies under `blocks.0`), the order from
the records: forward pre-hooks run outermost first, so the order of each module's first
record puts parents before their children.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tracer._errors import TracerError
from tracer.analysis._compare import Tolerance, compare_sketch, compare_stats
from tracer.storage import open_dump

ROOT, NONE = "<root>", "<none>"


def _call0(df: Any) -> Any:
    return df[df["call"] == df["call"].min()] if len(df) else df


def squeezed(shape: str) -> str:
    """A shape without its dims of 1: the diff takes those as a layout, not a divergence."""
    return ",".join(d for d in str(shape).split(",") if d != "1")


class Side:
    """The modules of one step of one rank of a dump (`read_side`)."""

    def __init__(self, t: Any, sketches: Any, read: Callable[[str], Any]) -> None:
        self.t, self.sk = t, sketches
        self.read = read
        """read(record name): the record's stored bits (tensor dumps)."""
        self.order = [m for m in dict.fromkeys(t.sort_values("seq")["module"]) if m != NONE]
        self.rank = {m: k for k, m in enumerate(self.order)}
        io = _call0(t[(t["phase"] == "forward") & (t["op"] == "") & (t["index"] == 0)])
        self.inp: dict[str, tuple[int, dict]] = {}
        self.out: dict[str, tuple[int, dict]] = {}
        for i, r in zip(io.index, io.to_dict("records")):
            (self.inp if r["direction"] == "input" else self.out)[r["module"]] = (i, r)
        names = set(self.order)
        self.parent: dict[str, str] = {}
        for m in self.order:
            if m == ROOT:
                continue
            up = m
            while "." in up:
                up = up.rsplit(".", 1)[0]
                if up in names:
                    break
            else:
                up = ROOT
            self.parent[m] = up
        self.children: dict[str, list[str]] = {}
        self.above: dict[str, frozenset[str]] = {}
        """module -> the modules it lies under."""
        self.below: dict[str, list[str]] = {}
        """module -> the modules that lie under it."""
        for m in self.order:
            chain, up = [], self.parent.get(m)
            while up is not None:
                chain.append(up)
                up = self.parent.get(up)
            self.above[m] = frozenset(chain)
            for up in chain:
                self.below.setdefault(up, []).append(m)
        for m, p in self.parent.items():
            self.children.setdefault(p, []).append(m)
        self.tree_order: list[str] = []
        """Parents before their children, siblings in execution order (a dump of outputs
        only records children first)."""
        todo = [m for m in reversed(self.order) if m not in self.parent]
        while todo:
            m = todo.pop()
            self.tree_order.append(m)
            todo += reversed(self.children.get(m, []))
        self.by_output: dict[tuple[str, str], list[str]] = {}
        for m in self.order:
            if m in self.out:
                r = self.out[m][1]
                self.by_output.setdefault((r["dtype"], squeezed(r["shape"])), []).append(m)
        self._passes: dict[str, bool] = {}

    def params(self) -> Any:
        """The parameter records (their values when the step began), in recorded order."""
        t = self.t
        return _call0(t[(t["phase"] == "optimizer") & (t["direction"] == "param")]
                      ).sort_values("seq")

    def under(self, m: str, anc: str) -> bool:
        """Whether `m` lies strictly below `anc` in the tree."""
        return anc in self.above.get(m, ())

    def passes_on(self, m: str) -> bool:
        """Whether `m` outputs a tensor computed before it: its input (a dropout at p = 0, an
        Identity) or its last child's output (a container that returns it)."""
        if m not in self._passes:
            self._passes[m] = self._hands_on(m)
        return self._passes[m]

    def _hands_on(self, m: str) -> bool:
        if m not in self.out:
            return False
        if m in self.inp and same(self, self.inp[m], self, self.out[m]):
            return True
        kids = [c for c in self.children.get(m, []) if c in self.out]
        if not kids:
            return False
        last = max(kids, key=lambda c: self.out[c][1]["seq"])
        return same(self, self.out[last], self, self.out[m])


def read_side(path: str | os.PathLike, rank: int, step: int | None) -> Side:
    """The modules of `path`'s rank `rank` at `step` (None: its first step). TracerError when
    the dump lacks that rank or step."""
    dump = open_dump(path)
    if rank not in dump.ranks:
        raise TracerError(f"{path}: no rank {rank} (ranks: {dump.ranks})")
    steps = dump.steps(rank)
    if not steps:
        raise TracerError(f"{path}: rank {rank} holds no step file")
    if step is None:
        step = steps[0]
    elif step not in steps:
        raise TracerError(f"{path}: rank {rank} has no step {step} (steps: {steps})")
    return Side(dump.stats(rank, step), dump.sketches(rank, step),
                lambda name: dump.tensor(rank, step, name, raw=True).bits)


def same(sa: Side, ra: tuple[int, dict], sb: Side, rb: tuple[int, dict],
         tol: Tolerance = Tolerance()) -> bool:
    """Whether two records ((row, record) of sides `sa` and `sb`) compare the same by dtype,
    shape (up to dims of 1), statistics and, when both sides kept them, sketches."""
    (i, a), (j, b) = ra, rb
    if a["dtype"] != b["dtype"] or squeezed(a["shape"]) != squeezed(b["shape"]):
        return False
    if compare_stats(a, b, tol)["verdict"] != "same":
        return False
    return sa.sk is None or sb.sk is None or compare_sketch(
        sa.sk[i], sb.sk[j], int(a["numel"]), a["dtype"], b["dtype"], tol)["verdict"] == "same"


def io(sa: Side, ma: str, sb: Side, mb: str) -> tuple[bool, bool | None]:
    """(the modules' first forward outputs compare the same, their first inputs do: None when
    a side recorded no input)."""
    if ma not in sa.out or mb not in sb.out or not same(sa, sa.out[ma], sb, sb.out[mb]):
        return False, None
    if ma not in sa.inp or mb not in sb.inp:
        return True, None
    return True, same(sa, sa.inp[ma], sb, sb.inp[mb])


class Links(dict):
    """A module -> B module of the pairs made so far, with the way back (B -> A modules:
    a fused group's parts share their whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.back: dict[str, list[str]] = {}

    def __setitem__(self, a: str, b: str) -> None:
        assert a not in self, a  # a pair is made once
        super().__setitem__(a, b)
        self.back.setdefault(b, []).append(a)


def tree_fit(sa: Side, sb: Side, ma: str, mb: str, links: Links) -> tuple[int, int]:
    """How well pairing `ma` with `mb` fits the pairs made so far, as (above, below): above
    +1 when `mb` lies under the pair of `ma`'s nearest paired ancestor (-1 when not, 0 when
    that is the root or there is none); below +1 when the pairs below either module all lie
    below the other (-1 when none do, 0 when some do or there are none)."""
    above = 0
    up = sa.parent.get(ma)
    while up is not None and up not in links:
        up = sa.parent.get(up)
    if up is not None and up != ROOT:
        above = 1 if sb.under(mb, links[up]) else -1
    inside = [sb.under(links[x], mb) for x in sa.below.get(ma, ()) if x in links]
    inside += [sa.under(x, ma) for y in sb.below.get(mb, ()) for x in links.back.get(y, ())]
    below = (1 if all(inside) else -1 if not any(inside) else 0) if inside else 0
    return above, below
