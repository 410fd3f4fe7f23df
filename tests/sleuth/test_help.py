"""Every option of every command says what it does, and `sleuth --help` points to guides that
exist wherever Sleuth is installed (`sleuth docs`)."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from sleuth.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


def _parsers(parser, path=("sleuth",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_option_of_every_command_has_help():
    missing, seen = [], 0
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help for a in action._choices_actions}
                missing += [f"{' '.join(path)} {n}" for n in action.choices if not helps.get(n)]
                continue
            seen += 1
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    assert seen > 80  # the walk reached the subcommands' options, not only the top level
    assert not missing, f"options without help: {missing}"


def test_help_points_to_guides_that_sleuth_docs_prints(capsys):
    try:
        build_parser().parse_args(["--help"])
    except SystemExit:
        pass
    assert "`sleuth docs` lists the guides" in capsys.readouterr().out
    assert main(["docs"]) == 0
    listing = capsys.readouterr().out
    # the title column is as wide as the longest topic name, whichever guides there are
    assert "readme" in listing and re.search(r"^dump-config +Dump config", listing, re.M)
    assert main(["docs", "dump-config"]) == 0
    assert capsys.readouterr().out == (REPO / "docs" / "dump-config.md").read_text()
    assert main(["docs", "dump-confg"]) == 2
    assert "did you mean 'dump-config'?" in capsys.readouterr().err


def test_an_install_carries_the_guides(tmp_path):
    """What `pip install` builds (setup.py's build_py) holds the guides; read there, outside any
    checkout, `sleuth docs` prints them."""
    build = tmp_path / "lib"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (build / "sleuth" / "_docs" / "tracer.md").is_file()
    env = {**os.environ, "PYTHONPATH": str(build)}
    out = subprocess.run([sys.executable, "-m", "sleuth", "docs", "readme"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith((REPO / "README.md").read_text())


def test_installed_guides_say_where_their_examples_are(tmp_path):
    """The guides cite `examples/train.py` and its data, which a checkout has and an install
    had not: the examples now ship with the guides, an installed guide names their folder, and
    `sleuth docs --examples` copies them where the guides' commands expect them."""
    build = tmp_path / "lib"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(build)}
    user = tmp_path / "elsewhere"
    user.mkdir()

    def sleuth(*args):
        return subprocess.run([sys.executable, "-m", "sleuth", *args], cwd=user, env=env,
                              capture_output=True, text=True, timeout=120)

    shipped = build / "sleuth" / "_docs" / "examples"
    guides = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    cited = {m for g in guides for m in re.findall(r"\bexamples/([\w.-]+)", g.read_text())}
    assert cited and sorted(cited) == sorted(p.name for p in shipped.iterdir()), cited
    out = sleuth("docs", "tracer")
    assert out.returncode == 0, out.stderr
    note = out.stdout.splitlines()[0]
    assert note.startswith("> Installed guide:") and str(shipped) in note, note
    assert "sleuth docs --examples" in note
    copied = sleuth("docs", "--examples")
    assert copied.returncode == 0, copied.stderr
    assert copied.stdout.startswith("sleuth docs: 3 example file(s) copied to examples")
    for name in cited:
        assert (user / "examples" / name).read_bytes() == (REPO / "examples" / name).read_bytes()
    again = sleuth("docs", "--examples")  # never over the user's files
    assert again.returncode == 2 and "already exist" in again.stderr, again.stderr
