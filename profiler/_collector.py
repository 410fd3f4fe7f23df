"""Collector: drives torch.profiler with the config's schedule and writes one trace per window.

Training-time work is kept to what cannot wait: the profiler itself, module ranges while
tracing, and per window a gzipped Chrome trace plus a small JSON of metadata. FLOPs are counted
from the window's recorded shapes once it is saved (`profiler._flops`), never by a dispatch mode
during the step, so a profiled step computes the same bits as an unprofiled one. Tables are
built later from the trace (`read_profile`), unless `write_tables=True`. `key_averages()` is
never called (0.4-0.6 s per step).

Profiling never stops the run it observes: a failure of the collector's own work (its folder
cannot be made, a window cannot be written for a full disk or an unwritable folder, the folder
holds another run's profile) turns the profiler off with one `sleuth: ...` warning, and the
training goes on; `SLEUTH_STRICT=1` raises instead. Every tool that observes a run
keeps the same rule (`sleuth.common.go_off`).
"""
from __future__ import annotations

import gzip
import os
import shutil
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from profiler._config import (DEFAULT_PEAK_TFLOPS_CPU, DEFAULT_PEAK_TFLOPS_CUDA, Action,
                              CollectorConfig)
from profiler._errors import ProfilerError
from profiler._io import (FORMAT_VERSION, gzip_atomic, profile_dir, rank_from_env,
                          world_size_from_env, write_json_atomic)
from profiler._kineto import safe_export_path, window_edge
from sleuth.common import SleuthWarning, go_off, inherited_run_id, strict


