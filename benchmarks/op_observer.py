"""An experiment for the tracer's op level: what op capture in compiled code costs, side by side
with the Python dispatch mode the tracer uses today, on the trainer's tiny preset (where the op
statistics goal, 1.5x, is missed: benchmarks/RESULTS.md).

benchmarks/op_observer.cpp registers a global C++ RecordFunction callback (torch.profiler's
hook) that keeps a row per tensor of each outermost op, with statistics of float32 tensors and
reuse for a tensor seen before unchanged. It is built on first use with
torch.utils.cpp_extension (a C++ compiler and ninja; about a minute). Conditions, each a ratio
to no capture, interleaved in one process, each block bracketed by two baseline blocks:

  dispatch_mode        a TorchDispatchMode that only runs each op (tracer_overhead's
                       floor_dispatch_mode: the least the tracer's op level pays today)
  observer             the C++ callback, rows without statistics
  observer_statistics  the C++ callback with statistics

Not the tracer: the rows lack names, source lines and filters, and nothing is written to disk.
Prints one JSON object. Run: PYTHONPATH=. python3 benchmarks/op_observer.py [--rounds N]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tracer_overhead as bench  # noqa: E402  (the tiny model, the step loop, the floor mode)


def build() -> Any:
    """The compiled observer, or SystemExit with the reason it could not be built."""
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:
        raise SystemExit("op_observer needs ninja (pip install ninja, or apt-get install ninja-build)")
    where = Path(tempfile.gettempdir()) / "sleuth_op_observer_build"
    where.mkdir(exist_ok=True)
    # NDEBUG: RecordFunction's debug-only checks reject inputs() from these callbacks
    return load("sleuth_op_observer", [str(Path(__file__).with_suffix(".cpp"))],
                build_directory=str(where), extra_cflags=["-O3", "-DNDEBUG"], verbose=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=16, help="timed steps per block")
    args = p.parse_args(argv)
    observer = build()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, vocab, seq, batch = bench.make_tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [(torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))
               for _ in range(args.steps + 1)]
    rows_per_step: dict[str, float] = {}

    @contextlib.contextmanager
    def observed(name: str, with_statistics: bool) -> Iterator[None]:
        observer.start(with_statistics)
        try:
            yield
        finally:
            rows_per_step[name] = observer.stop() / len(batches)

    conditions = {
        "dispatch_mode": lambda: bench.floor("floor_dispatch_mode"),
        "observer": lambda: observed("observer", False),
        "observer_statistics": lambda: observed("observer_statistics", True),
    }
    baseline_s: list[float] = []

    def baseline() -> Any:
        block = bench.timed_block(model, opt, batches)
        baseline_s.append(block.median)
        return block

    bench.train_steps(model, opt, batches[:2])  # warm up
    # nothing here is written after the steps: the median ratios are the ones to read
    ratios, _ = bench.bracketed_rounds(args.rounds, baseline, {
        name: functools.partial(bench.timed_block, model, opt, batches, attach)
        for name, attach in conditions.items()})
    print(json.dumps({
        "benchmark": "op_observer", "model": "tiny", "torch_threads": 1,
        "baseline_step_s": round(statistics.median(baseline_s), 4),
        "ratios": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
        "spread": {k: [round(min(v), 3), round(max(v), 3)] for k, v in ratios.items()},
        "rows_per_step": rows_per_step,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
