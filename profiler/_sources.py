"""The user's source line of an op, from the Python frames a `with_stack` trace holds.

With `with_stack=True` torch.profiler writes each Python call as a `python_function` event
named `path(line): function`, nested on the op's thread around the ops it made. An op's user
line is the innermost such frame that is the user's line by the rule every Sleuth package
shares (`sleuth.common`: not torch, the standard library or Sleuth's own tools; a Hugging Face
model's installed code is, as in the dump): for `aten::addmm` under `nn.Linear` that is the
model's line that called the layer, for an `aten::item` in the loop the loop's line. Without
stacks there are no frames and the source is "" (the module table still names each module's
`forward`).

torch shortens a frame's path to what follows its `sys.path` entry (`torch/nn/modules/linear.py`,
`train.py` for a script run as `python examples/train.py`), so a frame is judged by where its
first path component imports from in this process (`short_frame_kind`).
"""
from __future__ import annotations

import ast
import hashlib
import os
import re
from typing import Any

from sleuth.common import INTERNAL, LIBRARY, USER, short_frame_kind

PYTHON_EVENT = "python_function"
CHANGED = " (file changed since profiling; line may be off)"
"""Written after a line read from a file whose content differs from when its trace was taken
(by the hash the collector stored; for profiles without hashes, a file modified since)."""
MAX_SOURCE_BYTES = 4 << 20
"""Source files larger than this are neither read for lines nor hashed."""
_FRAME_RE = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<func>.*)$")
def frame_of(name: str) -> tuple[str, int, str] | None:
    """(file, line, function) of a `python_function` event's name, or None."""
    m = _FRAME_RE.match(name)
    if m is None:
        return None
    return m.group("file"), int(m.group("line")), m.group("func")


def user_line(ev: Any, memo: dict[tuple[int, bool], tuple[str, int]],
              finder: LineFinder | None = None) -> tuple[str, str]:
    """(line, caller) of op `ev` (a nested trace event: `.parent`, `.cat`, `.name`), as the dump
    gives a record's `source` and `caller`: the line is that of the innermost frame around it
    that may be an op's line (not `INTERNAL`), "" when the trace holds none; the caller is the
    user's call that led there when that frame is an installed library's (a Hugging Face
    model's), else "".

    A frame names the function (torch writes its `def` line, or for a frame already running
    when profiling began, the line it was at then); the call inside it is found by the name of
    what it called (a builtin such as `isfinite`, a module attribute such as `fc1`, a library
    function such as `checkpoint`), looked up in that function's source by `finder`. `memo`
    caches the answers for the events below each call.
    """
    line, kind = _line(ev, memo, finder, False)
    return line, (_line(ev, memo, finder, True)[0] if kind == LIBRARY else "")


def _line(ev: Any, memo: dict[tuple[int, bool], tuple[str, int]], finder: LineFinder | None,
          users_only: bool) -> tuple[str, int]:
    """The line of the innermost frame around `ev` that is the user's (`users_only`) or may
    be an op's line, with that frame's kind; ("", INTERNAL) when there is none."""
    chain: list[Any] = []
    p = ev.parent
    while p is not None:
        if (id(p), users_only) in memo:
            return memo[(id(p), users_only)]
        if p.cat == PYTHON_EVENT:
            frame = frame_of(p.name)
            kind = short_frame_kind(frame[0]) if frame is not None else INTERNAL
            if kind == USER or kind == LIBRARY and not users_only:
                assert frame is not None
                if finder is None:
                    return f"{frame[0]}:{frame[1]}", kind
                # the first name below the frame that the function calls is the call (names
                # nearer the frame may be wrappers: torch.optim's `wrapper` around `step`)
                for i, token in _callees(chain):
                    found = finder.find(frame, token, strict=True)
                    if found:
                        for e in chain[:i + 1]:  # what lies below the call is its own
                            memo[(id(e), users_only)] = (found, kind)
                        return found, kind
                # no call: an operator (`x @ w`, `a + b`) makes an op without a Python call
                top = next((e for e in reversed(chain) if e.cat == "cpu_op"), ev)
                token = operator_token(top.name)
                found = finder.find(frame, token, strict=True) if token else ""
                return found or finder.find(frame, None), kind
        chain.append(p)
        p = p.parent
    for e in chain:
        memo[(id(e), users_only)] = ("", INTERNAL)
    return "", INTERNAL


