"""Module mapping between two codebases: which module of dump B is which module of dump A.

A user porting a model (their own code against a Hugging Face implementation, an old codebase
against a new one) dumps both with the same weights and the same batch, and gets record names
that never match. `map_modules` pairs the modules by what they hold and compute, and where
they sit in the module tree:

1. Parameters, by value: two parameters with the same dtype, element count and checksum (the
   sum of their bits) hold the same values. The checksum does not see order, so a weight
   stored transposed (GPT-2's Conv1D against nn.Linear) pairs too; the sketches (when both
   dumps kept them) then tell "the same values in the same order" from "the same values,
   moved". A module pairs with the module its parameters pair into. Values that several
   parameters hold alike (LayerNorm weights of ones, zero biases) say nothing on their own:
   such a parameter goes with its module's pair when another parameter settled it, else with
   the candidate whose forward input and output compare the same, else in recorded order,
   and the pair is listed as ambiguous.
   A parameter that pairs nothing one to one may be the concatenation of several of the
   other side's (a fused qkv projection against q, k and v): element counts and checksums add
   up over a concatenation (tracer.analysis._fused), so such a group is found exactly, and
   the diff compares the one module with the others combined.
2. Modules without parameters of their own (activations, containers, attention cores), by
   their forward input and output together: a candidate's output must compare the same
   (statistics and sketches, with the diff's tolerances), and so must its input where both
   sides recorded one. An output alone does not tell a module from the modules that hand the
   same tensor on: a dropout at p = 0, an Identity, or a container whose output is its last
   child's all output what the module before them computed. The input does (a dropout's
   input is its output; an attention container's input is the normalised hidden state), so an
   identity-like module never takes a container's place. Candidates are ranked by that
   evidence, then by their place in the tree (under the pair of the module's nearest paired
   ancestor; holding the pairs of its paired descendants), then a leaf for a leaf; a tie is
   broken by execution order and listed as ambiguous. An identity-like module whose input was
   not recorded pairs only where the tree says so.
3. What is left, by place in the tree alone (`_by_place`): downstream of a port's bug the
   values differ, yet a block container still holds the pairs of its layers, and an
   activation is still the one module of its kind under its parent's pair. A map made from the
   buggy port's own dump then pairs what the faithful port's would.

Each pair carries a confidence (tracer.analysis._map_file.Confidence). A map file passed as
`keep` is authoritative: its pairs, fused groups and unpaired lists are taken as written, and
only the modules it does not name are paired here, around its pairs.
"""
from __future__ import annotations

import os
from collections import Counter

from tracer.analysis._compare import Tolerance, compare_sketch
from tracer.analysis._fused import find_fused
from tracer.analysis._map_file import Confidence, ModuleMap, read_module_map
from tracer.analysis._map_side import ROOT, Links, Side, io, read_side, squeezed, tree_fit
from tracer.analysis._origin import param_name

_SHOWN = 4  # other candidates an ambiguous pair names


def map_modules(a: str | os.PathLike, b: str | os.PathLike, *, rank: int = 0,
                step: int | None = None, b_rank: int | None = None,
                b_step: int | None = None,
                keep: ModuleMap | str | os.PathLike | None = None) -> ModuleMap:
    """Pair the modules of dump A with those of dump B (module docstring): two dumps of the
    same weights fed the same batch, each from its own code. `step` None: each dump's first
    step. `keep`: a map (or map file) whose decisions stand as written; only the modules it
    does not name are paired. Raises TracerError for a rank or step a dump lacks, ConfigError
    for a `keep` file that is not a map."""
    sa = read_side(a, rank, step)
    sb = read_side(b, rank if b_rank is None else b_rank, step if b_step is None else b_step)
    source = keep.kept if isinstance(keep, ModuleMap) else str(keep or "")
    if keep is not None and not isinstance(keep, ModuleMap):
        keep = read_module_map(keep, "--keep")
    out = _generate(sa, sb, keep)
    out.a, out.b = str(a), str(b)
    if keep is not None:
        _against(out, _generate(sa, sb, None))
        out.kept = source or "a map given to map_modules"
    return out


