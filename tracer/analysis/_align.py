"""Pairing the records of two dumps so that an op inserted or removed in one run does not shift
every later pair, and two unlike records never make one pair.

Records are grouped by (module scope, phase); inside a group the two sequences of
(op, direction, index, shape) keys, in execution order, are aligned with a longest-common-
subsequence match (difflib.SequenceMatcher without its junk heuristic). The call counter is left
out of the key on purpose: one extra `x + 0.0` bumps the call count of every later `aten.add` in
its module, which is exactly what breaks a join on exact names.

The shape is in the key because records of different shapes are different tensors, whatever
their names say: autograd accumulates a module's parameter gradients in an order that depends on
the graph, so fp32 against bf16 autocast (whose casts add nodes) runs the `aten.detach` of the
bias gradient first in one run and of the weight gradient first in the other. Parameter records
(`optimizer` phase) carry their parameter in their name, and pair by it. What an LCS leaves
unpaired in a group because it moved (such a reordering) is then paired by the same key, in
order; what is left after that has no partner.

Keys alone cannot tell which of two adjacent `aten.add` records is the inserted one, so the
alignment runs twice: first on keys extended with a fingerprint of the data (dtype, shape,
checksum, NaN count), whose exact matches anchor the pairing (the no-op's output equals its
input, the real add's output equals its partner's); then the stretches between anchors are
aligned on keys only, which pairs records whose values diverged.

Keys and fingerprints are numbered once for both tables together (pandas groupby), so the
matching compares small integers.
"""
from __future__ import annotations

import difflib
from typing import Any

import numpy as np

Pair = tuple[int | None, int | None]  # positional row indices into the A and B tables
_Group = tuple[list[int], list[int], list[int]]  # rows, keys, fingerprints in execution order


def _numbered(df_a: Any, df_b: Any, layouts: bool) -> tuple[np.ndarray, ...]:
    """Group, key and fingerprint numbers of every row of both tables (A's rows first), equal
    where the values are equal."""
    import pandas as pd

    cols = ["module", "phase", "op", "direction", "index", "dtype", "shape", "checksum", "nan",
            "name", "numel"]
    both = pd.concat([df_a[cols], df_b[cols]], ignore_index=True)
    group = both.groupby(["module", "phase"], sort=False).ngroup().to_numpy()
    param = both["phase"].to_numpy() == "optimizer"
    if layouts:
        # two codebases through a module map: a weight may be stored transposed or with dims of
        # 1 (the diff compares those by layout), never with other element counts; a fused
        # module's records meet its parts' combined records, whose counts differ by design
        size = both["numel"].astype(str).to_numpy()
        parts = pd.concat([df[["parts"]] if "parts" in df else
                           pd.DataFrame({"parts": np.zeros(len(df), dtype=np.int64)})
                           for df in (df_a, df_b)], ignore_index=True)["parts"]
        fused = np.isin(group, group[parts.fillna(0).to_numpy() > 0])
        size[fused] = ""
        owner = np.full(len(both), "", dtype=object)  # parameter names differ between codebases
    else:
        size = both["shape"].to_numpy()
        owner = np.full(len(both), "", dtype=object)
        if param.any():
            owner[param] = both["name"][param].str.split(".optimizer.", n=1).str[0].to_numpy()
    keyed = pd.DataFrame({"op": both["op"], "direction": both["direction"],
                          "index": both["index"], "size": size, "owner": owner})
    key = keyed.groupby(list(keyed.columns), sort=False).ngroup().to_numpy()
    printed = pd.DataFrame({"key": key, "dtype": both["dtype"], "shape": both["shape"],
                            "checksum": both["checksum"], "nan": both["nan"]})
    fingerprint = printed.groupby(list(printed.columns), sort=False).ngroup().to_numpy()
    return group, key, fingerprint


def _groups(seq: np.ndarray, group: np.ndarray, key: np.ndarray,
            fingerprint: np.ndarray) -> dict[int, _Group]:
    """Each group's rows, keys and fingerprints in execution order."""
    order = np.argsort(seq, kind="stable")
    order = order[np.argsort(group[order], kind="stable")]
    if not len(order):
        return {}
    g = group[order]
    cuts = np.flatnonzero(g[1:] != g[:-1]) + 1
    starts, ends = np.r_[0, cuts], np.r_[cuts, len(order)]
    rows, keys, prints = order.tolist(), key[order].tolist(), fingerprint[order].tolist()
    return {int(g[s]): (rows[s:e], keys[s:e], prints[s:e])
            for s, e in zip(starts.tolist(), ends.tolist())}


