"""Trainer overhead: step time of `trainer.train` against a minimal hand-written loop.

Both train the same tiny GPT architecture (two separate instances) in this process, interleaved
step by step: a callback times the trainer's step from `on_step_begin` to `on_step_end` (data,
forward, backward, clipping, AdamW, metrics line, progress print) and then runs and times one
step of the hand loop (batch fetch, forward, backward, clip, AdamW, zero_grad, loss.item()) on the
same batch rows. Interleaving per step keeps a loaded machine from favouring either side.
Prints one JSON object; goal: trainer_over_hand <= 1.05.

    PYTHONPATH=. python3 benchmarks/trainer_step.py [--steps 200] [--threads 1]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "tracer" / "__init__.py").is_file():  # run from a checkout: measure its code
    sys.path.insert(0, str(_ROOT))

import trainer  # noqa: E402
from trainer.data import Sampler, build_datasets  # noqa: E402
from trainer.model import GPT  # noqa: E402


class _Interleaved(trainer.Callback):
    """Times each trainer step, then runs and times one hand-loop step on the same rows."""

    def __init__(self, config: trainer.TrainConfig, train_ds) -> None:
        torch.manual_seed(config.seed)
        self.model = GPT(config.model)
        o = config.optim
        self.opt = self.model.configure_optimizer(lr=o.lr, weight_decay=o.weight_decay,
                                                  betas=(o.beta1, o.beta2), eps=o.eps)
        self.clip = o.grad_clip
        self.ds, self.sampler, self.bs = train_ds, Sampler(len(train_ds), seed=config.seed), config.batch_size
        self.trainer_s: list[float] = []
        self.hand_s: list[float] = []

    def on_step_begin(self, state: trainer.TrainState) -> None:
        self.t0 = time.perf_counter()

    def on_step_end(self, state: trainer.TrainState) -> None:
        self.trainer_s.append(time.perf_counter() - self.t0)
        rows = self.sampler.rows(state.step * self.bs, self.bs)
        t0 = time.perf_counter()
        batch = self.ds.batch(rows)
        _, loss = self.model(**batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss.item()
        self.hand_s.append(time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        config = trainer.load_config(preset="tiny", overrides=[
            f"run_dir={tmp}/run", f"steps={args.steps}", "eval_every=0", "log_every=1000000"])
        train_ds, _ = build_datasets(config.data, f"{tmp}/run/data/rank0")
        probe = _Interleaved(config, train_ds)
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train(config, callbacks=[probe])
    skip = args.steps // 10  # warm-up steps
    t, h = statistics.median(probe.trainer_s[skip:]), statistics.median(probe.hand_s[skip:])
    pair = statistics.median(a / b for a, b in zip(probe.trainer_s[skip:], probe.hand_s[skip:]))
    tokens = config.batch_size * config.data.seq_len
    print(json.dumps({
        "benchmark": "trainer_step", "preset": "tiny", "threads": args.threads,
        "steps_measured": args.steps - skip, "tokens_per_step": tokens,
        "trainer_step_ms": round(t * 1e3, 3), "hand_loop_step_ms": round(h * 1e3, 3),
        "trainer_tokens_per_s": round(tokens / t), "hand_tokens_per_s": round(tokens / h),
        "trainer_over_hand": round(t / h, 3), "median_pairwise_ratio": round(pair, 3), "goal": "<= 1.05",
    }))


if __name__ == "__main__":
    main()
