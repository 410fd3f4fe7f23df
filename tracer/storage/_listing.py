"""The listing behind `sleuth dump ls`: one row per step file of a dump, the files that could
not be read included, each with its status and why. Every readable file's /records table is
read (through `Dump`, one file at a time), so a damaged table shows here rather than at the
first diff that needs it.
"""
from __future__ import annotations

import os
from typing import Any

from tracer.storage._dump import Dump
from tracer.storage._scan import UNREAD_STATES
from tracer.storage._step_reader import READ_ERRORS


def file_rows(dump: Dump) -> list[dict[str, Any]]:
    """One row per step file of a dump, unread ones included: rank, step, records,
    tensor_bytes, file_bytes, status ("complete", "interrupted", "damaged", "partial",
    "unreadable", or "empty" for a rank folder without a step file), reason, path; rank and
    step as the reader's FileStates give them (None where the path does not name one)."""
    rows = []
    for r in dump.ranks:
        for s in dump.steps(r):
            path = dump.path(r, s)
            row = {"rank": r, "step": s, "records": None, "tensor_bytes": None,
                   "file_bytes": path.stat().st_size, "status": "complete", "reason": "",
                   "path": str(path)}
            try:
                with Dump({(r, s): path}, [], path) as one:  # one file: its errors alone
                    row.update(one.summary().iloc[0].to_dict())
                    row["status"], row["reason"] = one.status(r, s)
                    one.stats(r, s)
            except READ_ERRORS as e:
                row["status"], row["reason"] = "damaged", f"{type(e).__name__}: {e}"
            row.pop("complete", None)
            rows.append(row)
    for st in dump.file_states:
        if st.state not in UNREAD_STATES and st.state != "partial":
            continue
        empty = st.state == "empty"
        try:
            size = None if empty else os.path.getsize(st.path)
        except OSError:
            size = None
        status = ("partial" if st.state in ("partial", "partial_only") else
                  "empty" if empty else "unreadable")
        rows.append({"rank": None if st.rank is None or st.rank < 0 else st.rank,
                     "step": st.step, "records": None, "tensor_bytes": None,
                     "file_bytes": size, "status": status, "reason": st.reason,
                     "path": st.path})
    return rows


def damaged_files(path: str | os.PathLike) -> list[str]:
    """The step files under `path` (a dump, a rank folder or one file) that do not open, or do
    not show their root attributes, through the trusted opener: what to name when `open_dump`
    itself fails on HDF5 metadata, so that the user knows which file to move aside."""
    from pathlib import Path

    from tracer._errors import TracerError
    from tracer.storage._h5open import open_h5

    p = Path(path)
    bad = []
    from tracer.storage._door import STEP_FILE

    for f in ([p] if p.is_file() else
              sorted(f for f in p.rglob("step*.h5") if STEP_FILE.fullmatch(f.name))):
        try:
            with open_h5(f) as h:
                dict(h.attrs)
        except (OSError, KeyError, ValueError, TracerError):
            bad.append(str(f))
    return bad
