"""The tracer's folders keep their shape: no import circle among its modules, each subpackage
reached from outside through its public face, and no other package importing tracer privates.

Imports are read with `ast`, every one of them: at module level, inside functions (they run
when called) and under `if TYPE_CHECKING:` (they tie two modules together just the same).
"""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACER = ROOT / "tracer"
SUBPACKAGES = ("capture", "storage", "analysis")
# the top-level modules the subpackages share; the Dumper and attach sit above the subpackages
SHARED = {"tracer._config", "tracer._errors", "tracer._validate", "tracer._crash",
          "tracer._watch_config", "tracer._dtype_ranges"}
# the recording side: what runs inside a traced training run
RECORDING = ("tracer.capture", "tracer.storage", "tracer._dumper", "tracer._config",
             "tracer._attach")
OTHER_PACKAGES = ("sleuth", "dashboard", "profiler", "irdump", "trainer")
PROJECT = ("tracer", *OTHER_PACKAGES)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str = "tracer") -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _exports(package: str) -> dict[str, str]:
    """A lazy face's map (public name -> defining module); {} for a face that imports eagerly."""
    return getattr(importlib.import_module(package), "_EXPORTS", {})


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in `path`; names is empty for `import x`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def _targets(module: str, names: list[str], modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` an import runs: the module itself, a submodule named in it, or
    the module that defines a name a package's face exports."""
    found = {module} if module in modules else set()
    for name in names:
        sub = f"{module}.{name}"
        if sub in modules:
            found.add(sub)
        elif module in modules and modules[module].name == "__init__.py":
            where = _exports(module).get(name)
            if where is not None:
                found |= _targets(where, [name], modules) - {where} or {where}
    return found


def _graph(package: str = "tracer") -> dict[str, set[str]]:
    """Which module of `package` imports which other module of it."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for _, module, names in _imports(path):
            if module == package or module.startswith(package + "."):
                graph[m] |= _targets(module, names, modules) - {m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in SUBPACKAGES else None


def test_the_import_graph_is_read():
    graph = _graph()
    # a few edges the layout rests on, so that an unread import cannot pass the tests below
    assert "tracer.storage._tensor_reader" in graph["tracer.analysis._diff"]
    assert "tracer.capture._module_hooks" in graph["tracer._dumper"]
    assert "tracer._watch_config" in graph["tracer._config"]
    assert "tracer.storage._watch_observer" in graph["tracer.analysis._check"]


@pytest.mark.parametrize("package", PROJECT)
def test_no_import_circle_in_any_package(package):
    """No two modules of one package import each other, directly or around a longer loop,
    counting imports inside functions too: a circle makes the import order matter and leaves
    two concepts that cannot be read apart (docs/architecture.md, "Import direction")."""
    assert _cycles(_graph(package)) == []


def test_every_package_graph_is_read():
    """A few edges outside the tracer, so that an unread import cannot pass the test above."""
    assert "dashboard._serve" in _graph("dashboard")["dashboard._routes"]
    assert "sleuth._diff_report" in _graph("sleuth")["sleuth._cmd_diff"]
    assert "sleuth.common._run_identity" in _graph("sleuth")["sleuth.common"]
    assert "trainer.model" in _graph("trainer")["trainer.train"]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_recording_never_imports_judging():
    """capture/, storage/, the Dumper, the config and attach (and the shared modules they use)
    reach no module of analysis/, directly or through another, at import or inside a function:
    a traced run records and writes its crash files without the judging side."""
    graph = _graph()
    offenders = []
    for m in sorted(graph):
        if m.startswith(RECORDING) or m in SHARED:
            judging = sorted(w for w in _reachable(graph, m) if w.startswith("tracer.analysis"))
            if judging:
                offenders.append(f"{m} -> {judging}")
    assert offenders == []


def test_a_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_subpackages_are_entered_through_their_faces():
    """Outside `tracer/X/`, the tracer imports X's names from `tracer.X`, never `tracer.X._m`."""
    offenders = []
    for m, path in _modules().items():
        for line, module, _ in _imports(path):
            where = _subpackage(module)
            if where is not None and where != _subpackage(m) and module != f"tracer.{where}":
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert offenders == []


def test_subpackages_use_only_the_shared_top_level_modules():
    """capture, storage and analysis build on config, errors and validation; the Dumper and
    attach, which drive all three, are above them."""
    offenders = []
    for m, path in _modules().items():
        if _subpackage(m) is None:
            continue
        for line, module, _ in _imports(path):
            top = module.split(".")
            if module.startswith("tracer._") and len(top) == 2 and module not in SHARED:
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert offenders == []


def _string_lookups(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls like `_api("tracer", ...)` or `import_module("tracer._x")`: imports by string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            first = node.args[0].value
            if isinstance(first, str) and (first == "tracer" or first.startswith("tracer.")):
                found.append((node.lineno, first))
    return found


def test_other_packages_use_only_public_tracer_names():
    offenders = []
    for package in OTHER_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            for line, module, names in _imports(path):
                if module != "tracer" and not module.startswith("tracer."):
                    continue
                private = [p for p in module.split(".") if p.startswith("_")]
                private += [n for n in names if n.startswith("_")]
                if private:
                    offenders.append(f"{rel}:{line}: {module} {names}")
            for line, name in _string_lookups(ast.parse(path.read_text())):
                offenders.append(f"{rel}:{line}: looks up {name!r} by string")
    assert offenders == []


def test_faces_map_to_their_own_modules():
    modules = _modules()
    for sub in SUBPACKAGES:
        package = f"tracer.{sub}"
        for name, where in _exports(package).items():
            assert where in modules and where.startswith(package + "."), (package, name, where)
    for name, where in _exports("tracer").items():
        assert where in SHARED | {"tracer._dumper", "tracer._attach", "sleuth.common"} \
            or where in {f"tracer.{s}" for s in SUBPACKAGES}, (name, where)
        if where.startswith("tracer.") and not where.startswith("tracer._"):
            assert name in _exports(where), (name, where)


def test_reading_and_comparing_import_no_torch():
    """The reader, diff and check run where torch is not installed (the dashboard, CI)."""
    code = ("import sys; from tracer.storage import open_dump, Dump, config_of; "
            "from tracer.analysis import diff, check, first_nan_origin, TABLE_READ_ERRORS, "
            "headroom_trend, record_headroom; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "False"


def test_architecture_lists_every_tracer_module():
    """docs/architecture.md's file list names every module of the tracer, so a newcomer finds
    where a record is made, written, read back and compared in one hop."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(TRACER)) for p in sorted(TRACER.rglob("*.py"))
               if p.name != "__init__.py" and p.name not in text]
    assert missing == []


def _h5_opens(tree: ast.AST) -> list[int]:
    """Lines that open an HDF5 file for reading: `open_h5(...)` or `h5py.File(...)` without a
    writing mode."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        mode = node.args[1] if len(node.args) > 1 else next(
            (k.value for k in node.keywords if k.arg == "mode"), None)
        writes = isinstance(mode, ast.Constant) and mode.value in ("w", "a", "x", "w-", "r+")
        if name == "open_h5" or (name == "File" and isinstance(func, ast.Attribute)
                                 and getattr(func.value, "id", "") == "h5py" and not writes):
            found.append(node.lineno)
    return found


def test_only_storage_reads_step_files():
    """One reader of the step file: outside tracer/storage/ no tracer, dashboard or CLI module
    opens an HDF5 file to read it (the diff reads tensor bytes through storage's TensorReader,
    `dump ls` lists files through storage's file_rows and names damaged ones with its
    damaged_files)."""
    offenders = []
    paths = [p for p in sorted(TRACER.rglob("*.py")) if "storage" not in p.parts]
    paths += sorted((ROOT / "dashboard").rglob("*.py")) + sorted((ROOT / "sleuth").rglob("*.py"))
    for path in paths:
        for line in _h5_opens(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert offenders == []


def test_storage_opens_step_files_only_through_the_checked_opener():
    """Inside tracer/storage/ too, every HDF5 file read is opened by `open_h5` (no link out of
    the file, no claim past its size): the scan and the rank lock read a step file's run id and
    status through it, never through a raw `h5py.File`."""
    offenders = []
    for path in sorted((TRACER / "storage").rglob("*.py")):
        if path.name == "_h5open.py":
            continue
        tree = ast.parse(path.read_text())
        raw = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
               and isinstance(n.func, ast.Attribute) and n.func.attr == "File"]
        offenders += [f"{path.relative_to(ROOT)}:{line}" for line in _h5_opens(tree)
                      if line in raw]
    assert offenders == []


def test_the_tracer_tests_sit_in_folders_like_the_code():
    """docs/architecture.md, "Tests": tests/tracer/<folder>/ for each folder of tracer/, and no
    test of one of them left at the top."""
    tests = ROOT / "tests" / "tracer"
    folders = sorted(p.name for p in (ROOT / "tracer").iterdir()
                     if p.is_dir() and (p / "__init__.py").exists())
    assert folders == ["analysis", "capture", "storage"]
    for folder in folders:
        assert sorted((tests / folder).glob("test_*.py")), f"tests/tracer/{folder}/ has no tests"
    prefixes = ("test_capture_", "test_storage_", "test_check_", "test_diff_", "test_explain")
    stray = [p.name for p in tests.glob("test_*.py") if p.name.startswith(prefixes)]
    assert not stray, f"move these into tests/tracer/<folder>/ beside their code's tests: {stray}"


def test_run_file_names_are_parsed_in_one_place():
    """Step, rank and window numbers in file names are read with the door's strict patterns
    only (sleuth.common._door, which tracer.storage re-exports): a `\\d` elsewhere matches
    Unicode digits and leading zeros, and a file named `step00.h5` or `step٠.h5` then replaces
    step 0 in one reader but not in another. The trainer too: its claim on a run directory
    reads every tool's files, and --overwrite removes them by name."""
    import re

    loose = re.compile(r"(step|rank|window|seg)\(?\\d")
    offenders = []
    for package in ("tracer", "profiler", "dashboard", "sleuth", "irdump", "trainer"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "_door.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and loose.search(node.value):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_shared_rules_import_no_other_package_and_no_torch():
    """sleuth.common sits below every package (docs/architecture.md): it imports none of them,
    and no torch, so the readers that use it run without torch."""
    offenders = []
    for path in sorted((ROOT / "sleuth" / "common").rglob("*.py")):
        for line, module, _ in _imports(path):
            top = module.split(".")[0]
            if top in {*PROJECT, "torch"} and not module.startswith("sleuth.common"):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert offenders == []


def _spelled(value: object) -> str | None:
    """The shared rule a string constant re-spells, if any: the run id's launch variables, or
    the library folders that decide whose line a frame is."""
    if value == "TORCHELASTIC_RUN_ID":
        return "run identity"
    if isinstance(value, str) and value.strip("/\\") in ("site-packages", "dist-packages"):
        return "the user's line"
    return None


def test_run_identity_and_the_users_line_are_spelled_in_one_module():
    """Docs/architecture.md, "One rule, one place": how a process finds its run id and which
    frame is the user's line live in sleuth.common alone; a second copy drifts (a profile
    without the dump's run id, a profile naming another line than the dump for one op)."""
    offenders = []
    for package in PROJECT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(ROOT / "sleuth" / "common"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and _spelled(node.value):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                                     f"{_spelled(node.value)} ({node.value!r})")
    assert offenders == []
