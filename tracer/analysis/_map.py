"""Module mapping between two codebases: which module of dump B is which module of dump A.

A user porting a model (their own code against a Hugging Face implementation, an old codebase
against a new one) dumps both with the same weights and the same batch, and gets record names
that never match. `map_modules` pairs the modules by what they hold and compute:

1. Parameters, by value: two parameters with the same dtype, element count and checksum (the
   sum of their bits) hold the same values. The checksum does not see order, so a weight
   stored transposed (GPT-2's Conv1D against nn.Linear) pairs too; the sketches (when both
   dumps kept them) then tell "the same values in the same order" from "the same values,
   moved". Equal parameters that several modules hold alike (LayerNorm weights of ones) pair in
   the order the two dumps recorded them. A module pairs with the module its parameters pair
   into.
   A parameter that pairs nothing one to one may be the concatenation of several of the
   other side's (a fused qkv projection against q, k and v): element counts and checksums add
   up over a concatenation (tracer.analysis._fused), so such a group is found exactly, and
   the diff compares the one module with the others combined.
2. Modules without parameters of their own (activations, containers, attention cores), by
   their forward output: the first module of B, after the last one paired, whose output has the
   same dtype and shape and compares the same as the A module's (statistics and sketches, with
   the diff's tolerances).

What pairs nothing is listed plainly. The result is written as an editable YAML file (`sleuth
map A B > map.yaml`) that `sleuth diff --map map.yaml` reads: B's module names are read as the
A modules they pair with, so the records of both sides align.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracer._errors import ConfigError, TracerError
from tracer.analysis._compare import Tolerance, compare_sketch, compare_stats
from tracer.analysis._fused import find_fused, group_name
from tracer.analysis._origin import param_name
from tracer.storage import open_dump


@dataclass
class ModuleMap:
    """Modules of dump A paired with modules of dump B, and those that paired nothing."""

    pairs: list[tuple[str, str, str]] = field(default_factory=list)
    """(A module, B module, why they pair), in A's execution order."""
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    permuted: list[str] = field(default_factory=list)
    """A's parameters that B holds with the same values in another layout (a weight stored
    transposed): the diff compares their records by statistics, which do not see order."""
    fused: list[tuple[list[str], list[str], str]] = field(default_factory=list)
    """([A modules], [B modules], why): one module of one side holding what several modules
    of the other hold, concatenated (a fused qkv projection against q, k and v;
    tracer.analysis._fused). The diff compares the one with the others combined."""
    a: str = ""
    b: str = ""

    def b_to_a(self) -> dict[str, str]:
        """B module -> A module, what `diff(module_map=...)` takes; the parts of a fused group
        go by the whole's name (B's parts: A's module; A's parts: their group's name)."""
        out = {b: a for a, b, _ in self.pairs}
        for mods_a, mods_b, _ in self.fused:
            for m in mods_b:
                out[m] = mods_a[0] if len(mods_a) == 1 else group_name(mods_a)
        return out

    def fused_parts(self, side: str) -> dict[str, list[str]]:
        """The groups whose parts are on `side` ("a" or "b"): whole's name -> part modules,
        what `combine` takes for that side's table."""
        if side == "b":
            return {a[0]: b for a, b, _ in self.fused if len(a) == 1 and len(b) > 1}
        return {group_name(a): a for a, b, _ in self.fused if len(b) == 1 and len(a) > 1}

    def to_yaml(self) -> str:
        """The editable mapping file (`read_module_map` reads it back)."""
        def q(text: str) -> str:
            return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

        lines = [f"# sleuth map {self.a} {self.b}",
                 "# modules: A's module -> B's module. Edit freely: change a B name, add a pair,",
                 "# or delete a line to leave a module unpaired; then",
                 "# `sleuth diff --map FILE A B`.",
                 f"a: {q(self.a)}", f"b: {q(self.b)}",
                 "modules:" + ("" if self.pairs else " {}")]
        lines += [f"  {q(a)}: {q(b)}  # {why}" for a, b, why in self.pairs]
        lines.append("# one module of one side holding several of the other's, concatenated "
                     "(a fused qkv)")
        lines.append("fused:" + ("" if self.fused else " []"))
        for mods_a, mods_b, why in self.fused:
            lines += [f"  - a: [{', '.join(map(q, mods_a))}]",
                      f"    b: [{', '.join(map(q, mods_b))}]  # {why}"]
        lines.append("# A's parameters that B stores in another layout (transposed): compared by "
                     "statistics")
        for key, names in (("permuted", self.permuted), ("only_a", self.only_a),
                           ("only_b", self.only_b)):
            lines.append(f"{key}:" + ("" if names else " []"))
            lines += [f"  - {q(n)}" for n in names]
        return "\n".join(lines) + "\n"