def _lcs(rows_a: list[int], keys_a: list[int], rows_b: list[int], keys_b: list[int],
         prints_a: list[int] | None, prints_b: list[int] | None, pairs: list[Pair]) -> None:
    if keys_a == keys_b:  # the common case: same code, same records
        pairs.extend(zip(rows_a, rows_b))
        return
    if prints_a is None or prints_b is None:
        seq_a, seq_b = keys_a, keys_b
    else:
        seq_a, seq_b = prints_a, prints_b
    sm = difflib.SequenceMatcher(None, seq_a, seq_b, autojunk=False)
    for tag, a0, a1, b0, b1 in sm.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(rows_a[a0:a1], rows_b[b0:b1]))
        elif prints_a is not None and a1 > a0 and b1 > b0:
            # values differ here: pair what the keys allow
            _lcs(rows_a[a0:a1], keys_a[a0:a1], rows_b[b0:b1], keys_b[b0:b1], None, None, pairs)
        else:
            pairs.extend((i, None) for i in rows_a[a0:a1])
            pairs.extend((None, i) for i in rows_b[b0:b1])


def _moved(pairs: list[Pair], start: int, key_of: dict[int, int], key_of_b: dict[int, int]) -> None:
    """Pair, in order, the records of one group's pairs (`pairs[start:]`) that the LCS left
    without a partner but whose key the other side has without a partner too: records that
    ran in another order (gradient accumulation), not records one run lacks."""
    lone_a = [i for i, j in pairs[start:] if j is None]
    lone_b = [j for i, j in pairs[start:] if i is None]
    if not lone_a or not lone_b:
        return
    waiting: dict[int, list[int]] = {}
    for j in reversed(lone_b):
        waiting.setdefault(key_of_b[j], []).append(j)
    moved: list[Pair] = []
    for i in lone_a:
        queue = waiting.get(key_of[i])
        if queue:
            moved.append((i, queue.pop()))
    if not moved:
        return
    taken_a = {i for i, _ in moved}
    taken_b = {j for _, j in moved}
    kept = [(i, j) for i, j in pairs[start:]
            if not ((j is None and i in taken_a) or (i is None and j in taken_b))]
    pairs[start:] = kept + moved


def align(df_a: Any, df_b: Any, *, layouts: bool = False) -> list[Pair]:
    """Pair the rows of two statistics tables (DataFrames with the /records columns).

    `layouts`: B's modules were renamed to A's through a module map (two codebases): records
    then pair when their element counts agree (a parameter stored transposed, or with dims of
    1, keeps its count) rather than their shapes, parameter records pair in the order they were
    recorded (their names are each codebase's own), and a fused module's group pairs on keys
    without counts (its records meet its parts' combined ones).

    Returns (row_a, row_b) positional pairs; None marks a record only one side has. Two rows
    of different shapes (element counts, with `layouts`) or of different parameters are never
    one pair. The order of the result is unspecified; callers sort by execution order."""
    group, key, fingerprint = _numbered(df_a, df_b, layouts)
    n = len(df_a)
    ga = _groups(df_a["seq"].to_numpy(), group[:n], key[:n], fingerprint[:n])
    gb = _groups(df_b["seq"].to_numpy(), group[n:], key[n:], fingerprint[n:])
    pairs: list[Pair] = []
    for g, (rows_a, keys_a, prints_a) in ga.items():
        rows_b, keys_b, prints_b = gb.get(g, ([], [], []))
        start = len(pairs)
        _lcs(rows_a, keys_a, rows_b, keys_b, prints_a, prints_b, pairs)
        if rows_b and len(pairs) - start > max(len(rows_a), len(rows_b)):
            _moved(pairs, start, dict(zip(rows_a, keys_a)), dict(zip(rows_b, keys_b)))
    for g, (rows_b, _, _) in gb.items():
        if g not in ga:
            pairs.extend((None, i) for i in rows_b)
    return pairs


def align_by_name(df_a: Any, df_b: Any) -> list[Pair]:
    """The naive pairing by exact record name (what msprobe's compare does); kept to show in
    tests why it is not enough."""
    names_b = {n: i for i, n in enumerate(df_b["name"].tolist())}
    pairs: list[Pair] = []
    seen: set[int] = set()
    for i, n in enumerate(df_a["name"].tolist()):
        j = names_b.get(n)
        pairs.append((i, j))
        if j is not None:
            seen.add(j)
    pairs.extend((None, j) for j in range(len(df_b)) if j not in seen)
    return pairs
