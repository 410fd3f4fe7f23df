"""Trainer overhead: step time of `trainer.train` against a minimal hand-written loop.

Both train the same tiny GPT on the same batches in this process, interleaved round by round
(trainer, hand loop, trainer, ...) so machine load hits both alike. The trainer's step time is
the interval between consecutive `on_step_end` callbacks, so it includes everything the loop
does per step (schedule, data, accumulation bookkeeping, clipping, metrics line, progress).
The hand loop is batch fetch, forward, backward, clip, AdamW step, zero_grad, loss.item().
Prints one JSON object; goal: trainer_over_hand <= 1.05.

    PYTHONPATH=. python3 benchmarks/trainer_step.py [--rounds 5] [--steps 40]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time

import torch

import trainer
from trainer.data import Sampler, build_datasets
from trainer.model import GPT


class _StepTimer(trainer.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, state: trainer.TrainState) -> None:
        self.ends.append(time.perf_counter())


def _trainer_round(config: trainer.TrainConfig) -> float:
    timer = _StepTimer()
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(config, callbacks=[timer])
    gaps = [b - a for a, b in zip(timer.ends, timer.ends[1:])]
    return statistics.median(gaps[len(gaps) // 4:])  # skip warm-up steps


def _hand_round(config: trainer.TrainConfig, train_ds, rows: list[torch.Tensor]) -> float:
    torch.manual_seed(config.seed)
    model = GPT(config.model)
    o = config.optim
    opt = model.configure_optimizer(lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps)
    times = []
    for r in rows:
        t0 = time.perf_counter()
        batch = train_ds.batch(r)  # a minimal loop still has to fetch its batch
        _, loss = model(**batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[len(times) // 4:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        config = trainer.load_config(preset="tiny", overrides=[
            f"run_dir={tmp}/run", f"steps={args.steps}", "eval_every=0", "log_every=1000000"])
        train_ds, _ = build_datasets(config.data, f"{tmp}/run/data/rank0")
        sampler = Sampler(len(train_ds), seed=config.seed)
        rows = [sampler.rows(i * config.batch_size, config.batch_size) for i in range(args.steps)]
        trainer_times, hand_times = [], []
        for r in range(args.rounds):
            config = trainer.load_config(preset="tiny", overrides=[
                f"run_dir={tmp}/run{r}", f"steps={args.steps}", "eval_every=0", "log_every=1000000",
                f"data.train_files={tmp}/run/data/rank0/demo_pretrain_train.jsonl",
                f"data.val_files={tmp}/run/data/rank0/demo_pretrain_val.parquet"])
            trainer_times.append(_trainer_round(config))
            hand_times.append(_hand_round(config, train_ds, rows))
    t, h = statistics.median(trainer_times), statistics.median(hand_times)
    tokens = config.batch_size * config.data.seq_len
    print(json.dumps({
        "benchmark": "trainer_step", "preset": "tiny", "threads": args.threads, "rounds": args.rounds,
        "steps_per_round": args.steps, "tokens_per_step": tokens,
        "trainer_step_ms": round(t * 1e3, 3), "hand_loop_step_ms": round(h * 1e3, 3),
        "trainer_tokens_per_s": round(tokens / t), "hand_tokens_per_s": round(tokens / h),
        "trainer_over_hand": round(t / h, 3), "goal": "<= 1.05",
    }))


if __name__ == "__main__":
    main()
