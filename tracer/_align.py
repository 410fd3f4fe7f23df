"""Pairing the records of two dumps so that an op inserted or removed in one run does not shift
every later pair.

Records are grouped by (module scope, phase); inside a group the two sequences of
(op, direction, index) keys, in execution order, are aligned with a longest-common-subsequence
match (difflib.SequenceMatcher without its junk heuristic). The call counter is left out of the
key on purpose: one extra `x + 0.0` bumps the call count of every later `aten.add` in its module,
which is exactly what breaks a join on exact names.
"""
from __future__ import annotations

import difflib
from typing import Any

import numpy as np

Pair = tuple[int | None, int | None]  # positional row indices into the A and B tables


def _keys(df: Any) -> dict[tuple[str, str], tuple[list[int], list[tuple]]]:
    groups: dict[tuple[str, str], tuple[list[int], list[tuple]]] = {}
    modules = df["module"].tolist()
    phases = df["phase"].tolist()
    ops = df["op"].tolist()
    dirs = df["direction"].tolist()
    idx = df["index"].tolist()
    order = np.argsort(df["seq"].to_numpy(), kind="stable")
    for i in order.tolist():
        rows, keys = groups.setdefault((modules[i], phases[i]), ([], []))
        rows.append(i)
        keys.append((ops[i], dirs[i], idx[i]))
    return groups


def align(df_a: Any, df_b: Any) -> list[Pair]:
    """Pair the rows of two statistics tables (DataFrames with columns seq, module, phase, op,
    direction, index). Returns (row_a, row_b) positional pairs; None marks a record only one
    side has. Order of the result is unspecified; callers sort by execution order."""
    ga, gb = _keys(df_a), _keys(df_b)
    pairs: list[Pair] = []
    for group, (rows_a, keys_a) in ga.items():
        rows_b, keys_b = gb.get(group, ([], []))
        if keys_a == keys_b:  # the common case: same code, same records
            pairs.extend(zip(rows_a, rows_b))
            continue
        matched_a: set[int] = set()
        matched_b: set[int] = set()
        sm = difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False)
        for block in sm.get_matching_blocks():
            for k in range(block.size):
                ia, ib = rows_a[block.a + k], rows_b[block.b + k]
                pairs.append((ia, ib))
                matched_a.add(ia)
                matched_b.add(ib)
        pairs.extend((i, None) for i in rows_a if i not in matched_a)
        pairs.extend((None, i) for i in rows_b if i not in matched_b)
    for group, (rows_b, _) in gb.items():
        if group not in ga:
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
