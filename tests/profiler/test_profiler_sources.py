"""profiler._sources: the user's line of a call, found in the function's parsed source."""
from __future__ import annotations

from profiler._sources import LineFinder, is_library


def test_call_found_in_the_function_not_in_strings(tmp_path):
    (tmp_path / "loop.py").write_text(
        "def main():\n"                                   # 1
        "    help = 'call .item() each step'\n"          # 2: a string, no call
        "    x = compute()\n"                            # 3
        "    if x.isfinite().all().item():\n"            # 4
        "        print(x.item())\n"                      # 5
        "def other():\n"                                 # 6
        "    return y.isfinite()\n")                     # 7
    finder = LineFinder([str(tmp_path)])
    path = tmp_path / "loop.py"
    # torch's line for a frame running when profiling began is stale (here 5): the def is found
    assert finder.find(("loop.py", 5, "main"), "isfinite") == f"{path}:4"
    assert finder.find(("loop.py", 1, "main"), "item") == f"{path}:4,5"  # both, none guessed
    assert finder.find(("loop.py", 6, "other"), "isfinite") == f"{path}:7"
    assert finder.find(("loop.py", 5, "main"), "nothing", strict=True) == ""
    assert finder.find(("loop.py", 5, "main"), None) == f"{path}:1"  # the def line
    assert finder.find(("gone.py", 9, "f"), "g") == "gone.py:9"  # file not found: as torch wrote


def test_library_frames():
    assert is_library("torch/nn/modules/linear.py")
    assert is_library("threading.py") and is_library("<frozen runpy>")
    assert is_library("profiler/_collector.py")  # Sleuth's own tools are never the user's line
    assert not is_library("train.py") and not is_library("trainer/train.py")