class Collector:
    """Profile a training loop: `with Collector(run) as c: ... c.step()` once per step.

    Args:
        run_dir: the run directory; files go to `run_dir/profile/rank{R}/`.
        config: a CollectorConfig (default: wait 1, warmup 1, active 3, one window).
        rank: this process's rank (default: $RANK or 0).
        run_id: the run its files belong to (default: the one this process inherits, by the
            rule the dump follows too, `sleuth.common.inherited_run_id`: $SLEUTH_RUN_ID, which
            the trainer and `sleuth run` set, torchrun's rendezvous, the parent of several
            ranks; none for one process started alone); readers refuse to combine windows of
            different runs.

    `step()` must be called once at the end of every training step (after the optimizer).
    Window K produces `window{K}.trace.json.gz` and `window{K}.json` when its last step ends.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, config: CollectorConfig | None = None,
                 rank: int | None = None, run_id: str | None = None) -> None:
        self.config = config if config is not None else CollectorConfig()
        if not isinstance(self.config, CollectorConfig):
            raise ProfilerError(f"config must be a CollectorConfig, got {type(self.config).__name__}")
        self.run_dir = Path(run_dir)
        self.rank = rank_from_env(rank)
        self.run_id = inherited_run_id() if run_id is None else str(run_id)
        self.dir = profile_dir(self.run_dir, self.rank)
        self.traces: list[Path] = []
        self._prof: Any = None
        self._step = 0
        self._t0 = 0.0
        self._step_wall: dict[int, float] = {}
        # where the user's code calls this collector's step(): a `.step()` the source lookup
        # must not take for the optimizer's (`opt.step()` and `collector.step()` in one loop)
        self._own_lines: set[tuple[str, int]] = set()
        self._window = 0
        self._modules: Any = None
        self._closed = False
        self._failed = False

    # ---- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> Collector:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def step_num(self) -> int:
        """Index of the step now running (number of `step()` calls so far)."""
        return self._step

    def start(self) -> None:
        """Create the torch profiler and begin step 0 (no-op when disabled)."""
        if not self.config.enabled or self._prof is not None or self._closed:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        cfg = self.config
        self._cuda = "cuda" in cfg.activities and torch.cuda.is_available()
        activities = []
        if "cpu" in cfg.activities:
            activities.append(ProfilerActivity.CPU)
        if self._cuda:
            activities.append(ProfilerActivity.CUDA)
        if not activities:
            raise ProfilerError("no profiler activity is available: activities=('cuda',) needs "
                                "a CUDA device; add \"cpu\" to activities")
        try:
            _refuse_another_run(self.dir, self.run_id)
            self.dir.mkdir(parents=True, exist_ok=True)
        except (OSError, ProfilerError) as e:
            self._fail(e, f"making {self.dir}")
            self._closed = True
            return
        if cfg.with_modules:
            from profiler._modules import ModuleRanges
            self._modules = ModuleRanges()
        self._prof = profile(
            activities=activities, schedule=self._torch_action,
            on_trace_ready=self._on_trace_ready, record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory, with_stack=cfg.with_stack,
            with_flops=cfg.with_flops)
        with warnings.catch_warnings(), window_edge(_records(cfg.schedule_action(0))):
            warnings.simplefilter("ignore", UserWarning)
            self._prof.start()
        self._begin_step(0)

    def step(self) -> None:
        """End the current step and begin the next; writes a window's trace when one closes."""
        if self._prof is None:
            return
        now = time.perf_counter()
        caller = sys._getframe(1)
        self._own_lines.add((caller.f_code.co_filename, caller.f_lineno))
        action = self.config.schedule_action(self._step)
        if action != "none":
            self._step_wall[self._step] = now - self._t0
        self._step += 1
        nxt = self.config.schedule_action(self._step)
        if self._modules is not None:  # before prof.step(), so the window's last range closes
            if nxt == "none":
                self._modules.remove()
        if nxt != action:  # a window starts or ends: torch's native side prints its lines
            with warnings.catch_warnings(), window_edge(_records(nxt) and not _records(action)):
                # "Profiler clears events at the end of each cycle"
                warnings.simplefilter("ignore", UserWarning)
                self._prof.step()
        else:
            self._prof.step()
        if self._failed:  # a window failed to write: torch's profiler is stopped, the run goes on
            self._off()
            return
        self._begin_step(self._step)

    def close(self) -> None:
        """Stop profiling; a window cut short by the end of training is still written."""
        if self._closed:
            return
        self._closed = True
        if self._prof is None:
            return
        try:
            with warnings.catch_warnings(), window_edge(False):
                warnings.simplefilter("ignore", UserWarning)
                self._prof.stop()
        finally:
            if self._modules is not None:
                self._modules.remove()
            self._prof = None

    def _fail(self, error: BaseException, doing: str) -> None:
        """A failure of the collector's own work (`doing`, e.g. "writing window 0 to DIR"):
        raised as ProfilerError under SLEUTH_STRICT=1; otherwise one `sleuth:` warning, the
        profiler goes off (nothing more is written) and the run goes on."""
        if self._failed and not strict():
            return
        self._failed = True
        go_off(error, tool="profiler", off=f"the profiler is off from step {self._step} on",
               doing=doing, raise_as=ProfilerError, stacklevel=4)

    def _off(self) -> None:
        """Stop torch's profiler after a failure, keeping nothing it still holds."""
        prof, self._prof = self._prof, None
        self._closed = True
        if self._modules is not None:
            self._modules.remove()
        if prof is None:
            return
        try:
            with warnings.catch_warnings(), window_edge(False):
                warnings.simplefilter("ignore")
                prof.stop()  # its trace handler returns at once: the collector has failed
        except Exception:  # noqa: BLE001 - the profiler is off and said so; stopping is best effort
            pass

    # ---- per step --------------------------------------------------------------------------
    def _begin_step(self, step: int) -> None:
        action = self.config.schedule_action(step)
        if self._modules is not None and action != "none":
            self._modules.install()
        self._t0 = time.perf_counter()

    def _torch_action(self, step: int) -> Any:
        from torch.profiler import ProfilerAction
        return _TORCH_ACTIONS(ProfilerAction)[self.config.schedule_action(step)]

    # ---- window output -------------------------------------------------------------------------
    def _on_trace_ready(self, prof: Any) -> None:
        """torch's trace handler: the window's files, or the profiler off when they cannot be
        written (a full disk, an unwritable folder), leaving no partial file behind."""
        if self._failed:
            return
        k = self._window
        try:
            self._save_window(prof)
        except Exception as e:  # noqa: BLE001 - routed through the one switch (_fail)
            for leftover in self.dir.glob(f"*window{k}.*"):
                if leftover.name.endswith((".partial", ".tmp")):
                    leftover.unlink(missing_ok=True)
            self._fail(e, f"writing window {k} to {self.dir}")

    def _save_window(self, prof: Any) -> None:
        cfg = self.config
        recorded = sorted(s for s in self._step_wall if cfg.schedule_action(s).startswith("record"))
        if not recorded:
            # closed right as a window began: its only step never ran, nothing worth a file
            return
        k = self._window
        self._window += 1
        trace = self.dir / f"window{k}.trace.json.gz"
        tmp, elsewhere = safe_export_path(self.dir / f".window{k}.trace.json.tmp")
        try:
            prof.export_chrome_trace(str(tmp))
            flops = self._count_flops(tmp, recorded)
            hashes = self._source_hashes(tmp) if cfg.with_stack else None
            gzip_atomic(tmp, trace)
        finally:
            if elsewhere:
                tmp.unlink(missing_ok=True)
        self.traces.append(trace)
        stacks = None
        if self.config.with_stack:
            stacks = self._export_stacks(prof, k)
        meta = {
            "format_version": FORMAT_VERSION, "kind": "sleuth.profile.window",
            "rank": self.rank, "world_size": world_size_from_env(), "window": k,
            "run_id": self.run_id,
            "created": datetime.now(timezone.utc).isoformat(),
            "trace": trace.name, "stacks": stacks,
            "steps": recorded,
            "step_wall_s": {str(s): self._step_wall[s] for s in recorded},
            "device": "cuda" if self._cuda else "cpu",
            "tokens_per_step": cfg.tokens_per_step,
            "peak_tflops": cfg.peak_tflops or (DEFAULT_PEAK_TFLOPS_CUDA if self._cuda
                                               else DEFAULT_PEAK_TFLOPS_CPU),
            "peak_tflops_source": "config" if cfg.peak_tflops else "default",
            "module_types": dict(self._modules.types) if self._modules is not None else {},
            "module_sources": dict(self._modules.sources) if self._modules is not None else {},
            "module_call_lines": ({k: sorted(v, key=v.get, reverse=True)
                                   for k, v in self._modules.call_lines.items()}
                                  if self._modules is not None else {}),
            "collector_call_lines": sorted({f"{os.path.abspath(f)}:{n}"
                                            for f, n in self._own_lines}),
            "config": cfg.to_dict(), "torch_version": _torch_version(),
            # where the trace's shortened frame paths resolve (source lines, with_stack)
            "python_path": [os.getcwd(), *(p for p in sys.path if isinstance(p, str))],
            # what each cited source file held, so a reader marks lines of an edited file
            **({"source_hashes": hashes} if hashes is not None else {}),
            **flops,
        }
        self._step_wall.clear()
        write_json_atomic(self.dir / f"window{k}.json", meta)
        if cfg.write_tables:
            from profiler._reader import write_window_tables
            write_window_tables(self.dir, k, cfg.table_format)

    def _count_flops(self, trace_path: Path, steps: list[int]) -> dict[str, Any]:
        """FLOPs per step from the saved trace's shapes; {} (no MFU) when they cannot be had."""
        if not self.config.count_flops:
            return {}
        from profiler._flops import count_flops
        from profiler._own import own_work
        from profiler._trace import load_trace

        try:
            with own_work("profiler"):  # its meta-tensor ops are no op of the user's step
                counted = count_flops(load_trace(trace_path), steps)
        except Exception as e:  # noqa: BLE001 - the count is optional; the profile is kept
            warnings.warn(f"profiler: FLOP counting failed ({type(e).__name__}: {e}); MFU not "
                          "reported", SleuthWarning, stacklevel=2)
            return {}
        if not counted:
            warnings.warn("profiler: FLOPs are counted from recorded input shapes; with "
                          "record_shapes=False MFU is not reported", SleuthWarning, stacklevel=2)
        return counted

    def _source_hashes(self, trace_path: Path) -> dict[str, str] | None:
        """The content hash of each user file the window's frames cite (with_stack); None
        when they cannot be had (readers then judge an edited file by its mtime)."""
        from profiler._sources import source_hashes
        try:
            text = trace_path.read_text(encoding="utf-8", errors="replace")
            return source_hashes(text, [os.getcwd(), *(p for p in sys.path
                                                      if isinstance(p, str)), ""])
        except (OSError, ValueError, MemoryError) as e:
            warnings.warn(f"profiler: source files not hashed ({type(e).__name__}: {e}); an "
                          "edited file is judged by its modification time", SleuthWarning,
                          stacklevel=2)
            return None

    def _export_stacks(self, prof: Any, k: int) -> str | None:
        # export_stacks writes an empty file when the profiler kept no stacks
        # (pytorch/pytorch#100253, #89406): keep the file only when it has content.
        path = self.dir / f"window{k}.stacks.txt"
        tmp = self.dir / f".window{k}.stacks.tmp"
        try:
            prof.export_stacks(str(tmp), "self_cuda_time_total" if self._cuda else "self_cpu_time_total")
        except Exception as e:  # noqa: BLE001 - torch raises several types here; the trace is kept
            tmp.unlink(missing_ok=True)
            warnings.warn(f"profiler: no stacks file for window {k} ({type(e).__name__}: {e}); "
                          f"the trace and tables are unaffected", SleuthWarning, stacklevel=2)
            return None
        if not tmp.exists() or tmp.stat().st_size == 0:
            tmp.unlink(missing_ok=True)
            return None
        os.replace(tmp, path)
        return path.name

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """Copy the last saved window's trace to `path` (`.gz` keeps it compressed).

        torch.profiler cannot export again once its trace handler has run and the next cycle
        has reset it; the collector's saved file is the trace, so this copies it.
        """
        if not self.traces:
            raise ProfilerError("no profiled window has been saved yet: call step() through at "
                                "least one complete window (wait + warmup + active steps)")
        src, dest = self.traces[-1], Path(path)
        if dest.name.endswith(".gz"):
            shutil.copyfile(src, dest)
        else:
            with gzip.open(src, "rb") as fin, open(dest, "wb") as fout:
                shutil.copyfileobj(fin, fout)
        return dest