def _against(out: ModuleMap, alone: ModuleMap) -> None:
    """Say beside each kept pair what the dumps alone say of it: the evidence where they
    agree, the pair they would make where they do not."""
    theirs = {a: (b, why) for a, b, why in alone.pairs}
    unsure = {a: e for a, *e in alone.ambiguous}
    for k, (ma, mb, why) in enumerate(out.pairs):
        if out.confidence.get(ma) != "given":
            continue
        other, evidence = theirs.get(ma, (None, ""))
        if other == mb:
            out.pairs[k] = (ma, mb, evidence)
            out.confidence[ma] = alone.confidence[ma]
            if ma in unsure:
                out.ambiguous.append((ma, *unsure[ma]))
        elif other is None:
            out.pairs[k] = (ma, mb, f"{why}; the dumps alone pair {ma} with nothing")
        else:
            out.pairs[k] = (ma, mb, f"{why}; the dumps alone pair {ma} with {other} "
                                    f"({alone.confidence[ma]}: {evidence})")
    rank_a = {m: k for k, (m, _, _) in enumerate(out.pairs)}
    out.ambiguous.sort(key=lambda e: rank_a.get(e[0], len(rank_a)))


def _generate(sa: Side, sb: Side, keep: ModuleMap | None) -> ModuleMap:
    """The map of two dumps' modules, around the decisions of `keep`."""
    out = ModuleMap()
    paired: dict[str, tuple[str, Confidence, str]] = {}  # A module -> (B module, how sure, why)
    decided_a: set[str] = set()  # named by `keep`: paired there, or left unpaired on purpose
    decided_b: set[str] = set()
    if keep is not None:
        for ma, mb, why in keep.pairs:
            paired[ma] = (mb, "given", why)
        out.fused = list(keep.fused)
        out.permuted = list(keep.permuted)
        decided_a = {*paired, *keep.only_a, *(m for g, _, _ in keep.fused for m in g)}
        decided_b = {*(mb for mb, _, _ in paired.values()), *keep.only_b,
                     *(m for _, g, _ in keep.fused for m in g)}
    pairs, permuted, rest_a, rest_b = _by_parameters(sa, sb, decided_a, decided_b)
    out.permuted += [p for p in permuted if p not in out.permuted]
    found = find_fused(rest_a, rest_b)
    out.fused += found
    in_fused = {m for g, _, _ in out.fused for m in g}
    taken_b = {*decided_b, *(m for _, g, _ in found for m in g)}
    for ma, mb, sure, why, others in pairs:  # fused first: a part's zero bias may have
        if ma in in_fused or mb in taken_b:  # paired with any zero bias
            continue
        paired[ma] = (mb, sure, why)
        taken_b.add(mb)
        if others:
            out.ambiguous.append((ma, others, why))
    links = Links()
    for ma, (mb, _, _) in paired.items():
        links[ma] = mb
    for mods_a, mods_b, _ in out.fused:  # a group's parts sit where the whole sits
        for x in mods_a:
            if x not in links:
                links[x] = mods_b[0]
    skip = {*decided_a, *in_fused, *paired}
    for how in (_by_inputs_and_outputs, _by_place):  # values first; the tree for the rest
        for ma, mb, sure, why, others in how(sa, sb, skip, taken_b, links):
            paired[ma] = (mb, sure, why)
            skip.add(ma)
            if others:
                out.ambiguous.append((ma, others, why))
    names = [m for m in sa.order if m in paired] + [m for m in paired if m not in sa.rank]
    out.pairs = [(m, paired[m][0], paired[m][2]) for m in names if m not in in_fused]
    out.confidence = {m: paired[m][1] for m, _, _ in out.pairs}
    rank_a = {m: k for k, (m, _, _) in enumerate(out.pairs)}
    out.ambiguous.sort(key=lambda e: rank_a.get(e[0], len(rank_a)))
    paired_b = {*(mb for mb, _, _ in paired.values()), *(m for _, g, _ in out.fused for m in g)}
    out.only_a = [m for m in sa.order if m not in paired and m not in in_fused]
    out.only_b = [m for m in sb.order if m not in paired_b]
    return out


