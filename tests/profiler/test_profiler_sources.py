"""profiler._sources: the user's line of a call, found in the function's parsed source."""
from __future__ import annotations

import pytest

from profiler._sources import LineFinder
from sleuth.common import INTERNAL, LIBRARY, USER, short_frame_kind


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


def test_frames_as_torch_shortens_them():
    assert short_frame_kind("torch/nn/modules/linear.py") == INTERNAL
    assert short_frame_kind("threading.py") == INTERNAL == short_frame_kind("<frozen runpy>")
    # Sleuth's own tools are never the user's line
    assert short_frame_kind("profiler/_collector.py") == INTERNAL
    assert short_frame_kind("train.py") == USER == short_frame_kind("trainer/train.py")
    # an installed model's code is the op's line, as in the dump
    assert short_frame_kind("transformers/models/llama/modeling_llama.py") == LIBRARY


def test_operator_lines_and_changed_file(tmp_path):
    (tmp_path / "net.py").write_text(
        "def forward(self, x):\n"                        # 1
        "    x = x @ self.extra\n"                       # 2: no call, an operator
        "    x += 1\n"                                   # 3
        "    return self.fc(x)\n")                       # 4
    from profiler._sources import CHANGED, operator_token
    path = tmp_path / "net.py"
    finder = LineFinder([str(tmp_path)])
    assert finder.find(("net.py", 1, "forward"), operator_token("aten::matmul")) == f"{path}:2"
    assert finder.find(("net.py", 1, "forward"), operator_token("aten::add_")) == f"{path}:3"
    assert operator_token("aten::linear") is None
    # a file modified after its trace was taken: the line is marked, never silently given
    later = LineFinder([str(tmp_path)], profiled_at=path.stat().st_mtime - 60)
    assert later.find(("net.py", 1, "forward"), "fc") == f"{path}:4{CHANGED}"
    same = LineFinder([str(tmp_path)], profiled_at=path.stat().st_mtime + 60)
    assert same.find(("net.py", 1, "forward"), "fc") == f"{path}:4"
    # a stored content hash decides over the time: modified later but the same text is no
    # change; another text is one even when the file looks older than the trace
    from profiler._sources import content_hash
    now = content_hash(path.read_bytes())
    kept = LineFinder([str(tmp_path)], profiled_at=path.stat().st_mtime - 60,
                      hashes={"net.py": now})
    assert kept.find(("net.py", 1, "forward"), "fc") == f"{path}:4"
    edited = LineFinder([str(tmp_path)], profiled_at=path.stat().st_mtime + 60,
                        hashes={"net.py": content_hash(b"other text")})
    assert edited.find(("net.py", 1, "forward"), "fc") == f"{path}:4{CHANGED}"


def test_source_hashes_of_the_files_a_trace_cites(tmp_path):
    from profiler._sources import content_hash, source_hashes
    (tmp_path / "train.py").write_text("print(1)\n")
    text = ('[{"ph": "X", "cat": "python_function", "name": "train.py(1): <module>"},'
            '{"ph": "X", "cat": "python_function", "name": "torch/nn/modules/module.py(1750): '
            '_call_impl"}, {"ph": "X", "cat": "python_function", "name": "gone.py(3): f"}]')
    # the user's file by the path the frame writes; a library's and a missing one are not
    assert source_hashes(text, [str(tmp_path)]) == {
        "train.py": content_hash(b"print(1)\n")}


NET = '''import sys, torch
from torch import nn
import profiler


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.extra = nn.Parameter(torch.randn(32, 32))
        self.fc = nn.Linear(32, 8)

    def forward(self, x):
        x = x @ self.extra
        return self.fc(x)


model = Net()
x = torch.randn(4, 32)
cfg = profiler.CollectorConfig(wait=1, warmup=1, active=2, with_stack=True)
with profiler.Collector(sys.argv[1], config=cfg) as c:
    for _ in range(4):
        model(x).sum().backward()
        c.step()
'''