def _refuse_another_run(folder: Path, run_id: str) -> None:
    """ProfilerError when `folder` holds windows of a run other than `run_id`: the new windows,
    numbered from 0, would replace that run's. Each `window{K}.json` is read through the door
    (tracer.storage: a regular file only, within the JSON bounds); one that cannot be read is
    no window's metadata here (the reader names it)."""
    from tracer.storage import load_bounded, numbered

    if not run_id or not folder.is_dir():
        return
    names = numbered(r"window{n}\.json")
    for meta in sorted(p for p in folder.iterdir() if names.fullmatch(p.name)):
        try:
            other = load_bounded(meta, max_bytes=1 << 20)
        except Exception:  # noqa: BLE001 - unreadable: not a window's metadata to refuse by
            continue
        other = other.get("run_id") if isinstance(other, dict) else None
        if isinstance(other, str) and other and other != run_id:
            raise ProfilerError(f"{folder} holds the profile of another run (run {other}, "
                                f"{meta.name}), which this run's windows would replace; "
                                f"profile into another run directory, or remove that profile")


def _TORCH_ACTIONS(ProfilerAction: Any) -> dict[Action, Any]:
    return {"none": ProfilerAction.NONE, "warmup": ProfilerAction.WARMUP,
            "record": ProfilerAction.RECORD, "record_and_save": ProfilerAction.RECORD_AND_SAVE}


def _records(action: Action) -> bool:
    return action.startswith("record")


def _torch_version() -> str:
    import torch
    return torch.__version__
