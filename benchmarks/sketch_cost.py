"""Sketches in statistics dumps (tracer/storage/_sketch.py): what they cost, and how well the
sampled elements estimate the metrics of the whole tensors.

Cost: blocks of training steps under a statistics dump with sketches (as shipped) are timed
against blocks with `"sketch": false`, each between two reference blocks, on the workloads of
benchmarks/tracer_ablation.py (gpt, and the Hugging Face Llama), at module and op level, side by
side in one process; `cost_pct` is 100 * (median over rounds of time with / time without - 1)
(goal: at most 5).

Accuracy: two tensor dumps of the gpt model, B's weights perturbed by relative noise `--noise`
(a run that drifted), are compared record by record exactly (`compare_arrays` over the whole
tensors) and from the sketches the same tensors give (`from_array`, what a statistics dump
stores); reported: the absolute error of the estimated cosine and the ratio of the estimated
relative error (rmse / rms) to the exact one, their median and 95th percentile over records.

Prints one JSON object. Run: PYTHONPATH=. python3 benchmarks/sketch_cost.py [--rounds N]
[--steps N] [--workloads gpt,llama]
"""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tracer_ablation as ablation  # noqa: E402  (its workloads, arms and bracketing)
import tracer_overhead as overhead  # noqa: E402

import tracer  # noqa: E402
from tracer.analysis._compare import Tolerance, compare_arrays, compare_sketch  # noqa: E402
from tracer.storage import open_dump  # noqa: E402
from tracer.storage._sketch import from_array  # noqa: E402

CONDITIONS = ("module_statistics", "op_statistics")
ablation.ARMS["no_sketch"] = (frozenset(), {"sketch": False})
GOAL_PCT = 5.0


def cost(workloads: list[str], rounds: int, steps: int, work: Path) -> dict[str, Any]:
    """condition -> workload -> {cost_pct, spread} of sketches against none."""
    ratios: dict[tuple[str, str], list[float]] = {}
    loaded = {w: ablation.make_workload(w, steps) for w in workloads}
    for model, opt, batches in loaded.values():
        overhead.train_steps(model, opt, batches[:2])  # kernels and optimizer state warm
    for r in range(rounds):
        for w, (model, opt, batches) in loaded.items():
            for c in CONDITIONS:
                run = functools.partial(ablation.arm_block, config=ablation.CONDITIONS[c],
                                        model=model, opt=opt, batches=batches, work=work)
                out = ablation.bracketed(run, "no_sketch", ["shipped"], r)
                ratios.setdefault((c, w), []).append(out["shipped"][0])
    result: dict[str, Any] = {}
    for (c, w), per_round in ratios.items():
        result.setdefault(c, {})[w] = {
            "cost_pct": round(100 * (statistics.median(per_round) - 1), 1),
            "spread": [round(min(per_round), 3), round(max(per_round), 3)]}
    return result


def _dump(model, opt, batches, path: Path) -> None:
    with tracer.Dumper(model, {"path": str(path), "level": "module", "mode": "tensor",
                               "writer": "sync"}):
        overhead.train_steps(model, opt, batches[:1])


def accuracy(noise: float, work: Path) -> dict[str, Any]:
    """Estimated against exact metrics over the records of one gpt step, A against B."""
    torch.manual_seed(0)
    batches = [(torch.randint(0, overhead.VOCAB, (overhead.BATCH, overhead.SEQ)),) * 2]
    paths = []
    for side in ("a", "b"):
        torch.manual_seed(0)
        model = overhead.make_model()
        if side == "b":
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + noise * torch.randn_like(p))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        paths.append(work / side)
        _dump(model, opt, batches, paths[-1])
    da, db = open_dump(paths[0]), open_dump(paths[1])
    cos_err, rel_ratio = [], []
    tol = Tolerance()
    for name in da.stats(0, 0)["name"]:
        a = da.tensor(0, 0, name).astype(np.float64).reshape(-1)
        b = db.tensor(0, 0, name).astype(np.float64).reshape(-1)
        if a.size < 1024 or not np.isfinite(a).all():  # the estimate matters for large ones
            continue
        exact = compare_arrays(a, b, tol)
        est = compare_sketch(from_array(a), from_array(b), a.size, "float32", "float32", tol)
        cos_err.append(abs(est["cosine"] - exact["cosine"]))
        if exact["rmse"] > 0:
            rel_ratio.append((est["rmse"] / est["rms"]) / (exact["rmse"] / exact["rms"]))

    def spread(values: list[float]) -> dict[str, float]:
        return {"median": round(float(np.median(values)), 4),
                "p95": round(float(np.percentile(values, 95)), 4)}

    return {"noise": noise, "records": len(cos_err), "cosine_abs_error": spread(cos_err),
            "rel_error_ratio": spread(rel_ratio)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per block")
    ap.add_argument("--workloads", default="gpt,llama", help="comma-separated: gpt, llama")
    ap.add_argument("--noise", type=float, default=1e-3, help="B's relative weight noise")
    args = ap.parse_args(argv)
    workloads = args.workloads.split(",")
    unknown = sorted(set(workloads) - {"gpt", "llama"})
    if unknown or args.rounds < 1 or args.steps < 1:
        ap.error(f"--workloads from gpt, llama (not {unknown}); --rounds, --steps >= 1")
    work = Path(tempfile.mkdtemp(prefix="sleuth_sketch_"))
    try:
        result = {"benchmark": "sketch_cost", "torch_threads": torch.get_num_threads(),
                  "rounds": args.rounds, "steps_per_block": args.steps, "goal_pct": GOAL_PCT,
                  "cost": cost(workloads, args.rounds, args.steps, work),
                  "accuracy": accuracy(args.noise, work)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
