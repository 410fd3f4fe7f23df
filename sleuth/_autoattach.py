"""Start-up hook behind `sleuth_autoattach.pth`: attaches the tools a SLEUTH_* variable asks for.

Python runs the .pth line in every process of the environment, so the common case (no variable
set) must cost a dictionary look-up and nothing else. When a variable is set, the tools are not
imported at start-up either: importing torch there would slow every Python process (pip
included) and could run before the user's own environment set-up. Instead a meta-path finder
waits for the script's own `import torch` and attaches right after torch has loaded, so the
script, `torchrun` workers included, is traced without a line changed.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

# variable -> (package, function); each function returns a handle or None.
_TOOLS = {
    "SLEUTH_DUMP_CONFIG": ("tracer", "attach_from_env"),
    "SLEUTH_PROFILE": ("profiler", "attach_from_env"),
    "SLEUTH_SUMMARY": ("profiler", "attach_from_env"),
    "SLEUTH_SAVE_GRAPHS": ("irdump", "attach_from_env"),
}
_REFERENCE = "SLEUTH_REFERENCE"  # compared with the dump: no tool of its own
_handles: list[object] = []
_claimed: list[str] = []  # run.json this process linked into place, then the folders it made


def requested() -> list[tuple[str, str]]:
    """The (package, function) pairs the environment asks for, without duplicates."""
    wanted = []
    for var, tool in _TOOLS.items():
        if os.environ.get(var, "").strip() not in ("", "0") and tool not in wanted:
            wanted.append(tool)
    return wanted


def attach() -> None:
    """Attach every requested tool now (torch must be importable)."""
    import importlib

    from sleuth.common import go_off, strict, warn

    try:
        refusal = _another_runs_folder()
    except Exception as e:  # reading the folder failed: the tools' own checks still run
        refusal = None
        warn(f"could not read the run directory ({type(e).__name__}: {e})", stacklevel=2)
    if refusal:
        if strict():
            _stop(refusal)
        warn(f"{refusal}; the tools are off for this run, which goes on (SLEUTH_STRICT=1 stops "
             "it instead)", stacklevel=2)
        return
    for package, function in requested():
        try:
            module = importlib.import_module(package)
            # the dump's live reference ($SLEUTH_REFERENCE) is made here, above the tracer:
            # the Dumper compares through the diff, which the recording side never imports
            extra = (module.LiveReference.from_env(),) if package == "tracer" else ()
            handle = getattr(module, function)(*extra)
        except Exception as e:  # a broken config must not kill the user's run silently or loudly
            if strict():
                _stop(f"could not attach {package} ({type(e).__name__}: {e})")
            go_off(e, tool=package, off=f"{package} is off for this run", doing="attaching it",
                   raises=False, stacklevel=2)
            continue
        if handle is not None:
            _handles.append(handle)
    if not _handles:  # every tool went off: the folder is left as it was found
        _release_claim()


def _stop(message: str) -> None:
    """SLEUTH_STRICT=1: stop the run before its first line after `import torch`, with one line
    and exit 2, as `sleuth train` stops; an exception here would print a traceback through the
    user's `import torch`, which is no fault of theirs."""
    print(f"sleuth: {message} (SLEUTH_STRICT=1: the run stops here)", file=sys.stderr,
          flush=True)
    raise SystemExit(2)


def _another_runs_folder() -> str | None:
    """Why the tools must not write into $SLEUTH_RUN_DIR, or None.

    Every tool of this process writes one run: the id `sleuth.common.resolve_run_id` gives
    (the caller's $SLEUTH_RUN_ID, torchrun's, or a new one), set in the environment here so the
    dump, the profile and the summary all carry it. A run directory that holds files of another
    run (a trainer run, another script's dump, profile or graphs) is refused before anything is
    written there, as `sleuth run` and `sleuth train` refuse it: the dump's own check covers only
    the dump, and the profiler and the IR exporter would replace that run's files.
    $SLEUTH_DUMP_OVERWRITE=1 (`--overwrite`) lets the tools replace them."""
    from sleuth.common import RUN_ID_ENV, resolve_run_id

    run_id = resolve_run_id()
    os.environ[RUN_ID_ENV] = run_id
    run_dir = os.environ.get("SLEUTH_RUN_DIR", "").strip()
    if not run_dir or os.environ.get("SLEUTH_DUMP_OVERWRITE", "").strip() == "1":
        return None
    from trainer import OtherRunError, claim_run_dir

    fixes = ("write this run to a new SLEUTH_RUN_DIR, set SLEUTH_RUN_ID=<that run's id> to "
             "continue it, or set SLEUTH_DUMP_OVERWRITE=1 to replace it")
    try:
        found = claim_run_dir(run_dir, run_id, fixes=fixes,
                              damaged_fixes="write this run to a new SLEUTH_RUN_DIR, or set "
                              "SLEUTH_DUMP_OVERWRITE=1 to replace that run's files")
        if found.empty and not found.live_lock:  # a new folder: claimed before any tool writes
            _claim_with_run_json(found.run_dir, run_id, fixes)
    except OtherRunError as e:  # the refusal `sleuth run` and `sleuth train` give, its fixes ours
        return str(e)
    return None


def _claim_with_run_json(run_dir: os.PathLike[str], run_id: str, fixes: str) -> None:
    """Claim a folder no run.json claims yet by linking this run's run.json into place, as
    `sleuth run` and `sleuth train` do: of two scripts that both found the folder free (each
    checked before the other wrote a file), the one whose link fails is refused, unless the
    run.json it lost to names its own run (another rank of it). Raises OtherRunError."""
    from sleuth.common import read_run_id
    from trainer import OtherRunError, write_run_json

    made, folder = [], os.path.abspath(run_dir)
    while not os.path.exists(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    try:
        world = os.environ.get("WORLD_SIZE", "").strip()
        write_run_json(run_dir, name=os.path.basename(run_dir), argv=sys.argv,
                       world_size=int(world) if world.isdigit() else 1,
                       config={"attached": {v: os.environ[v] for v in _TOOLS if v in os.environ}},
                       run_id=run_id, exclusive=True)
    except OtherRunError:
        other = read_run_id(run_dir)
        if other != run_id:
            raise OtherRunError(f"{run_dir} holds the files of another run (run {other}: "
                                f"run.json), started into it at the same time as this one; "
                                f"{fixes}") from None
        return
    _claimed[:] = [os.path.join(run_dir, "run.json"), *made]


def _release_claim() -> None:
    """Remove the run.json `_claim_with_run_json` linked into place, and the folders it made
    for it while they are empty: no tool attached, so no run was written there."""
    if not _claimed:
        return
    record, *made = _claimed
    _claimed.clear()
    try:
        os.unlink(record)
        for folder in made:
            os.rmdir(folder)
    except OSError:  # another rank's file, or a user's, is there now: the rest stays
        pass


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps torch's loader so `attach()` runs once torch is loaded."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            attach()

        spec.loader.exec_module = exec_module
        return spec


def _install() -> None:
    if not requested():
        if os.environ.get(_REFERENCE, "").strip() not in ("", "0"):
            from sleuth.common import warn

            warn(f"${_REFERENCE} is set but no dump is, so nothing is compared with it: set "
                 f"SLEUTH_DUMP_CONFIG too (sleuth run --dump CONFIG --reference RUN)")
        return
    if "torch" in sys.modules:
        attach()
    else:
        sys.meta_path.insert(0, _AfterTorchImport())


_install()