@pytest.mark.slow
def test_profiled_operator_line_and_edited_script(tmp_path):
    """An op made by the first line of a forward (`x @ w`, no call) is given that line, not the
    `def`; once the script is edited, its lines are read from the new text and say so."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import profiler
    from profiler._sources import CHANGED
    repo = Path(__file__).resolve().parents[2]
    script = tmp_path / "net.py"
    script.write_text(NET)
    old = script.stat().st_mtime - 3600  # written well before the trace
    os.utime(script, (old, old))
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    want = NET.splitlines().index("        x = x @ self.extra") + 1
    ops = profiler.read_profile(tmp_path / "run").ops
    mm = ops[ops["name"] == "aten::matmul"]
    assert list(mm["source"]) == [f"{script}:{want}"], mm
    import json
    meta_path = tmp_path / "run" / "profile" / "rank0" / "window0.json"
    assert "net.py" in json.loads(meta_path.read_text())["source_hashes"]
    # the top-level module's call site, which no frame of the trace names
    call = NET.splitlines().index("        model(x).sum().backward()") + 1
    assert json.loads(meta_path.read_text())["module_call_lines"] == {
        "<root>": [f"{script}:{call}"]}
    # judged by content: a file saved again unchanged (a checkout, an editor) is no change ...
    os.utime(script)
    ops = profiler.read_profile(tmp_path / "run").ops
    assert list(ops[ops["name"] == "aten::matmul"]["source"]) == [f"{script}:{want}"]
    # ... and an edit whose time was set back (a copy with `cp -p`, a checkout) is one
    script.write_text("# a line added after profiling\n" + NET)
    os.utime(script, (old, old))
    ops = profiler.read_profile(tmp_path / "run").ops
    mm = ops[ops["name"] == "aten::matmul"]
    assert all(s.endswith(CHANGED) for s in mm["source"]), mm
    # a profile written before hashes: the modification time decides, as it did
    meta = json.loads(meta_path.read_text())
    del meta["source_hashes"]
    meta_path.write_text(json.dumps(meta))
    assert not any(s.endswith(CHANGED) for s in
                   profiler.read_profile(tmp_path / "run").ops["source"])
    os.utime(script)
    mm = profiler.read_profile(tmp_path / "run").ops
    assert all(s.endswith(CHANGED) for s in mm[mm["name"] == "aten::matmul"]["source"])


def test_a_top_level_module_call_is_given_its_line(tmp_path):
    """`out = net(x)` in the user's loop calls no attribute and no builtin, and torch names the
    loop's frame by its `def` line: the ops of a library's model (every op of a Hugging Face
    model's forward) take the call line the collector recorded for the top-level module."""
    from profiler._tables import build_tables
    (tmp_path / "loop.py").write_text("def main(net, x):\n"
                                      "    x = x + 1\n"
                                      "    out = net(x)\n"
                                      "    return out\n")

    def X(name, ts, dur, cat):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        X("loop.py(1): main", 0, 100, "python_function"),
        X("torch/nn/modules/module.py(1773): _wrapped_call_impl", 10, 80, "python_function"),
        X("sleuth.module::<root>", 20, 60, "user_annotation"),
        X("aten::addmm", 30, 20, "cpu_op")]}
    meta = {"python_path": [str(tmp_path)],
            "module_call_lines": {"<root>": [f"{tmp_path / 'loop.py'}:3"]}}
    ops = build_tables(trace, meta)["ops"]
    assert [r["source"] for r in ops] == [f"{tmp_path / 'loop.py'}:3"]
    # profiles without the call sites: the function's def line, as before
    assert [r["source"] for r in build_tables(trace, {"python_path": [str(tmp_path)]})["ops"]] \
        == [f"{tmp_path / 'loop.py'}:1"]


def test_a_backward_op_takes_its_forward_ops_line(tmp_path):
    """The backward of a new cast runs inside `loss.backward()`, but the user wrote the cast:
    an op in an autograd node is given the line of the forward op that made the node (by the
    node's Sequence number), so a slowdown's forward and backward cost add up on its line."""
    from profiler._tables import build_tables
    (tmp_path / "loop.py").write_text("def main(x):\n"
                                      "    y = x.double()\n"
                                      "    y.sum().backward()\n")

    def X(name, ts, dur, cat="cpu_op", **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                "args": args}

    trace = {"traceEvents": [
        X("loop.py(1): main", 0, 200, "python_function"),
        X("<built-in method double of Tensor object at 0x7f>", 10, 10, "python_function"),
        X("aten::_to_copy", 11, 8, **{"Sequence number": 7}),
        X("torch/_tensor.py(570): backward", 50, 100, "python_function"),
        X("autograd::engine::evaluate_function: ToCopyBackward0", 60, 80,
          **{"Sequence number": 7}),
        X("ToCopyBackward0", 61, 78, **{"Sequence number": 7}),
        X("aten::to", 65, 70)]}
    lines = {r["name"]: r["source"] for r in
             build_tables(trace, {"python_path": [str(tmp_path)]})["ops"]}
    cast = f"{tmp_path / 'loop.py'}:2"
    assert lines == {"aten::_to_copy": cast, "ToCopyBackward0": cast, "aten::to": cast,
                     "autograd::engine::evaluate_function: ToCopyBackward0": cast}