def _call0(df: Any) -> Any:
    return df[df["call"] == df["call"].min()] if len(df) else df


def _side(path: str | os.PathLike, rank: int, step: int | None) -> tuple[Any, Any, Any]:
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
    return dump.stats(rank, step), dump.sketches(rank, step), dump


def map_modules(a: str | os.PathLike, b: str | os.PathLike, *, rank: int = 0,
                step: int | None = None, b_rank: int | None = None,
                b_step: int | None = None) -> ModuleMap:
    """Pair the modules of dump A with those of dump B (module docstring): two dumps of the
    same weights fed the same batch, each from its own code. `step` None: each dump's first
    step."""
    ta, ska, _ = _side(a, rank, step)
    tb, skb, _ = _side(b, rank if b_rank is None else b_rank, step if b_step is None else b_step)
    out = ModuleMap(a=str(a), b=str(b))
    paired_a: dict[str, tuple[str, str]] = {}
    paired_b: set[str] = set()
    pairs, out.permuted, rest_a, rest_b = _by_parameters(ta, tb, ska, skb)
    out.fused = find_fused(rest_a, rest_b)
    for mods_a, mods_b, why in out.fused:  # taken before the one-to-one pairs: a part's
        for ma in mods_a:                  # zero bias may have paired with any zero bias
            paired_a[ma] = (mods_b[0], why)
        paired_b.update(mods_b)
    in_fused = set(paired_a)
    for ma, mb, why in pairs:
        if ma not in paired_a and mb not in paired_b:
            paired_a[ma] = (mb, why)
            paired_b.add(mb)
    for ma, mb, why in _by_outputs(ta, tb, ska, skb, paired_a, paired_b):
        paired_a[ma] = (mb, why)
        paired_b.add(mb)
    order_a = _modules_in_order(ta)
    out.pairs = [(m, *paired_a[m]) for m in order_a if m in paired_a and m not in in_fused]
    out.only_a = [m for m in order_a if m not in paired_a]
    out.only_b = [m for m in _modules_in_order(tb) if m not in paired_b]
    return out


def _modules_in_order(t: Any) -> list[str]:
    """Modules in the order of their first record (forward pre-hooks run outermost first)."""
    return list(dict.fromkeys(t.sort_values("seq")["module"]))


def _params(t: Any) -> Any:
    p = t[(t["phase"] == "optimizer") & (t["direction"] == "param")]
    return _call0(p).sort_values("seq")


def _by_parameters(ta: Any, tb: Any, ska: Any, skb: Any
                   ) -> tuple[list[tuple[str, str, str]], list[str], list[dict], list[dict]]:
    """(A module, B module, why) of module pairs whose parameters hold the same values, A's
    parameters whose B counterpart holds them in another layout, and the parameter records of
    each side that paired nothing (for `find_fused`)."""
    permuted: list[str] = []
    pa, pb = _params(ta), _params(tb)
    free: dict[tuple, list[int]] = {}
    for i, r in zip(pb.index, pb.itertuples()):
        free.setdefault((r.dtype, int(r.numel), int(r.checksum)), []).append(i)
    votes: dict[str, Counter] = {}
    reasons: dict[tuple[str, str], list[str]] = {}
    rest_a = []
    for i, r in zip(pa.index, pa.itertuples()):
        candidates = free.get((r.dtype, int(r.numel), int(r.checksum)))
        if not candidates:
            rest_a.append(pa.loc[i].to_dict())
            continue
        j = candidates.pop(0)  # equal values held alike by several: in recorded order
        rb = tb.loc[j]
        how = _how_equal(r.shape, rb["shape"], int(r.numel), ska, skb, i, j)
        full = param_name({"name": r.name})
        param = full.removeprefix(f"{r.module}.")
        if how not in ("equal", "same values"):
            permuted.append(full)
        votes.setdefault(r.module, Counter())[rb["module"]] += 1
        reasons.setdefault((r.module, rb["module"]), []).append(f"{param} {how}")
    out = []
    for ma, counter in votes.items():
        mb, _ = counter.most_common(1)[0]
        out.append((ma, mb, "parameters: " + ", ".join(reasons[(ma, mb)])))
    left = {j for js in free.values() for j in js}
    rest_b = [pb.loc[j].to_dict() for j in pb.index if j in left]
    return out, permuted, rest_a, rest_b


