"""Pairing the records of two dumps so that an op inserted or removed in one run does not shift
every later pair.

Records are grouped by (module scope, phase); inside a group the two sequences of
(op, direction, index) keys, in execution order, are aligned with a longest-common-subsequence
match (difflib.SequenceMatcher without its junk heuristic). The call counter is left out of the
key on purpose: one extra `x + 0.0` bumps the call count of every later `aten.add` in its module,
which is exactly what breaks a join on exact names.

Keys alone cannot tell which of two adjacent `aten.add` records is the inserted one, so the
alignment runs twice: first on keys extended with a fingerprint of the data (dtype, shape,
checksum, NaN count), whose exact matches anchor the pairing (the no-op's output equals its
input, the real add's output equals its partner's); then the stretches between anchors are
aligned on keys only, which pairs records whose values diverged.
"""
from __future__ import annotations

import difflib
from typing import Any

import numpy as np

Pair = tuple[int | None, int | None]  # positional row indices into the A and B tables


def _groups(df: Any) -> dict[tuple[str, str], tuple[list[int], list[tuple], list[tuple]]]:
    groups: dict[tuple[str, str], tuple[list[int], list[tuple], list[tuple]]] = {}
    cols = {c: df[c].tolist() for c in ("module", "phase", "op", "direction", "index", "dtype",
                                         "shape", "checksum", "nan")}
    order = np.argsort(df["seq"].to_numpy(), kind="stable")
    module, phase, op, direction, index, dtype, shape, checksum, nan = cols.values()
    for i in order.tolist():
        rows, keys, prints = groups.setdefault((module[i], phase[i]), ([], [], []))
        rows.append(i)
        key = (op[i], direction[i], index[i])
        keys.append(key)
        prints.append((key, dtype[i], shape[i], checksum[i], nan[i]))
    return groups


def _lcs(rows_a: list[int], keys_a: list[tuple], rows_b: list[int], keys_b: list[tuple],
         prints_a: list[tuple] | None, prints_b: list[tuple] | None, pairs: list[Pair]) -> None:
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


def align(df_a: Any, df_b: Any) -> list[Pair]:
    """Pair the rows of two statistics tables (DataFrames with the /records columns).

    Returns (row_a, row_b) positional pairs; None marks a record only one side has. The order
    of the result is unspecified; callers sort by execution order."""
    ga, gb = _groups(df_a), _groups(df_b)
    pairs: list[Pair] = []
    for group, (rows_a, keys_a, prints_a) in ga.items():
        rows_b, keys_b, prints_b = gb.get(group, ([], [], []))
        _lcs(rows_a, keys_a, rows_b, keys_b, prints_a, prints_b, pairs)
    for group, (rows_b, _, _) in gb.items():
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
