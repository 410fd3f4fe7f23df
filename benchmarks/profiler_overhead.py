"""Overhead of profiler.Collector against raw torch.profiler with the same options, and of both
against no profiler, measured side by side (variants interleaved, rounds rotated) in one process.

Each variant runs one profiling cycle (wait 1, warmup 1, active 3) of a small GPT-like model and
writes its trace; we report the median over rounds of (a) the mean time of the recorded steps
(the hot path) and (b) the whole cycle including the trace export. Prints one JSON object.

    python3 benchmarks/profiler_overhead.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import profiler  # noqa: E402

WAIT, WARMUP, ACTIVE = 1, 1, 3
STEPS = WAIT + WARMUP + ACTIVE + 1


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _loop(model, opt, x, step_fn) -> tuple[list[float], float]:
    times = []
    t_start = time.perf_counter()
    for _ in range(STEPS):
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        step_fn()
    return times, time.perf_counter() - t_start


def run_variant(name: str, model, opt, x, out: Path) -> tuple[float, float]:
    active = slice(WAIT + WARMUP, WAIT + WARMUP + ACTIVE)
    if name == "none":
        times, total = _loop(model, opt, x, lambda: None)
    elif name == "raw":
        out.mkdir(parents=True, exist_ok=True)
        from torch.profiler import ProfilerActivity, profile, schedule
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True,
                       schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
                       on_trace_ready=lambda p: p.export_chrome_trace(str(out / "raw.json.gz")))
        with prof:
            times, total = _loop(model, opt, x, prof.step)
    else:
        cfg = dict(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1, activities=("cpu",),
                   record_shapes=True, profile_memory=True)
        if name == "collector_same_options":
            cfg.update(with_modules=False, count_flops=False)
        if name == "collector_tables":
            cfg.update(write_tables=True)
        with profiler.Collector(out, config=profiler.CollectorConfig(**cfg)) as c:
            times, total = _loop(model, opt, x, c.step)
    return statistics.mean(times[active]), total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (8, 64))
    variants = ["none", "raw", "collector_same_options", "collector", "collector_tables"]
    step: dict[str, list[float]] = {v: [] for v in variants}
    cycle: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:  # warm every path once (first profiler start-up, flop counter)
            run_variant(v, model, opt, x, Path(tmp) / f"warm_{v}")
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                s, c = run_variant(v, model, opt, x, Path(tmp) / f"r{r}_{v}")
                step[v].append(s)
                cycle[v].append(c)
        read_t = time.perf_counter()
        profiler.read_profile(Path(tmp) / f"r0_collector")
        read_s = time.perf_counter() - read_t
    med_step = {v: statistics.median(step[v]) for v in variants}
    med_cycle = {v: statistics.median(cycle[v]) for v in variants}
    result = {
        "benchmark": "profiler_overhead",
        "model": "GPT d128 x4 layers, batch 8x64, CPU, 1 thread",
        "rounds": args.rounds, "cycle": f"wait {WAIT}, warmup {WARMUP}, active {ACTIVE}",
        "recorded_step_s": med_step, "cycle_s": med_cycle,
        "ratio_recorded_step": {
            "collector_same_options_vs_raw": med_step["collector_same_options"] / med_step["raw"],
            "collector_vs_raw": med_step["collector"] / med_step["raw"],
            "raw_vs_none": med_step["raw"] / med_step["none"],
            "collector_vs_none": med_step["collector"] / med_step["none"]},
        "ratio_cycle": {
            "collector_same_options_vs_raw": med_cycle["collector_same_options"] / med_cycle["raw"],
            "collector_vs_raw": med_cycle["collector"] / med_cycle["raw"],
            "collector_tables_vs_collector": med_cycle["collector_tables"] / med_cycle["collector"],
            "raw_vs_none": med_cycle["raw"] / med_cycle["none"],
            "collector_vs_none": med_cycle["collector"] / med_cycle["none"]},
        "read_profile_s": read_s,
        "goal": "collector_same_options_vs_raw <= 1.05",
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
