"""The built-in demo corpus: docstrings of Python standard-library modules, collected offline.

Real English text that every machine with Python has, so nothing is downloaded. The modules
and their members are visited in sorted order, so the corpus is the same on every run with the
same Python version. It is written as jsonl (training split) and parquet (validation split) so
the demo exercises the same loaders as user data.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import warnings
from pathlib import Path

# Pure-Python modules with long docstrings; a fixed list keeps the corpus stable.
_MODULES = (
    "argparse", "base64", "bisect", "calendar", "collections", "colorsys", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "difflib", "enum", "fnmatch", "fractions", "functools",
    "getopt", "gettext", "glob", "heapq", "hmac", "html", "inspect", "ipaddress", "json",
    "locale", "logging", "mimetypes", "numbers", "operator", "optparse", "os", "pathlib",
    "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "shlex", "shutil", "statistics",
    "string", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace",
    "traceback", "typing", "uuid", "warnings", "weakref", "zipfile",
)
_VAL_EVERY = 20  # every 20th document goes to validation


def collect_docstrings() -> list[dict[str, str]]:
    """Return `[{"name": "json.dumps", "text": "..."}]` for modules, classes and functions."""
    docs: list[dict[str, str]] = []
    with warnings.catch_warnings():  # touching deprecated members (typing.io) warns
        warnings.simplefilter("ignore")
        for mod_name in _MODULES:
            _add_module(docs, mod_name)
    return docs


def _add_module(docs: list[dict[str, str]], mod_name: str) -> None:
    try:
        module = importlib.import_module(mod_name)
    except ImportError:  # a stripped-down Python may lack one; the rest still make a corpus
        return
    _add(docs, mod_name, module)
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod_name:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            _add(docs, f"{mod_name}.{name}", obj)




def _add(docs: list[dict[str, str]], name: str, obj: object) -> None:
    doc = inspect.getdoc(obj)
    if doc and len(doc) >= 40:
        docs.append({"name": name, "text": doc})


def sft_examples(docs: list[dict[str, str]]) -> list[dict[str, str]]:
    """Question/answer pairs: the prompt names an object, the response is its summary line."""
    out = []
    for d in docs:
        summary = d["text"].strip().split("\n\n")[0].replace("\n", " ")
        out.append({"prompt": f"What does {d['name']} do?\n", "response": summary[:200]})
    return out


def write_demo_corpus(directory: str | Path, mode: str = "pretrain") -> tuple[Path, Path]:
    """Write `demo_{mode}_train.jsonl` and `demo_{mode}_val.parquet` under `directory`.

    Returns the two paths. Existing complete files are reused; files are written atomically.
    """
    directory = Path(directory)
    train = directory / f"demo_{mode}_train.jsonl"
    val = directory / f"demo_{mode}_val.parquet"
    if train.exists() and val.exists():
        return train, val
    directory.mkdir(parents=True, exist_ok=True)
    rows = collect_docstrings()
    if mode == "sft":
        rows = sft_examples(rows)
    train_rows = [r for i, r in enumerate(rows) if i % _VAL_EVERY]
    val_rows = [r for i, r in enumerate(rows) if not i % _VAL_EVERY]

    partial = train.with_name(train.name + f".{os.getpid()}.partial")
    with open(partial, "w", encoding="utf-8") as f:
        for row in train_rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, train)

    import pyarrow as pa
    import pyarrow.parquet as pq

    partial = val.with_name(val.name + f".{os.getpid()}.partial")
    table = pa.Table.from_pylist(val_rows).replace_schema_metadata({"format_version": "1.0"})
    pq.write_table(table, partial)
    with open(partial, "rb") as f:
        os.fsync(f.fileno())
    os.replace(partial, val)
    return train, val