def test_subscripts_and_truth_tests_are_given_their_lines(tmp_path):
    """`pred[i]` makes aten::select and `if t:` makes aten::is_nonzero without a Python call:
    each is given the line that subscripts or tests, not the `def`."""
    (tmp_path / "acc.py").write_text(
        "def accuracy(pred, y):\n"                       # 1
        "    hits = 0\n"                                 # 2
        "    for i in range(len(y)):\n"                  # 3
        "        if pred[i] == y[i]:\n"                  # 4
        "            hits += 1\n"                        # 5
        "    head = pred[:, :2]\n"                       # 6
        "    ok = not (head.sum() > 0)\n"                # 7
        "    return hits, ok\n")                         # 8
    from profiler._sources import operator_token
    path = tmp_path / "acc.py"
    finder = LineFinder([str(tmp_path)])
    frame = ("acc.py", 1, "accuracy")
    assert finder.find(frame, operator_token("aten::select")) == f"{path}:4,6"
    assert finder.find(frame, operator_token("aten::slice")) == f"{path}:4,6"
    assert finder.find(frame, operator_token("aten::is_nonzero")) == f"{path}:4,7"


LOOP_ACC = '''import sys, torch
import profiler


def accuracy(pred, y):
    hits = 0
    for i in range(len(y)):
        if pred[i] == y[i]:
            hits += 1
    return hits


pred, y = torch.randint(0, 3, (16,)), torch.randint(0, 3, (16,))
cfg = profiler.CollectorConfig(wait=0, warmup=1, active=2, with_stack=True)
with profiler.Collector(sys.argv[1], config=cfg) as c:
    for _ in range(3):
        accuracy(pred, y)
        c.step()
'''


@pytest.mark.slow
def test_a_python_loop_over_a_tensor_is_given_its_line(tmp_path):
    import profiler
    script = _profile_script(tmp_path, LOOP_ACC, "acc.py")
    want = f"{script}:{LOOP_ACC.splitlines().index('        if pred[i] == y[i]:') + 1}"
    ops = profiler.read_profile(tmp_path / "run").ops
    for name in ("aten::select", "aten::eq", "aten::is_nonzero"):
        rows = ops[ops["name"] == name]
        assert len(rows) and set(rows["source"]) == {want}, (name, rows[["name", "source"]])


LOOP_OPT = '''import sys, torch
import profiler

model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
cfg = profiler.CollectorConfig(wait=0, warmup=1, active=2, with_stack=True)
with profiler.Collector(sys.argv[1], config=cfg) as collector:
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        collector.step()
'''


@pytest.mark.slow
def test_the_optimizers_step_is_not_the_collectors(tmp_path):
    """`opt.step()` and `collector.step()` in one loop: the optimizer's ops are given the
    optimizer's line alone, never Sleuth's own call of the same name."""
    import json

    import profiler
    script = _profile_script(tmp_path, LOOP_OPT, "loop.py")
    lines = LOOP_OPT.splitlines()
    want = f"{script}:{lines.index('        opt.step()') + 1}"
    own = f"{script}:{lines.index('        collector.step()') + 1}"
    meta = json.loads((tmp_path / "run" / "profile" / "rank0" / "window0.json").read_text())
    assert own in meta["collector_call_lines"]
    ops = profiler.read_profile(tmp_path / "run").ops
    adam = ops[ops["name"].isin(["aten::addcmul_", "aten::lerp_", "aten::sqrt"])]
    assert len(adam) and set(adam["source"]) == {want}, adam[["name", "source"]]


LOOP_ITER = '''import sys, torch
import profiler

w = torch.randn(40)
cfg = profiler.CollectorConfig(wait=0, warmup=1, active=2, with_stack=True)
with profiler.Collector(sys.argv[1], config=cfg) as c:
    for _ in range(3):
        s = 0.0
        for v in w[:20]:
            s += float(v)
        c.step()
'''


@pytest.mark.slow
def test_iterating_a_tensor_and_taking_its_numbers_are_given_their_lines(tmp_path):
    """`for v in t` makes aten::unbind and `float(v)` aten::item, neither a call of that name:
    each is given its line, in a loop at a script's top level too (where the frame's own line
    is where the loop was when profiling began)."""
    import profiler
    script = _profile_script(tmp_path, LOOP_ITER, "it.py")
    lines = LOOP_ITER.splitlines()
    ops = profiler.read_profile(tmp_path / "run").ops
    for name, text in (("aten::unbind", "        for v in w[:20]:"),
                       ("aten::item", "            s += float(v)")):
        rows = ops[ops["name"] == name]
        want = f"{script}:{lines.index(text) + 1}"
        assert len(rows) and set(rows["source"]) == {want}, (name, rows[["name", "source"]])


def _profile_script(tmp_path, text: str, name: str):
    """Write `text` to tmp_path/name and run it (it profiles into tmp_path/run); its path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = tmp_path / name
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return script
