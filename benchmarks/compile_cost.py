"""What a dump costs a torch.compile'd training step, in each of its modes for compiled code.

A Hugging Face LlamaForCausalLM built from a config (vocab 1024, hidden 128, 4 layers, 4 heads,
2 KV heads, intermediate 256; batch 4 x 128 random token ids, AdamW) is compiled whole
(`--backend`, Inductor by default) and trained in blocks of steps, each timed per step (the
first step of a block untimed). Conditions (`CONDITIONS`), each a Dumper attached for one block
(statistics mode, the async writer, as shipped):

  idle       a Dumper whose steps select none of the block's: what an unselected step costs
  module     "compiled" (the default) at level module: the compiled regions and the model's call
  mix        "compiled" at level mix: also the ops the compiled code dispatches
  interpret  "compiled": "interpret" at level mix: each graph run node by node
  eager      "compiled": "eager" at level mix: the model run eagerly in a dumped step

Every graph is compiled once, before the first timed block, with an interpreter-mode Dumper
listening (so the interpreter has its graphs); the blocks reuse them. Within a round each
condition's block is bracketed by two blocks without a Dumper, and its ratio is its median step
time over the mean of theirs; reported per condition: the median ratio over rounds and its
spread, and the median step of the blocks without a Dumper. Prints one JSON object.

Run: PYTHONPATH=. python3 benchmarks/compile_cost.py [--rounds N] [--steps N]
[--backend inductor|aot_eager] [--size small|tiny]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

CONDITIONS: dict[str, dict[str, Any]] = {
    "idle": {"level": "module", "steps": "1000000"},
    "module": {"level": "module"},
    "mix": {"level": "mix"},
    "interpret": {"level": "mix", "compiled": "interpret"},
    "eager": {"level": "mix", "compiled": "eager"},
}
SIZES = {
    "small": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, batch=4, seq=128),
    "tiny": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, batch=2, seq=16),
}


def _workload(size: str, backend: str) -> tuple[Any, Any, Any, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SIZES[size])
    batch, seq = shape.pop("batch"), shape.pop("seq")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=seq, **shape))
    call = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq))
    return model, call, opt, {"input_ids": ids, "labels": ids}


def _step(call: Any, opt: Any, batch: dict) -> None:
    call(**batch).loss.backward()
    opt.step()
    opt.zero_grad()


def _block(model: Any, call: Any, opt: Any, batch: dict, steps: int,
           config: dict | None, root: Path) -> float:
    """Median seconds a step over `steps` timed steps (one more runs first, untimed), with a
    Dumper of `config` attached (None: none), closed inside the block."""
    import tracer

    dumper = None
    if config is not None:
        run = root / f"run{time.monotonic_ns()}"
        dumper = tracer.Dumper(model, {"path": str(run), **config})
    times = []
    try:
        _step(call, opt, batch)
        for _ in range(steps):
            start = time.perf_counter()
            _step(call, opt, batch)
            times.append(time.perf_counter() - start)
    finally:
        if dumper is not None:
            dumper.close()
            shutil.rmtree(root / run.name, ignore_errors=True)
    return statistics.median(times)


def measure(rounds: int, steps: int, backend: str, size: str,
            conditions: list[str]) -> dict[str, Any]:
    import tracer

    warnings.simplefilter("ignore")
    root = Path(tempfile.mkdtemp(prefix="compile_cost_"))
    try:
        model, call, opt, batch = _workload(size, backend)
        # compile every graph once, with the interpreter mode listening (it keeps the graphs
        # it runs); every block after reuses them
        with tracer.Dumper(model, {"path": str(root / "warm"), "compiled": "interpret",
                                   "steps": "1000000"}):
            for _ in range(2):
                _step(call, opt, batch)
        ratios: dict[str, list[float]] = {c: [] for c in conditions}
        plain: list[float] = []
        for r in range(rounds):
            order = conditions[r % len(conditions):] + conditions[:r % len(conditions)]
            for name in order:
                before = _block(model, call, opt, batch, steps, None, root)
                with_dump = _block(model, call, opt, batch, steps,
                                   {"compiled": "compiled", **CONDITIONS[name]}, root)
                after = _block(model, call, opt, batch, steps, None, root)
                plain += [before, after]
                ratios[name].append(with_dump / ((before + after) / 2))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "benchmark": "compile_cost", "backend": backend, "size": size, "rounds": rounds,
        "steps": steps, "threads": torch.get_num_threads(),
        "step_ms": round(1000 * statistics.median(plain), 3),
        "conditions": {name: {"ratio": round(statistics.median(v), 4),
                              "spread": [round(min(v), 4), round(max(v), 4)]}
                       for name, v in ratios.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    args = ap.parse_args(argv)
    conditions = [c for c in args.conditions.split(",") if c]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or args.rounds < 1 or args.steps < 1:
        ap.error(f"--conditions: {unknown} not among {', '.join(CONDITIONS)}" if unknown
                 else "--rounds and --steps must be at least 1")
    print(json.dumps(measure(args.rounds, args.steps, args.backend, args.size, conditions),
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
