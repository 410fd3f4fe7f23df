"""`sleuth docs [TOPIC]`: the guides, readable wherever Sleuth is installed.

The guides are README.md and docs/*.md of the source tree. An install copies them into the
package (`sleuth/_docs/`, see setup.py), so `sleuth --help` can point to them without a
checkout; run from a checkout, the checkout's own files are read.
"""
from __future__ import annotations

import argparse
import difflib
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
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
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
    print(found[topic].read_text(encoding="utf-8"), end="")
    return 0
