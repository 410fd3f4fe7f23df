"""Dump writer throughput: the async (and sync) writer against a raw write of the same bytes.

Each round writes STEPS step files of RECORDS float32 tensors (mode "tensor": bytes plus the
statistics the format always fills) three ways, interleaved in one process so the machine's
state is shared: `raw` (plain `os.write` of every tensor's bytes into one file per step, then
fsync and rename: the floor any writer pays), `sync` and `async` (tracer writers, from the
first `begin_step` until `close()` returned: everything on disk), and `raw_plus_stats` (raw
plus the format's statistics of each tensor, serially). It also times the async hot path alone
(until the last `end_step` returned) and the per-record cost of statistics-only dumping of
small tensors (after one untimed step: the async writer starts its file-writer process once). Prints ONE JSON object; ratios are throughput ratios (>1 = faster
than the reference).

    python3 benchmarks/tracer_writer.py [--mib-per-step 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tracer._config import DumpConfig  # noqa: E402
from tracer.storage._stats import host_stats  # noqa: E402
from tracer.storage import RecordMeta, make_writer  # noqa: E402


def meta(i: int) -> RecordMeta:
    return RecordMeta(f"layers.{i}.forward.0.output.0", f"layers.{i}", "", "forward", "output",
                      0, 0, "bench.py:1")


def raw_write(root: Path, tensors: list[torch.Tensor], steps: int, stats: bool = False) -> float:
    start = time.perf_counter()
    for step in range(steps):
        final = root / f"step{step}.bin"
        part = root / f"step{step}.bin.partial"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in tensors:
                if stats:
                    host_stats(t, blocks_per_op=1)
                os.write(fd, memoryview(t.numpy()).cast("B"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(part, final)
    return time.perf_counter() - start


def tracer_write(root: Path, tensors: list[torch.Tensor], steps: int, writer: str,
                 mode: str = "tensor", warm: bool = False) -> tuple[float, float]:
    w = make_writer(DumpConfig(path=str(root), writer=writer, mode=mode), rank=0, world_size=1)
    if warm:  # one untimed step first: the async writer's file-writer process starts once a run
        w.begin_step(10_000)
        w.add(meta(0), tensors[0])
        w.end_step()
        w.flush()
    start = time.perf_counter()
    for step in range(steps):
        w.begin_step(step)
        for i, t in enumerate(tensors):
            w.add(meta(i), t)
        w.end_step()
    hot = time.perf_counter() - start
    w.close()
    return time.perf_counter() - start, hot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib-per-step", type=int, default=64)
    ap.add_argument("--tensor-kib", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small-records", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: leave torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n = args.tensor_kib * 256
    tensors = [torch.randn(n, generator=g) for _ in range(args.mib_per_step * 1024
                                                          // args.tensor_kib)]
    mib = len(tensors) * n * 4 / 2**20 * args.steps
    times: dict[str, list[float]] = {"raw": [], "raw_stats": [], "sync": [], "async": [],
                                     "async_hot": []}
    small = [torch.randn(4096, generator=g) for _ in range(args.small_records)]
    per_rec: dict[str, list[float]] = {"sync": [], "async": []}
    base = Path(tempfile.mkdtemp(prefix="sleuth-bench-"))
    try:
        for r in range(args.rounds):
            order = ("raw", "async", "raw_stats", "sync")
            for kind in order if r % 2 == 0 else order[::-1]:
                root = base / f"{kind}{r}"
                root.mkdir()
                if kind.startswith("raw"):
                    times[kind].append(raw_write(root, tensors, args.steps,
                                                 stats=kind == "raw_stats"))
                else:
                    total, hot = tracer_write(root, tensors, args.steps, kind)
                    times[kind].append(total)
                    if kind == "async":
                        times["async_hot"].append(hot)
                shutil.rmtree(root)
                # untimed: the removal's metadata and anything else dirty reach the disk now,
                # not during the next condition's fsync
                if hasattr(os, "sync"):
                    os.sync()
            for kind in ("sync", "async"):
                root = base / f"small-{kind}{r}"
                total, _ = tracer_write(root, small, 1, kind, mode="statistics", warm=True)
                per_rec[kind].append(total / len(small) * 1e6)
                shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "benchmark": "tracer_writer",
        "mib_written": round(mib, 1),
        "tensor_kib": args.tensor_kib,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "raw_mib_s": round(mib / med["raw"], 1),
        "async_mib_s": round(mib / med["async"], 1),
        "sync_mib_s": round(mib / med["sync"], 1),
        "async_vs_raw_throughput": round(med["raw"] / med["async"], 3),
        "sync_vs_raw_throughput": round(med["raw"] / med["sync"], 3),
        "async_hot_path_vs_raw": round(med["raw"] / med["async_hot"], 3),
        "raw_plus_stats_mib_s": round(mib / med["raw_stats"], 1),
        "async_vs_raw_plus_stats_throughput": round(med["raw_stats"] / med["async"], 3),
        "goal_async_vs_raw": 0.7,
        "small_stats_only_us_per_record": {k: round(statistics.median(v), 1)
                                           for k, v in per_rec.items()},
        "note": "mode tensor (bytes + statistics); raw = os.write + fsync + rename of the "
                "same bytes; raw_plus_stats = the same plus host_stats per tensor in one thread "
                "(the least work any writer filling the format does); medians over "
                "interleaved rounds",
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