# aten ops that Python operators make, by the ast node's operator class
_OPERATORS = {"matmul": "MatMult", "mm": "MatMult", "bmm": "MatMult", "add": "Add",
              "sub": "Sub", "rsub": "Sub", "mul": "Mult", "div": "Div", "pow": "Pow",
              "remainder": "Mod", "floor_divide": "FloorDiv", "neg": "USub",
              "bitwise_and": "BitAnd", "bitwise_or": "BitOr", "bitwise_xor": "BitXor",
              "gt": "Gt", "lt": "Lt", "ge": "GtE", "le": "LtE", "eq": "Eq", "ne": "NotEq",
              # `x[i]`, `x[:, 1:]`, `x[mask]`; and a tensor's truth (`if t:`, `while t`, `a and
              # b`, `not t`), which makes `is_nonzero` and the `.item()` under it
              "select": "Subscript", "slice": "Subscript", "index": "Subscript",
              "is_nonzero": "Truth",
              # `for v in t` (iterating a tensor unbinds it) and `float(v)`, `int(v)` (a
              # tensor's Python number: its `.item()`)
              "unbind": "Iter", "item": "Scalar", "_local_scalar_dense": "Scalar"}
_OP_PREFIX = "<operator "


def site_key(site: str) -> str:
    """`file:line` with the file made absolute: one key for a line however its path was
    spelled (a trace's, the collector's record, a relative co_filename)."""
    path, _, line = site.rpartition(":")
    return f"{os.path.abspath(path)}:{line}"


def operator_token(op: str) -> str | None:
    """The token `LineFinder.find` looks up for an aten op a Python operator makes
    (`aten::matmul` -> `x @ w`, `aten::add_` -> `x += y`), or None."""
    if not op.startswith("aten::"):
        return None
    kind = _OPERATORS.get(op[len("aten::"):].rstrip("_"))
    return f"{_OP_PREFIX}{kind}>" if kind else None


_MODULE_CALL = "<module call>"
"""Before a top-level module's name: the token of its call, found by the call sites the
collector recorded (`module_call_lines`), since `model(x)` names no attribute to look up."""
_BUILTIN_RE = re.compile(r"^<built-in (?:method|function) (\w+)")
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+>$")


def builtin_name(name: str) -> str:
    """A builtin call's `python_function` name without the object's address
    (`<built-in method tolist of Tensor object at 0x7f..>` -> `<built-in method tolist of Tensor
    object>`): the address differs between runs and between steps, so with it the same call
    pairs with nothing."""
    return _ADDRESS_RE.sub(">", name)


def builtin_token(name: str) -> str | None:
    """The called name of a builtin call's event (`tolist`, `sleep`), or None."""
    m = _BUILTIN_RE.match(name)
    return m.group(1) if m else None


def _callees(chain: list[Any]):
    """(index in `chain`, name) of what the user's frame may have called, nearest that frame
    (the end of `chain`) first: builtins, module attributes, library functions."""
    from profiler._attribution import MODULE_PREFIX
    for i in range(len(chain) - 1, -1, -1):
        name = chain[i].name
        m = _BUILTIN_RE.match(name)
        if m:
            yield i, m.group(1)
        elif name.startswith(MODULE_PREFIX):
            full = name[len(MODULE_PREFIX):]
            attr = full.rsplit(".", 1)[-1]
            if full.startswith("<") and "." not in full:  # a top-level module: `model(x)`
                yield i, _MODULE_CALL + full
            elif not attr.startswith("<") and not attr.isdigit():
                yield i, attr
        elif chain[i].cat == PYTHON_EVENT:
            frame = frame_of(name)
            if frame is not None and frame[2].isidentifier():
                yield i, frame[2]


# a with_stack frame's name as torch's Chrome export writes it: "name": "train.py(23): main"
_FRAME_NAME_RE = re.compile(r'"name": ?"([^"\\]+?)\(\d+\): ')


