"""Host microseconds a record: what the tracer's Python costs per record, on a model of many small
layers whose statistics cost next to nothing (so on CPU the figure is what a GPU step pays while
the device waits for the host).

The model is `--layers` blocks of Linear(16, 16) and ReLU on a batch of 4 (an SGD step); blocks
of `--steps` steps with a Dumper (statistics mode, sync writer, sketches on) alternate with blocks
without, per level (module, op), round by round. The figure is (median dumped step - median
plain step) / records a step, with the median over rounds; `us_per_record` therefore includes
the hooks (and at op level the dispatch mode), the writer's record and the statistics of tiny
tensors. `--device cuda` trains on the GPU (each step synchronized), where records take the
batched path (tracer.storage._batcher).

Prints one JSON object. Run: PYTHONPATH=. python3 benchmarks/record_host_cost.py [--rounds N]
[--steps N] [--layers N] [--levels module,op] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

import tracer


def make_model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.ReLU())])


def _steps(model, opt, x, steps: int, sync) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
    return times


def measure(rounds: int, steps: int, layers: int, levels: list[str], device: str,
            work: Path) -> dict:
    model = make_model(layers).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    _steps(model, opt, x, 3, sync)  # warm
    out: dict = {}
    for level in levels:
        per_record, records = [], 0
        for r in range(rounds):
            plain = statistics.median(_steps(model, opt, x, steps, sync))
            path = work / f"{level}{r}"
            counted: list[int] = []
            with tracer.Dumper(model, {"level": level, "mode": "statistics", "writer": "sync",
                                       "path": str(path)}) as dumper:
                _steps(model, opt, x, 1, sync)  # opens the writer
                first = dumper._writer.next_seq if dumper._writer is not None else 0
                dumped = statistics.median(_steps(model, opt, x, steps, sync))
                counted.append(first)
            shutil.rmtree(path, ignore_errors=True)
            records = max(records, counted[0])
            plain = (plain + statistics.median(_steps(model, opt, x, steps, sync))) / 2
            per_record.append((dumped - plain) / max(1, records) * 1e6)
        out[level] = {"records_per_step": records,
                      "us_per_record": round(statistics.median(per_record), 2),
                      "spread": [round(min(per_record), 2), round(max(per_record), 2)]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps a block")
    ap.add_argument("--layers", type=int, default=64, help="Linear + ReLU blocks")
    ap.add_argument("--levels", default="module,op")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
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
    work = Path(tempfile.mkdtemp(prefix="sleuth_record_host_cost_"))
    try:
        result = measure(args.rounds, args.steps, args.layers, levels, args.device, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"benchmark": "record_host_cost", "device": args.device,
                      "layers": args.layers, "torch_threads": torch.get_num_threads(),
                      "rounds": args.rounds, "steps_per_block": args.steps, **result},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