def _by_parameters(sa: Side, sb: Side, skip_a: set[str], skip_b: set[str]
                   ) -> tuple[list[tuple], list[str], list[dict], list[dict]]:
    """(A module, B module, confidence, why, other candidates) of module pairs whose
    parameters hold the same values, A's parameters whose B counterpart holds them in another
    layout, and the parameter records of each side that paired nothing (for `find_fused`)."""
    pa, pb = sa.params(), sb.params()
    pa = pa[~pa["module"].isin(skip_a)]
    pb = pb[~pb["module"].isin(skip_b)]
    key = lambda r: (r["dtype"], int(r["numel"]), int(r["checksum"]))  # noqa: E731
    rows_a, rows_b = pa.to_dict("records"), pb.to_dict("records")
    free: dict[tuple, list[int]] = {}
    for j, r in enumerate(rows_b):
        free.setdefault(key(r), []).append(j)
    count_a = Counter(key(r) for r in rows_a)
    votes: dict[str, Counter] = {}
    reasons: dict[tuple[str, str], list[str]] = {}
    permuted: list[str] = []
    took: dict[int, int] = {}

    def take(i: int, j: int) -> None:
        ra, rb = rows_a[i], rows_b[j]
        free[key(ra)].remove(j)
        took[i] = j
        votes.setdefault(ra["module"], Counter())[rb["module"]] += 1
        how = _how_equal(sa, sb, pa.index[i], pb.index[j], ra, rb)
        full = param_name(ra)
        if how not in ("equal", "same values"):
            permuted.append(full)
        reasons.setdefault((ra["module"], rb["module"]), []).append(
            f"{full.removeprefix(ra['module'] + '.')} {how}")

    for i, r in enumerate(rows_a):  # values no other parameter holds settle a module's pair
        if count_a[key(r)] == 1 and len(free.get(key(r), ())) == 1:
            take(i, free[key(r)][0])
    settled = {ma: c.most_common(1)[0][0] for ma, c in votes.items()}
    owned = set(settled.values())
    shared: dict[str, list[int]] = {}  # A module -> its parameters whose values others hold
    for i, r in enumerate(rows_a):
        if i in took or not free.get(key(r)):
            continue
        mods = [rows_b[j]["module"] for j in free[key(r)]]
        if settled.get(r["module"]) in mods:  # a zero bias goes with its weight's pair
            take(i, free[key(r)][mods.index(settled[r["module"]])])
        elif r["module"] not in settled:
            shared.setdefault(r["module"], []).append(i)
    guessed: dict[str, list[str]] = {}
    told: set[str] = set()
    for ma, params in shared.items():
        fits_all = None  # B modules that hold every one of these values, owned by no one else
        for i in params:
            mods = {rows_b[j]["module"] for j in free.get(key(rows_a[i]), ())} - owned
            fits_all = mods if fits_all is None else fits_all & mods
        cands = sorted(fits_all or (), key=lambda m: sb.rank.get(m, len(sb.rank)))
        if not cands:
            continue
        fit = [mb for mb in cands if io(sa, ma, sb, mb) == (True, True)]
        mb = fit[0] if len(fit) == 1 else (fit or cands)[0]
        if len(fit) == 1:
            told.add(ma)
        elif len(cands) > 1:
            guessed[ma] = [m for m in (fit or cands) if m != mb]
        owned.add(mb)
        for i in params:
            j = next(j for j in free[key(rows_a[i])] if rows_b[j]["module"] == mb)
            take(i, j)
    out = []
    for ma, counter in votes.items():
        mb, _ = counter.most_common(1)[0]
        why = "parameters: " + ", ".join(reasons[(ma, mb)])
        sure: Confidence = "high"
        others = guessed.get(ma, [])
        if ma in told:
            why += "; values other modules hold too: input and output compare the same"
        elif others:
            sure = "low"
            why += (f"; values other modules hold too, paired in recorded order (also "
                    f"{_names(others)})")
        out.append((ma, mb, sure, why, others))
    rest_a = [r for i, r in enumerate(rows_a) if i not in took]
    taken = set(took.values())
    rest_b = [r for j, r in enumerate(rows_b) if j not in taken]
    return out, permuted, rest_a, rest_b


def _names(mods: list[str]) -> str:
    more = f" and {len(mods) - _SHOWN} more" if len(mods) > _SHOWN else ""
    return ", ".join(mods[:_SHOWN]) + more


def _how_equal(sa: Side, sb: Side, i: int, j: int, ra: dict, rb: dict) -> str:
    if ra["shape"] != rb["shape"]:
        return f"same values, shape [{ra['shape']}] vs [{rb['shape']}] (stored transposed?)"
    if sa.sk is None or sb.sk is None:
        if not (int(ra["data_nbytes"]) and int(rb["data_nbytes"])):
            return "same values"
        equal = (sa.read(ra["name"]) == sb.read(rb["name"])).all()  # tensor dumps: no sketch
        return "equal" if equal else "same values in another order (permuted?)"
    same = compare_sketch(sa.sk[i], sb.sk[j], int(ra["numel"]), "float32", "float32",
                          Tolerance())
    return "equal" if same["verdict"] == "same" else "same values in another order (permuted?)"


