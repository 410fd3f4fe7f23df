"""Every ```bash block of README.md and docs/*.md runs as written (tests/docs/command_blocks.py
has the rules)."""
from __future__ import annotations

import pytest

from command_blocks import (REPO, BlockError, environment, extract_blocks, run_command, run_dirs,
                            run_document, tool_bin)

README = REPO / "README.md"
GUIDES = sorted((REPO / "docs").glob("*.md"))


@pytest.mark.slow
def test_readme_then_every_guide_run_as_written_in_one_clone(tmp_path):
    clone, bin_dir = tmp_path / "clone", tool_bin(tmp_path / "bin")
    for path in [README, *GUIDES]:
        try:
            skipped = run_document(path, clone, bin_dir)
        except BlockError as e:  # FILE:LINE, the command and its output; the runner's frames add nothing
            pytest.fail(str(e), pytrace=False)
        assert all(b.norun for b in skipped)


def test_each_guide_writes_runs_of_its_own():
    readme = run_dirs(README)
    for guide in GUIDES:
        assert run_dirs(guide) <= {guide.stem}, \
            f"{guide.name} names run dirs outside runs/{guide.stem}/: {sorted(run_dirs(guide))}"
        assert guide.stem not in readme, f"README.md writes into runs/{guide.stem}/ of {guide.name}"


def test_run_dirs_are_found_in_commands_only(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("See runs/prose.\n\n```bash\nsleuth train --run-dir runs/a/b\n"
                   "sleuth diff runs/c runs/d --out x/runs/e\n```\n")
    assert run_dirs(doc) == {"a", "c", "d"}


def test_a_failing_command_is_named_by_file_and_line(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# t\n\n```bash\necho ok > a.txt\ncat a.txt \\\n  missing.txt\n```\n")
    with pytest.raises(BlockError, match=r"doc\.md:5: `cat a.txt .*missing.txt` exited 1"):
        run_document(doc, tmp_path / "clone", tool_bin(tmp_path / "bin"))
    assert (tmp_path / "clone" / "a.txt").read_text() == "ok\n"


def test_norun_needs_a_reason_and_skips_the_block(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- norun: needs a GPU -->\n```bash\nfalse\n```\n")
    assert [b.norun for b in run_document(doc, tmp_path / "c", tool_bin(tmp_path / "b"))] == \
        ["needs a GPU"]
    doc.write_text("<!-- norun: -->\n```bash\nfalse\n```\n")
    with pytest.raises(BlockError, match="needs a reason"):
        extract_blocks(doc)


def test_sleuth_on_path_is_this_checkout(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("```bash\npython -c 'import sleuth; print(sleuth.__file__)' > where.txt\n"
                   "sleuth --version\nsleuth diff nowhere elsewhere\n```\n")
    with pytest.raises(BlockError, match=r"doc\.md:4: `sleuth diff nowhere elsewhere` exited 2"):
        run_document(doc, tmp_path / "c", tool_bin(tmp_path / "b"))
    assert (tmp_path / "c" / "where.txt").read_text().startswith(str(REPO / "sleuth"))


@pytest.mark.slow
def test_a_dashboard_is_served_on_a_free_port_and_stopped(tmp_path):
    run = tmp_path / "c" / "runs" / "a"
    run.mkdir(parents=True)
    (run / "run.json").write_text('{"name": "a", "world_size": 1}')
    doc = tmp_path / "doc.md"
    doc.write_text("```bash\nsleuth dashboard runs/a --port 8050   # http://127.0.0.1:8050/\n```\n")
    [block] = extract_blocks(doc)
    url = run_command(block.commands[0], tmp_path / "c", environment(tool_bin(tmp_path / "b")))
    assert url.startswith("http://127.0.0.1:") and ":8050/" not in url  # the comment swallowed nothing
