"""Host microseconds a record: what the tracer's Python costs per record, on a model of many small
layers whose statistics cost next to nothing (so on CPU the figure is what a GPU step pays while
the device waits for the host).

The model is `--layers` blocks of Linear(16, 16) and ReLU on a batch of 4 (an SGD step); blocks
of `--steps` steps with a Dumper (statistics mode, sync writer, sketches on) alternate with blocks
without, per level (module, op), round by round. The figure is (median dumped step - median
plain step) / records a step, with the median over rounds; `us_per_record` therefore includes
the hooks (and at op level the dispatch mode), the writer's record and the statistics of tiny
tensors. `--device cuda` trains on the GPU (each step synchronized), where records take the
batched path (tracer.storage._batcher) when `SLEUTH_BATCHED_STATS=1`.

Where the time goes (`split`, from one more dumped block a round, with timers around the sync
writer's `add` and `end_step`, medians over rounds): `writer_add` (the writer's part of a
record: plan, statistics, row), `step_file` (the step file written at the step's end, spread
over its records), and `capture` (the rest: the hooks or the dispatch mode, naming, the source
line, the Dumper's hand-over; the timers' own ~0.2 us a record land here too).

`batch_add` (levels aside): host microseconds a record of the batched path's own bookkeeping,
`Deferred.add` and its flush, over 512 small CPU tensors a batch with the kernel launch left
out (on CPU the launch runs in Triton's interpreter, which says nothing about a GPU) and a plan
that reuses nothing: what a CUDA record adds to `writer_add` before its launch.

`--profile` adds `profile_percent` and `profile_functions`: per level, each source file's and
each function's share of the host time of a dumped block under cProfile (thread CPU time), to
say where the next microsecond is.

Prints one JSON object. Run: python3 benchmarks/record_host_cost.py [--rounds N]
[--steps N] [--layers N] [--levels module,op] [--device cpu|cuda] [--clock wall|cpu]
[--profile]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "tracer" / "__init__.py").is_file():  # run from a checkout: measure its code
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402 - after the checkout is on the path
import torch.nn as nn  # noqa: E402

import tracer  # noqa: E402
from tracer.storage import _batched_stats, _batcher, _writer  # noqa: E402


_clock, _clock_ns = time.perf_counter, time.perf_counter_ns


def make_model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.ReLU())])


def _steps(model, opt, x, steps: int, sync) -> list[float]:
    times = []
    for _ in range(steps):
        start = _clock()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(_clock() - start)
    return times


class Timers:
    """Nanoseconds inside the sync writer's `add` and `end_step` while entered (class-level
    wrappers: a Dumper opened inside binds them)."""

    def __init__(self) -> None:
        self.ns = {"add": 0, "end_step": 0}

    def __enter__(self) -> Timers:
        clock = _clock_ns
        self._saved = {name: getattr(_writer.SyncWriter, name) for name in self.ns}
        for name, real in self._saved.items():
            def timed(*args, _real=real, _name=name, **kwargs):
                start = clock()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.ns[_name] += clock() - start
            setattr(_writer.SyncWriter, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(_writer.SyncWriter, name, real)


def _dumped(model, opt, x, steps: int, sync, level: str, path: Path, timers: Timers | None
            ) -> tuple[float, int, dict]:
    """(median dumped step, records a step, {part: ns a step}) of one block in a Dumper of
    its own; the parts only with `timers`."""
    with contextlib.ExitStack() as stack:
        if timers is not None:
            stack.enter_context(timers)
        with tracer.Dumper(model, {"level": level, "mode": "statistics", "writer": "sync",
                                   "path": str(path)}) as dumper:
            _steps(model, opt, x, 1, sync)  # opens the writer
            records = dumper._writer.next_seq if dumper._writer is not None else 0
            if timers is not None:
                timers.ns = dict.fromkeys(timers.ns, 0)
            times = _steps(model, opt, x, steps, sync)
            parts = {k: v / steps for k, v in timers.ns.items()} if timers is not None else {}
    shutil.rmtree(path, ignore_errors=True)
    return statistics.median(times), records, parts


def profile_shares(model, opt, x, steps: int, sync, level: str, path: Path
                   ) -> tuple[dict, dict]:
    """Where a dumped step's host time goes, under cProfile (thread CPU time) over `steps`
    dumped steps: ({source file: percent}, {function: percent}), each the self time in percent
    of the profile, largest first (the top 12 files and the top 20 functions; C functions and
    torch's kernels are "~", a function is "file:line(name)"). The profiler's own cost
    inflates small Python functions, so this says where to look, not what each costs."""
    import cProfile
    import pstats

    root = str(Path(tracer.__file__).resolve().parents[1]) + os.sep
    site = os.sep + "site-packages" + os.sep
    stdlib = os.path.dirname(os.__file__) + os.sep
    with tracer.Dumper(model, {"level": level, "mode": "statistics", "writer": "sync",
                               "path": str(path)}):
        _steps(model, opt, x, 1, sync)
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        _steps(model, opt, x, steps, sync)
        prof.disable()
    shutil.rmtree(path, ignore_errors=True)
    by_file: dict[str, float] = {}
    by_function: dict[str, float] = {}
    for (where, line, function), row in pstats.Stats(prof).stats.items():  # type: ignore
        name = where.replace(root, "")
        if site in name:
            name = name.rpartition(site)[2]
        elif name.startswith(stdlib):
            name = "python/" + name[len(stdlib):]
        by_file[name] = by_file.get(name, 0.0) + row[2]
        key = f"~({function})" if name == "~" else f"{name}:{line}({function})"
        by_function[key] = by_function.get(key, 0.0) + row[2]
    total = sum(by_file.values()) or 1.0

    def top(times: dict[str, float], n: int) -> dict[str, float]:
        return {k: round(100 * t / total, 1) for k, t in sorted(times.items(),
                                                                 key=lambda kv: -kv[1])[:n]}

    return top(by_file, 12), top(by_function, 20)


def batch_add_us(rounds: int) -> float:
    """Host us a record of `Deferred.add` and its flush, the launch left out (see the module
    docstring); median over rounds of 8 batches."""
    tensors = [torch.randn(4, 16) for _ in range(384)] + [torch.randn(16, 16).t()
                                                          for _ in range(128)]
    saved = _batched_stats.launch

    def host_side(table, device, sketch):  # a list of descriptors in a tree without `Table`
        return table.grouped() if hasattr(table, "grouped") else _batched_stats.table(table)

    _batched_stats.launch = host_side
    deferred = _batcher.Deferred(True)
    deferred.device_type, deferred._usable = "cpu", True

    def plan(t, stable, version):
        return None, None, False

    out = []
    try:
        for _ in range(rounds):
            start = _clock_ns()
            for _ in range(8):
                for seq, t in enumerate(tensors):
                    deferred.add(plan, seq, None, t, True, None)
            out.append((_clock_ns() - start) / (8 * len(tensors)) / 1e3)
    finally:
        _batched_stats.launch = saved
    return round(statistics.median(out), 2)


def measure(rounds: int, steps: int, layers: int, levels: list[str], device: str,
            work: Path, profile: bool = False) -> dict:
    model = make_model(layers).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    _steps(model, opt, x, 3, sync)  # warm
    out: dict = {}
    timers = Timers()
    for level in levels:
        per_record, records = [], 0
        split: dict[str, list[float]] = {"capture": [], "writer_add": [], "step_file": []}
        for r in range(rounds):
            plain = statistics.median(_steps(model, opt, x, steps, sync))
            dumped, records, _ = _dumped(model, opt, x, steps, sync, level, work / f"{level}{r}",
                                         None)
            timed, _, parts = _dumped(model, opt, x, steps, sync, level, work / f"t{level}{r}",
                                      timers)
            plain = (plain + statistics.median(_steps(model, opt, x, steps, sync))) / 2
            n = max(1, records)
            per_record.append((dumped - plain) / n * 1e6)
            add, end = parts["add"] / 1e3 / n, parts["end_step"] / 1e3 / n
            split["writer_add"].append(add)
            split["step_file"].append(end)
            split["capture"].append((timed - plain) / n * 1e6 - add - end)
        out[level] = {"records_per_step": records,
                      "us_per_record": round(statistics.median(per_record), 2),
                      "spread": [round(min(per_record), 2), round(max(per_record), 2)],
                      "split": {k: round(statistics.median(v), 2) for k, v in split.items()}}
    out["batch_add_us"] = batch_add_us(max(3, rounds))
    if profile:
        shares = {level: profile_shares(model, opt, x, steps, sync, level, work / f"p{level}")
                  for level in levels}
        out["profile_percent"] = {level: files for level, (files, _) in shares.items()}
        out["profile_functions"] = {level: functions for level, (_, functions) in shares.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps a block")
    ap.add_argument("--layers", type=int, default=64, help="Linear + ReLU blocks")
    ap.add_argument("--levels", default="module,op")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--profile", action="store_true",
                    help="add profile_percent and profile_functions: each source file's and "
                         "each function's share of a dumped step's host time under cProfile, "
                         "per level")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the thread's CPU time, which a machine busy with other work "
                         "inflates far less; it leaves out waits (the step file's fsync)")
    args = ap.parse_args(argv)
    levels = args.levels.split(",")
    if set(levels) - {"module", "op"}:
        ap.error(f"--levels: choose from module, op (got {args.levels})")
    if args.rounds < 1 or args.steps < 1 or args.layers < 1:
        ap.error("--rounds, --steps and --layers must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        global _clock, _clock_ns
        _clock, _clock_ns = time.thread_time, time.thread_time_ns
    work = Path(tempfile.mkdtemp(prefix="sleuth_record_host_cost_"))
    try:
        result = measure(args.rounds, args.steps, args.layers, levels, args.device, work,
                         args.profile)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"benchmark": "record_host_cost", "device": args.device,
                      "layers": args.layers, "torch_threads": torch.get_num_threads(),
                      "rounds": args.rounds, "steps_per_block": args.steps,
                      "clock": args.clock, **result},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
