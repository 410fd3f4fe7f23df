"""Readers for the dashboard and CLI: list a run's graphs, parse a `.ir` file into a DataFrame."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from irdump._errors import IrFormatError
from irdump._graph import FORMAT_VERSION

_FILE_RE = re.compile(r"^(\d{2})_(\w+?)(\.sorted\.ir|\.ir|\.dot|\.svg)$")
_COLUMN_OF = {".ir": "ir", ".sorted.ir": "sorted_ir", ".dot": "dot", ".svg": "svg"}
_LINE_RE = re.compile(
    r"^\s*(?P<index>\d+)  (?P<name>\S+) = (?P<op>[^\s(]+)\((?P<operands>[^)]*)\)"
    r"(?: \{(?P<attrs>.*)\})? : \((?P<ins>[^)]*)\) -> \((?P<outs>[^)]*)\)"
    r"  @(?P<module>\S+)(?:  # (?P<source>.*))?$")
_TYPE_RE = re.compile(r"([\w?]+)\[([^\]]*)\]")


def list_graphs(run_dir: str | os.PathLike) -> Any:
    """The graphs saved under `run_dir/ir` (or `run_dir` itself if it holds them).

    Returns a pandas DataFrame with columns stage (int), name, ir, sorted_ir, dot, svg (paths
    as str, or None when that format was not written), sorted by stage.
    """
    import pandas as pd

    root = Path(run_dir)
    folder = root / "ir" if (root / "ir").is_dir() else root
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    if folder.is_dir():
        for f in sorted(folder.iterdir()):
            m = _FILE_RE.match(f.name)
            if not m or not f.is_file():
                continue
            key = (int(m.group(1)), m.group(2))
            row = rows.setdefault(key, {"stage": key[0], "name": key[1], "ir": None,
                                        "sorted_ir": None, "dot": None, "svg": None})
            row[_COLUMN_OF[m.group(3)]] = str(f)
    columns = ["stage", "name", "ir", "sorted_ir", "dot", "svg"]
    return pd.DataFrame([rows[k] for k in sorted(rows)], columns=columns)


def _types(text: str) -> list[tuple[str, tuple]]:
    out = []
    for dtype, dims in _TYPE_RE.findall(text):
        shape = tuple(int(d) if d.lstrip("-").isdigit() else d for d in dims.split(",") if d)
        out.append((dtype, shape))
    return out


_NODES_RE = re.compile(r"^(\d+)\b")
MAX_IR_BYTES = 256 * 2**20
"""The largest IR text read: a node line is a few hundred bytes, so this holds about a million
nodes, past the backward graph of any model one machine trains. A larger file is refused from
its size, unread (a Graph-page search read a 1.5 GiB `.ir` whole)."""


def read_ir(path: str | os.PathLike) -> Any:
    """Parse a `.ir` or `.sorted.ir` file into a DataFrame, one row per node in file order.

    Columns: index, name, op, module, source, inputs (list of operand names), output_shapes
    (list of tuples), output_dtypes (list of str), input_shapes, attrs (str), forward (the
    linked forward node for backward nodes, else ""). Header fields (entry, stage, capture,
    format_version) are in `df.attrs`.
    Raises IrFormatError for a file that is not IR text or has an unknown major version.
    """
    import pandas as pd

    from tracer import UntrustedFileError
    from tracer.storage import open_regular, printable

    p = Path(path)
    try:
        with open_regular(p) as f:  # a FIFO or a device is refused, never waited on
            size = os.fstat(f.fileno()).st_size
            if size > MAX_IR_BYTES:
                raise IrFormatError(f"{printable(p)} is {size:,} bytes, more than the "
                                    f"{MAX_IR_BYTES:,} an IR text may hold (about a million "
                                    f"nodes); it was not read: export the graphs again, or "
                                    f"move the file out of the run")
            raw = f.read(MAX_IR_BYTES + 1)  # a file growing as it is read stops at the bound
            if len(raw) > MAX_IR_BYTES:
                raise IrFormatError(f"{printable(p)} grew past the {MAX_IR_BYTES:,} bytes an "
                                    f"IR text may hold while it was read; it was not read")
            lines = raw.decode("utf-8").splitlines()
    except UntrustedFileError as e:
        raise IrFormatError(f"cannot read {e}") from e
    except OSError as e:
        raise IrFormatError(f"cannot read {p}: {e}") from e
    except UnicodeDecodeError as e:
        raise IrFormatError(f"{p} is damaged: it is not UTF-8 text ({e}); export the graphs "
                            f"again (sleuth ir, or SLEUTH_SAVE_GRAPHS=1)") from e
    if not lines or not lines[0].startswith("# sleuth-ir format_version="):
        raise IrFormatError(f"{p} is not a sleuth IR file (no '# sleuth-ir format_version=' "
                            "first line); pass a .ir or .sorted.ir file written by irdump")
    version = lines[0].split("=", 1)[1].strip()
    if version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
        raise IrFormatError(f"{p} has IR format_version {version}; this irdump reads "
                            f"{FORMAT_VERSION.split('.')[0]}.x: upgrade sleuth to read it")
    meta: dict[str, str] = {"format_version": version}
    rows = []
    for line in lines[1:]:
        if line.startswith("#"):
            key, sep, value = line[1:].strip().partition(": ")
            if sep and key in ("entry", "stage", "capture"):
                meta[key] = value
            elif sep and key == "nodes":
                declared = _NODES_RE.match(value)
                if declared:
                    meta["nodes"] = declared.group(1)
            continue
        if not line.strip():
            continue
        m = _LINE_RE.match(line)
        if m is None:
            raise IrFormatError(f"{p}: cannot parse node line {line[:80]!r}")
        attrs = m.group("attrs") or ""
        fwd = re.search(r"(?:^|, )forward=(\S+?)(?:,|$)", attrs)
        outs = _types(m.group("outs"))
        rows.append({
            "index": int(m.group("index")), "name": m.group("name"), "op": m.group("op"),
            "module": m.group("module"), "source": m.group("source") or "",
            "inputs": [o.strip().lstrip("%") for o in m.group("operands").split(", ") if o],
            "output_shapes": [s for _, s in outs], "output_dtypes": [d for d, _ in outs],
            "input_shapes": [s for _, s in _types(m.group("ins"))], "attrs": attrs,
            "forward": fwd.group(1) if fwd else "",
        })
    if "nodes" in meta and int(meta["nodes"]) != len(rows):
        # a file cut at a line boundary parses: its header's count is what tells it is short
        raise IrFormatError(f"{p} is truncated or damaged: its header says {meta['nodes']} "
                            f"nodes, the file holds {len(rows)}; export the graphs again")
    columns = ["index", "name", "op", "module", "source", "inputs", "output_shapes",
               "output_dtypes", "input_shapes", "attrs", "forward"]
    df = pd.DataFrame(rows, columns=columns)
    df.attrs.update(meta)
    return df
