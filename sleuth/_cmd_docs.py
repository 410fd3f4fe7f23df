"""`sleuth docs [TOPIC]`: the guides, readable wherever Sleuth is installed.

The guides are README.md and docs/*.md of the source tree. An install copies them into the
package (`sleuth/_docs/`, see setup.py), so `sleuth --help` can point to them without a
checkout; run from a checkout, the checkout's own files are read. The examples the guides cite
(`examples/train.py` and its data) are shipped beside them: an installed guide that cites them
says where they are, and `sleuth docs --examples` copies them into ./examples, where the guides'
commands expect them.
"""
from __future__ import annotations

import argparse
import difflib
import re
from pathlib import Path

from sleuth.cli import CliError

_HERE = Path(__file__).resolve().parent


def guides() -> dict[str, Path]:
    """Topic name -> Markdown file: `readme` and one per docs/*.md, from the install or the
    checkout, whichever this package came from."""
    packaged = _HERE / "_docs"
    if packaged.is_dir():
        readme, folder = packaged / "README.md", packaged
    else:
        readme, folder = _HERE.parent / "README.md", _HERE.parent / "docs"
    found = {"readme": readme} if readme.is_file() else {}
    found.update({p.stem: p for p in sorted(folder.glob("*.md")) if p.name != "README.md"})
    return found


def examples_dir() -> Path | None:
    """The folder holding the examples the guides cite: the install's copy, else the
    checkout's `examples/`; None when neither is there."""
    for folder in (_HERE / "_docs" / "examples", _HERE.parent / "examples"):
        if folder.is_dir():
            return folder
    return None


def _installed(path: Path) -> bool:
    return path.parent == _HERE / "_docs"


def _copy_examples(dest: Path) -> int:
    """Copy the examples into `dest`, never over a file already there."""
    import shutil

    source = examples_dir()
    if source is None:
        raise CliError(f"no examples found beside {_HERE}; reinstall with scripts/install.sh")
    files = sorted(p for p in source.iterdir() if p.is_file())
    there = [str(dest / p.name) for p in files if (dest / p.name).exists()]
    if there:
        raise CliError(f"{', '.join(there)} already exist(s); nothing was copied: remove them, "
                       "or give another folder with --examples DIR")
    dest.mkdir(parents=True, exist_ok=True)
    for p in files:
        shutil.copyfile(p, dest / p.name)
    print(f"sleuth docs: {len(files)} example file(s) copied to {dest} "
          f"({', '.join(p.name for p in files)})")
    return 0


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return ""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "docs", help="print a guide (README, tracer, dump-config, diff, profiler, ...)",
        description="Without TOPIC, list the guides; with one, print it (Markdown). The same "
        "files as README.md and docs/*.md of the source tree, shipped with the package.")
    p.add_argument("topic", nargs="?", metavar="TOPIC",
                   help="a guide's name as listed, e.g. tracer or dump-config (default: list them)")
    p.add_argument("--examples", nargs="?", const="examples", metavar="DIR",
                   help="copy the examples the guides cite (examples/train.py and its data) "
                   "into DIR (default ./examples), where the guides' commands expect them")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.examples is not None:
        if args.topic is not None:
            raise CliError("--examples copies the examples; give it without a TOPIC")
        return _copy_examples(Path(args.examples))
    found = guides()
    if not found:
        raise CliError(f"no guides found beside {_HERE}; reinstall with scripts/install.sh")
    if args.topic is None:
        width = max(map(len, found))
        for name, path in found.items():
            print(f"{name:<{width}}  {_title(path)}")
        print("\n`sleuth docs TOPIC` prints one.")
        return 0
    topic = args.topic.lower().removesuffix(".md")
    if topic not in found:
        close = difflib.get_close_matches(topic, list(found), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise CliError(f"no guide named {args.topic!r}{hint} Guides: {', '.join(found)}")
    text = found[topic].read_text(encoding="utf-8")
    if _installed(found[topic]):
        note = _install_note(text)
        if note:
            print(f"> Installed guide: {note}\n")
    print(text, end="")
    return 0


def _install_note(text: str) -> str:
    """Where the files an installed guide cites are, outside a checkout (no ./examples)."""
    notes = []
    folder = examples_dir()
    if "examples/" in text and folder is not None:
        notes.append(f"the files it cites as `examples/...` are in {folder}; `sleuth docs "
                     "--examples` copies them into ./examples, where its commands expect them")
    others = sorted({m for m in re.findall(r"\b(tests|scripts|benchmarks)/", text)})
    if others:
        notes.append(f"{', '.join(f'`{o}/`' for o in others)} are in a checkout of Sleuth's "
                     "source only")
    return "; ".join(notes) + "." if notes else ""