def _resolve(short: str, search_path: list[str]) -> str | None:
    """The file a frame's shortened path names: the first `root/short` on the search path
    that is a regular file small enough to read (LineFinder reads the same one)."""
    for root in search_path:
        path = os.path.join(root, short) if root else short
        try:
            if os.path.isfile(path) and os.path.getsize(path) < MAX_SOURCE_BYTES:
                return path
        except (OSError, ValueError):
            continue
    return None


def content_hash(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def source_hashes(trace_text: str, search_path: list[str]) -> dict[str, str]:
    """The content hash of each user source file a with_stack trace cites, keyed by the path
    as its frames write it: stored with the window when it is saved, so a reader can tell a
    line read from an edited file (`LineFinder`) by content, not by modification time, which
    a checkout, a copy or an editor's save can move either way."""
    out: dict[str, str] = {}
    for short in {m.group(1) for m in _FRAME_NAME_RE.finditer(trace_text)}:
        if short_frame_kind(short) != USER:  # an installed library's file is not edited
            continue
        path = _resolve(short, search_path)
        if path is None:
            continue
        try:
            with open(path, "rb") as f:
                out[short] = content_hash(f.read(MAX_SOURCE_BYTES))
        except OSError:
            continue
    return out


class LineFinder:
    """Finds a call's line inside a function's source: the files are found on the search path
    the run recorded (torch shortens a frame's path to what follows its sys.path entry) and
    parsed (never run) with `ast`, so a name in a string or comment is no call."""

    def __init__(self, search_path: list[str], profiled_at: float | None = None,
                 hashes: dict[str, str] | None = None,
                 call_lines: dict[str, list[str]] | None = None,
                 own_lines: list[str] | None = None) -> None:
        """`hashes`: the content hash of each source file when the trace was taken
        (`source_hashes`); a file whose content now differs has its lines marked CHANGED.
        `profiled_at`: when the trace was taken (seconds since the epoch), the fallback for a
        file without a stored hash (profiles written before hashes): a file modified after it
        is marked CHANGED. `own_lines`: the `file:line`s where the collector's own step() was
        called (`collector_call_lines`), never the call that made an op of the user's
        `.step()` (an optimizer's) when another call of that name is there."""
        self._path = [p for p in search_path if isinstance(p, str)]
        self._at = profiled_at
        self._hashes = hashes if isinstance(hashes, dict) else {}
        # a top-level module's name -> the `file:line`s that called it (the collector's)
        self._calls = call_lines if isinstance(call_lines, dict) else {}
        self._own = {site_key(x) for x in (own_lines if isinstance(own_lines, list) else [])
                     if isinstance(x, str) and ":" in x}
        self._files: dict[str, tuple[str, ast.Module, bool] | None] = {}
        self._found: dict[tuple[str, int, str, str | None], tuple[str, bool]] = {}

    def _read(self, short: str) -> tuple[str, ast.Module, bool] | None:
        if short not in self._files:
            self._files[short] = None
            path = _resolve(short, self._path)
            try:
                if path is not None:
                    with open(path, "rb") as f:
                        data = f.read(MAX_SOURCE_BYTES)
                    stored = self._hashes.get(short)
                    if isinstance(stored, str):
                        changed = content_hash(data) != stored
                    else:  # no hash stored: modified after the trace was taken
                        changed = self._at is not None and os.path.getmtime(path) > self._at
                    tree = ast.parse(data.decode("utf-8", errors="replace"))
                    self._files[short] = (os.path.abspath(path), tree, changed)
            except (OSError, SyntaxError, ValueError, RecursionError):
                pass
        return self._files[short]

    def find(self, frame: tuple[str, int, str], token: str | None, strict: bool = False) -> str:
        """`file:line` of the calls of `token` in the function of `frame` (lines joined by
        commas when it is called on several); the function's `def` line when no call of that
        name is found or `token` is None; the frame's own line when the file is not found.
        `strict`: "" unless a call of `token` is found."""
        short, line, func = frame
        key = (short, line, func, token)
        if key not in self._found:
            self._found[key] = self._find(short, line, func, token)
        text, matched = self._found[key]
        return text if matched or not strict else ""


    def _find(self, short: str, line: int, func: str, token: str | None) -> tuple[str, bool]:
        got = self._read(short)
        if got is None:
            return f"{short}:{line}", False
        path, tree, changed = got
        mark = CHANGED if changed else ""
        if token is not None and token.startswith(_MODULE_CALL):
            sites = self._calls.get(token[len(_MODULE_CALL):]) or []
            lines = sorted({int(n) for f, _, n in (str(x).rpartition(":") for x in sites)
                            if n.isdigit() and os.path.abspath(f) == path})
            if not lines:
                return f"{path}:{line}{mark}", False
            return f"{path}:{','.join(map(str, lines))}{mark}", True
        scope = _scope(tree, line, func)
        if scope is None:
            return f"{path}:{line}{mark}", False
        if token is not None and token.startswith(_OP_PREFIX):
            kind = token[len(_OP_PREFIX):-1]
            if kind == "Subscript":
                lines = sorted({n.lineno for n in _walk(scope, (ast.Subscript,))})
            elif kind == "Truth":
                lines = sorted(_truth_lines(scope))
            elif kind == "Iter":  # a loop over range() iterates no tensor
                lines = sorted({n.iter.lineno for n in _walk(scope, (ast.For, ast.AsyncFor,
                                                                     ast.comprehension))
                                if not (isinstance(n.iter, ast.Call)
                                        and _call_name(n.iter) == "range")})
            elif kind == "Scalar":
                lines = sorted({n.lineno for n in _walk_calls(scope)
                                if _call_name(n) in ("float", "int", "bool", "complex")})
            else:
                lines = sorted({n.lineno for n in _walk_operators(scope)
                                if type(_operator(n)).__name__ == kind or
                                any(type(o).__name__ == kind for o in getattr(n, "ops", ()))})
        else:
            lines = sorted({n.lineno for n in _walk_calls(scope) if _call_name(n) == token})
            theirs = [n for n in lines if f"{path}:{n}" not in self._own]
            lines = theirs or lines  # the collector's own `.step()` is not the optimizer's
        if not lines:  # the def: torch's line for a frame running when profiling began is stale
            return (f"{path}:{getattr(scope, 'lineno', line) if scope is not tree else line}"
                    f"{mark}", False)
        # several calls of one name in a function: all are named, none is guessed
        return f"{path}:{','.join(map(str, lines))}{mark}", True


def _scope(tree: ast.Module, line: int, func: str) -> ast.AST | None:
    """The innermost `def func` whose lines hold `line` (torch's line for a frame is its def
    line, or the line it was at), or the module for `<module>`."""
    if func == "<module>":
        return tree
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first <= line <= (node.end_lineno or node.lineno):
                if best is None or first >= best[0]:
                    best = (first, node)
    return best[1] if best else None


def _walk(scope: ast.AST, kinds: tuple[type, ...]):
    """The nodes of `kinds` in `scope`, not those inside the functions and classes it defines."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, kinds):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _walk_calls(scope: ast.AST):
    """The calls in `scope`, not those inside the functions and classes it defines."""
    return _walk(scope, (ast.Call,))


def _walk_operators(scope: ast.AST):
    """The operator expressions in `scope`: binary, augmented, unary, comparisons."""
    return _walk(scope, (ast.BinOp, ast.AugAssign, ast.UnaryOp, ast.Compare))


def _truth_lines(scope: ast.AST) -> set[int]:
    """The lines where Python asks a value's truth: the tests of `if`, `while`, `x if c else
    y` and `assert`, and `and`, `or`, `not`."""
    lines = set()
    for n in _walk(scope, (ast.If, ast.While, ast.IfExp, ast.Assert, ast.BoolOp, ast.UnaryOp)):
        if isinstance(n, ast.UnaryOp):
            if isinstance(n.op, ast.Not):
                lines.add(n.lineno)
        elif isinstance(n, ast.BoolOp):
            lines.add(n.lineno)
        else:
            lines.add(n.test.lineno)
    return lines


def _operator(node: ast.AST) -> ast.AST | None:
    return getattr(node, "op", None)


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
