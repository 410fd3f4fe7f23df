"""What the writer's part of one statistics record costs inside a training step, for the sync
and the async writer, side by side in one process.

A record's Python runs on the caches the model's ops have just cooled, so it costs 2-3x what
the same code costs in a loop; only a measurement inside real steps says what a change to the
per-record path is worth. This wraps `Writer.add` of both writers in a timer and trains the
trainer's tiny preset (module level, statistics mode) in alternating blocks, one writer a
block, each block in a Dumper of its own. Information only: no goal is set on the tiny
preset (benchmarks/RESULTS.md).

Prints one JSON object: for each writer the median microseconds a record over the blocks, the
records a step, and what they add up to against the median step time of the blocks (the
writer's share of a dumped step).
Run: PYTHONPATH=. python3 benchmarks/record_cost.py [--rounds N] [--steps S]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tracer_overhead as bench  # noqa: E402  (the tiny model)

import tracer  # noqa: E402
from tracer.storage import _async, _writer  # noqa: E402


class AddTimer:
    """Wraps `add` of both writer classes; `ns` and `calls` accumulate until `reset()`."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0
        self._saved: list[tuple[type, Any]] = []

    def __enter__(self) -> AddTimer:
        clock = time.perf_counter_ns
        for cls in (_writer.SyncWriter, _async.AsyncWriter):
            real = cls.add

            def timed(*args: Any, _real: Any = real, **kwargs: Any) -> None:
                start = clock()
                try:
                    _real(*args, **kwargs)
                finally:
                    self.ns += clock() - start
                    self.calls += 1

            self._saved.append((cls, real))
            cls.add = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, real in self._saved:
            cls.add = real  # type: ignore[method-assign]
        self._saved = []

    def reset(self) -> None:
        self.ns = self.calls = 0


def measure(rounds: int, steps: int, work: Path) -> dict:
    torch.manual_seed(0)
    model, vocab, seq, batch = bench.make_tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [(torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))
               for _ in range(steps + 1)]
    bench.train_steps(model, opt, batches[:2])  # warm up kernels and the optimizer state
    per_record: dict[str, list[float]] = {}
    share: dict[str, list[float]] = {}
    records = 0
    with AddTimer() as timer:
        for r in range(rounds):
            for writer in ("sync", "async"):
                path = work / f"{writer}{r}"
                with tracer.Dumper(model, {"level": "module", "mode": "statistics",
                                           "writer": writer, "path": str(path)}):
                    bench.train_steps(model, opt, batches[:1])  # opens the writer
                    timer.reset()
                    start = time.perf_counter_ns()
                    bench.train_steps(model, opt, batches[1:])
                    elapsed = time.perf_counter_ns() - start
                    per_record.setdefault(writer, []).append(
                        timer.ns / max(1, timer.calls) / 1e3)
                    share.setdefault(writer, []).append(timer.ns / elapsed)
                    records = timer.calls // steps
                shutil.rmtree(path, ignore_errors=True)
    out: dict[str, Any] = {"records_per_step": records}
    for writer in ("sync", "async"):
        out[writer] = {"us_per_record": round(statistics.median(per_record[writer]), 2),
                       "share_of_step": round(statistics.median(share[writer]), 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed steps a block")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not tracer.storage._stats.kernel_available():
        print(json.dumps({"benchmark": "record_cost", "skipped": "the C kernel is not built"}))
        return 0
    work = Path(tempfile.mkdtemp(prefix="sleuth_record_cost_"))
    try:
        result = measure(args.rounds, args.steps, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"benchmark": "record_cost", "model": "tiny", "level": "module",
                      "mode": "statistics", "torch_threads": torch.get_num_threads(),
                      **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