def _how_equal(shape_a: str, shape_b: str, numel: int, ska: Any, skb: Any, i: int, j: int
               ) -> str:
    if shape_a != shape_b:
        return f"same values, shape [{shape_a}] vs [{shape_b}] (stored transposed?)"
    if ska is None or skb is None:
        return "same values"
    same = compare_sketch(ska[i], skb[j], numel, "float32", "float32", Tolerance())
    return "equal" if same["verdict"] == "same" else "same values in another order (permuted?)"


def _by_outputs(ta: Any, tb: Any, ska: Any, skb: Any, paired_a: dict, paired_b: set
                ) -> list[tuple[str, str, str]]:
    """(A module, B module, why) of unpaired modules whose forward outputs compare the
    same, matched in execution order."""
    def outputs(t: Any) -> Any:
        o = t[(t["phase"] == "forward") & (t["direction"] == "output") & (t["index"] == 0)
              & (t["op"] == "")]
        return _call0(o).sort_values("seq")

    oa, ob = outputs(ta), outputs(tb)
    rows_b = [(j, ob.loc[j]) for j in ob.index]
    position = {m: k for k, (_, r) in enumerate(rows_b) for m in [r["module"]]}
    last = -1  # B's position of the latest pair, so that pairs keep execution order
    out = []
    tol = Tolerance()
    for i in oa.index:
        ra = oa.loc[i]
        ma = ra["module"]
        if ma in paired_a:
            last = max(last, position.get(paired_a[ma][0], last))
            continue
        found = None
        for k in [*range(last + 1, len(rows_b)), *range(0, last + 1)]:
            j, rb = rows_b[k]
            mb = rb["module"]
            if mb in paired_b or rb["shape"] != ra["shape"] or rb["dtype"] != ra["dtype"]:
                continue
            if compare_stats(ra, rb, tol)["verdict"] != "same":
                continue
            if ska is not None and skb is not None and compare_sketch(
                    ska[i], skb[j], int(ra["numel"]), ra["dtype"], rb["dtype"],
                    tol)["verdict"] != "same":
                continue
            found = (k, mb)
            break
        if found is not None:
            last = found[0]
            paired_b.add(found[1])
            out.append((ma, found[1], "forward output compares the same"))
    return out


def read_module_map(path: str | os.PathLike) -> ModuleMap:
    """The module map in a file `sleuth map` wrote (and the user edited). ConfigError naming
    the file and the problem when it is not one."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--map {path}: cannot read it ({e.strerror or e}); write one with "
                          f"`sleuth map A B > {path}`") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"--map {path}: not YAML ({e}); `sleuth map A B` writes one") from e
    modules = data.get("modules") if isinstance(data, dict) else None
    if modules is None and isinstance(data, dict) and "modules" in data:
        modules = {}  # "modules:" with no pair under it
    if not isinstance(modules, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in modules.items()):
        raise ConfigError(f"--map {path}: expected a `modules:` mapping of A module names to B "
                          f"module names (\"a.name\": \"b.name\"), as `sleuth map A B` writes")
    seen: dict[str, str] = {}
    for a, b in modules.items():
        if b in seen:
            raise ConfigError(f"--map {path}: B module {b!r} is paired with both "
                              f"{seen[b]!r} and {a!r}; keep one")
        seen[b] = a
    fused = []
    for i, entry in enumerate(data.get("fused") or []):
        sides = [entry.get(k) if isinstance(entry, dict) else None for k in ("a", "b")]
        if not all(isinstance(v, list) and v and all(isinstance(x, str) for x in v)
                   for v in sides) or sorted(map(len, sides))[0] != 1 or \
                max(map(len, sides)) < 2:
            raise ConfigError(f"--map {path}: fused[{i}] must name one module on one side and "
                              f"its parts on the other: {{a: [\"whole\"], b: [\"part1\", "
                              f"\"part2\"]}}")
        fused.append((sides[0], sides[1], f"from {path}"))
    lists = {}
    for key in ("permuted", "only_a", "only_b"):
        value = data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"--map {path}: `{key}:` must be a list of names")
        lists[key] = value
    return ModuleMap(pairs=[(a, b, f"from {path}") for a, b in modules.items()],
                     fused=fused, a=str(data.get("a", "")), b=str(data.get("b", "")), **lists)