def _by_inputs_and_outputs(sa: Side, sb: Side, skip: set[str], taken_b: set[str],
                           links: Links) -> list[tuple]:
    """(A module, B module, confidence, why, other candidates) for the modules not paired by
    their parameters, parents before children (so that a child is placed under its parent's
    pair)."""
    out = []
    last = -1  # B's position of the latest pair, so that ties keep execution order
    n = max(len(sb.order), 1)
    for ma in sa.tree_order:
        if ma in links:
            last = sb.rank.get(links[ma], last)
        if ma in skip or ma not in sa.out:
            continue
        r = sa.out[ma][1]
        scored = []
        for mb in sb.by_output.get((r["dtype"], squeezed(r["shape"])), []):
            if mb in taken_b:
                continue
            same_out, same_in = io(sa, ma, sb, mb)
            if not same_out or same_in is False:
                continue
            tree = sum(tree_fit(sa, sb, ma, mb, links))
            if same_in is None and tree <= 0 and (sa.passes_on(ma) or sb.passes_on(mb)):
                continue  # its output alone is the output of the module before it
            kind = (ma in sa.children) == (mb in sb.children)  # a leaf for a leaf
            scored.append(((same_in is True, tree, kind), (sb.rank[mb] - last - 1) % n, mb))
        if not scored:
            continue
        scored.sort(key=lambda s: (not s[0][0], -s[0][1], not s[0][2], s[1]))
        (same_in, tree, kind), _, mb = scored[0]
        ties = [m for ev, _, m in scored[1:] if ev == (same_in, tree, kind)]
        evidence = "forward input and output compare the same" if same_in else \
            "forward output compares the same (no input to compare)"
        where = {1: "; its place in the tree agrees", 2: "; its place in the tree agrees",
                 -1: "; its place in the tree differs", -2: "; its place in the tree differs"}
        why = evidence + where.get(tree, "")
        sure: Confidence = "high" if same_in and tree >= 0 else \
            "medium" if same_in or tree > 0 else "low"
        if ties:
            sure = "low"
            why += f"; so do {_names(ties)}: paired in execution order"
        out.append((ma, mb, sure, why, ties))
        links[ma] = mb
        taken_b.add(mb)
        last = sb.rank[mb]
    return out


def _by_place(sa: Side, sb: Side, skip: set[str], taken_b: set[str], links: Links
              ) -> list[tuple]:
    """(A module, B module, confidence, why, other candidates) for modules whose values
    differ (downstream of a port's bug) but whose place in the tree says which they are: the
    roots; a container and the one B module that holds the pairs of its paired descendants
    and no other pair; a module without paired descendants and the one B module under its
    parent's pair alike in output dtype and shape and in handing a tensor on or not (an
    activation after a faulty layer), when no sibling of it is alike too."""
    out = []
    if ROOT in sa.out and ROOT in sb.out and ROOT not in links and ROOT not in skip \
            and ROOT not in taken_b:
        out.append((ROOT, ROOT, "medium", "the root modules (their outputs differ)", []))
        links[ROOT] = ROOT
        taken_b.add(ROOT)
    for ma in sa.tree_order:
        if ma in skip or ma in links:
            continue
        below = [x for x in sa.below.get(ma, ()) if x in links]
        if below:  # B modules above every pair of those: above the first, checked for all
            fits = [mb for mb in sb.above.get(links[below[0]], ()) if mb not in taken_b
                    and tree_fit(sa, sb, ma, mb, links) in ((0, 1), (1, 1))]
            why = f"its place in the tree: it holds the pairs of its {len(below)} paired " \
                  f"module(s) below and no other pair"
        else:
            up = sa.parent.get(ma)
            if up not in links or ma not in sa.out:
                continue
            siblings = [m for m in sa.children.get(up, []) if m not in links and m not in skip
                        and _alike(sa, ma, sa, m, links)]
            if siblings != [ma]:
                continue  # several alike under one parent: their order is no evidence
            fits = [mb for mb in sb.children.get(links[up], [])
                    if mb not in taken_b and _alike(sa, ma, sb, mb, links)]
            why = f"its place in the tree: the only module under {links[up]} alike in " \
                  f"output dtype and shape"
        if len(fits) != 1:
            continue
        mb = fits[0]
        same_out, _ = io(sa, ma, sb, mb)
        if ma in sa.out and mb in sb.out:
            why += "; its output compares the same" if same_out else "; its output differs"
        out.append((ma, mb, "medium", why, []))
        links[ma] = mb
        taken_b.add(mb)
    return out


def _alike(sa: Side, ma: str, side: Side, m: str, links: Links) -> bool:
    """Whether module `m` of `side` could stand where `ma` (of A, without paired modules
    below it) stands: the same output dtype and shape, handing a tensor on or not alike, no
    pair below it."""
    o, r = side.out.get(m), sa.out[ma][1]
    if o is None or (o[1]["dtype"], squeezed(o[1]["shape"])) != (r["dtype"],
                                                                   squeezed(r["shape"])):
        return False
    paired = links if side is sa else links.back
    return side.passes_on(m) == sa.passes_on(ma) and \
        not any(x in paired for x in side.below.get(m, ()))
