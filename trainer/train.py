"""The training loop: set-up, steps with accumulation and clipping, eval, checkpoints, resume.

`train(config, callbacks=[...])` runs one invocation and returns the final `TrainState`.
The loss of a step is the mean over every target token of the global batch (all micro-batches
of all ranks), so accumulation and data parallelism give the same update as one large batch.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from sleuth.common import RUN_ID_ENV, new_run_id, read_run_id
from trainer import _distributed
from trainer._callbacks import Callback, TrainState, _CallbackList
from trainer._checkpoint import (load_model_into, load_trainer_state, read_meta,
                                 resolve_checkpoint, save_checkpoint, set_rng_state)
from trainer._claim import claim_run_dir, remove_run_files, scan_run_dir
from trainer._errors import CheckpointError, ConfigError, DataError, OtherRunError
from trainer._rundir import RunDir, write_run_json
from trainer.config import OptimConfig, TrainConfig
from trainer.data import Sampler, TokenDataset, build_datasets
from trainer.lora import adapter_blob, apply_lora
from trainer.model import GPT, IGNORE_INDEX



def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at the last step."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / (optim.warmup_steps + 1)
    ratio = (step - optim.warmup_steps) / max(1, total_steps - 1 - optim.warmup_steps)
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio))) * (optim.lr - optim.min_lr)


def build_model(config: TrainConfig, resume_dir: Path | None) -> GPT:
    """The GPT of `config`, with LoRA applied and base weights loaded when LoRA is on."""
    torch.manual_seed(config.seed)
    model = GPT(config.model, recompute=config.recompute)
    if config.lora.enabled:
        if config.lora.base_checkpoint and resume_dir is None:
            base = resolve_checkpoint(config.lora.base_checkpoint)
            load_model_into(model, base)
        apply_lora(model, config.lora)
    return model


def evaluate(model: torch.nn.Module, dataset: TokenDataset, config: TrainConfig,
             device: torch.device, *, rank: int = 0, world_size: int = 1) -> dict[str, float]:
    """Mean loss over the first `eval_batches` global batches of `dataset`, and its perplexity.

    Each rank evaluates its share of every global batch and the sums are all-reduced, so the
    result does not depend on how many processes share the work.
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # on device: NCCL reduces only there
    step = config.batch_size * world_size
    with torch.no_grad(), _autocast(config, device):
        for b in range(config.eval_batches):
            start = b * step + rank * config.batch_size
            rows = torch.arange(start, start + config.batch_size) % len(dataset)
            batch = {k: v.to(device) for k, v in dataset.batch(rows).items()}
            n = int((batch["labels"] != IGNORE_INDEX).sum())
            loss = model(**batch)[1]  # every rank runs forward: FSDP gathers weights collectively
            if n:
                sums += torch.tensor([float(loss) * n, n], dtype=torch.float64, device=device)
    if world_size > 1:
        torch.distributed.all_reduce(sums)
    model.train(was_training)
    loss = float(sums[0] / sums[1].clamp(min=1))
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def _phase(name: str) -> contextlib.AbstractContextManager:
    """`record_function(name)` while a profiler records, else nothing (entering one costs ~10-30 us)."""
    if torch._C._autograd._profiler_enabled():
        return record_function(name)
    return contextlib.nullcontext()


def _autocast(config: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if config.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train(config: TrainConfig, callbacks: Sequence[Callback] = (), *,
          argv: Sequence[str] | None = None) -> TrainState:
    """Train (or resume) as `config` says; returns the final state (metrics, history, model).

    Raises:
        ConfigError, DataError, CheckpointError: with messages that say what to change.
    """
    d = _distributed.setup(config.parallel, config.device)
    previous = os.environ.get(RUN_ID_ENV)
    try:
        return _train(config, list(callbacks), d, list(sys.argv if argv is None else argv))
    finally:
        if previous is None:
            os.environ.pop(RUN_ID_ENV, None)
        else:
            os.environ[RUN_ID_ENV] = previous
        _distributed.teardown(d)


def _run_id(resume_dir: Path | None, d: _distributed.Dist) -> str:
    """The id every file of this run carries: a resumed run continues the run that wrote its
    checkpoint; else the caller's $SLEUTH_RUN_ID (sleuth run), else a new one, the same on
    every rank."""
    if resume_dir is not None:
        run_id = read_meta(resume_dir).get("run_id")
        if isinstance(run_id, str) and run_id:
            return run_id
    run_id = os.environ.get(RUN_ID_ENV, "").strip()
    if run_id:
        return run_id
    return _distributed.broadcast_str(new_run_id(), d)


def _resume_dir(config: TrainConfig, run: RunDir) -> Path | None:
    """The checkpoint this run continues from, or None for a new run.

    Raises:
        OtherRunError: resume=latest and the run directory has no checkpoint.
        CheckpointError: the checkpoint named is missing or incomplete.
    """
    if config.resume == "latest":
        latest = run.latest_checkpoint()
        if latest is None:
            raise OtherRunError(_nothing_to_resume(run.path))
        return latest
    return resolve_checkpoint(config.resume) if config.resume else None


def _nothing_to_resume(path: Path) -> str:
    found = scan_run_dir(path)
    if found.damaged:
        return (f"--resume latest: {path} holds no checkpoint, and {path / 'run.json'} is "
                f"damaged ({found.damaged}); pass --overwrite instead of --resume to train again in "
                f"its place, or use another --run-dir")
    if found.empty:
        return (f"--resume latest: {path} holds no run to continue (no checkpoint under "
                f"{path / 'checkpoints'}); drop --resume to start a new run there")
    owner = found.owner if found.owner is not None else next(iter(found.by_run))
    who = f"run {owner}" if owner else "a run written before run ids"
    return (f"--resume latest: {path} holds {who} but no checkpoint to continue from (one is "
            f"written with --set checkpoint_every=N, or at a --set stop_after=N stop); pass "
            f"--overwrite instead of --resume to train again in its place, or use another --run-dir")


def _inside(path: Path, folder: Path) -> bool:
    return folder.resolve() in path.resolve().parents


def check_run_dir(config: TrainConfig) -> str:
    """What `train` checks before it writes a file, for a launcher that starts its processes
    (`sleuth train --nproc`): refuses as `train` would, reading only. Returns the run id the
    processes are to share ($SLEUTH_RUN_ID): the resumed run's, the caller's, or a new one.

    Raises:
        OtherRunError: another run's files, nothing to resume, a checkpoint of another run.
        ConfigError: overwrite would remove the checkpoint this run resumes from.
        CheckpointError: the checkpoint named is missing or incomplete.
    """
    run = RunDir(config.run_dir, rank=0)
    resume_dir = _resume_dir(config, run)
    single = _distributed.Dist(0, 1, torch.device("cpu"), "single", owns_group=False)
    run_id = _run_id(resume_dir, single)
    _check_claim(config, run, run_id, resume_dir)
    return run_id


def _check_claim(config: TrainConfig, run: RunDir, run_id: str,
                 resume_dir: Path | None) -> tuple[Any, dict[str, list[str]], list[str]]:
    """`_claim`'s checks, reading only: what the directory holds, the other runs' files and
    this run's own that an overwrite removes."""
    own_checkpoint = resume_dir is not None and _inside(resume_dir, run.path)
    if own_checkpoint:
        if config.overwrite:
            raise ConfigError(f"overwrite would remove {resume_dir}, the checkpoint this run "
                              f"resumes from; drop --overwrite to continue the run, or --resume "
                              f"to replace it")
        owner = read_run_id(run.path)
        if not isinstance(read_meta(resume_dir).get("run_id"), str):
            # a checkpoint written before run ids continues its own directory's run
            return scan_run_dir(run.path), {}, []
        if owner and owner != run_id:
            raise OtherRunError(f"{resume_dir} is a checkpoint of run {run_id}, but "
                                f"{run.run_json} names run {owner}: {run.path} mixes two runs; "
                                f"resume from a checkpoint of run {owner} (--resume "
                                f"{run.checkpoints}/step<S>), or from this one into another "
                                f"--run-dir")
    found = claim_run_dir(run.path, run_id, overwrite=config.overwrite)
    others = found.others(run_id)
    # a new run under a reused id ($SLEUTH_RUN_ID) would start at step 0 over that run's steps
    restarted = [] if resume_dir is not None else [
        n for n in found.by_run.get(run_id, []) if n.startswith(("metrics", "checkpoints/", "dump/"))]
    if restarted and not config.overwrite:
        raise OtherRunError(f"{run.path} holds run {run_id} already ({', '.join(restarted[:4])}; "
                            f"{RUN_ID_ENV}={run_id} is set), and this run starts again at step "
                            f"0: pass --resume latest to continue it, --overwrite to replace it, "
                            f"or another --run-dir")
    return found, others, restarted


def _claim(config: TrainConfig, run: RunDir, run_id: str, resume_dir: Path | None,
           d: _distributed.Dist) -> None:
    """Refuse a run directory that holds another run's files, before anything is written (each
    rank reads the same files, so all refuse together); with overwrite, rank 0 removes them.

    Raises:
        OtherRunError: another run's files, or a checkpoint of another run than run.json's.
        ConfigError: overwrite would remove the checkpoint this run resumes from.
    """
    found, others, restarted = _check_claim(config, run, run_id, resume_dir)
    if not (config.overwrite and (others or restarted)):
        return
    if d.world_size > 1:
        torch.distributed.barrier()  # every rank has read the files before any goes
    if d.is_main:
        removed = remove_run_files(run.path)
        names = ("a run whose run.json is damaged" if found.damaged else
                 ", ".join(f"run {r}" if r else "a run written before run ids"
                           for r in (others or [run_id])))
        print(f"overwrite: removed {len(removed)} file(s) of {names} from {run.path}", flush=True)
    if d.world_size > 1:
        torch.distributed.barrier()


def _train(config: TrainConfig, callbacks: list[Callback], d: _distributed.Dist, argv: list[str]) -> TrainState:
    run = RunDir(config.run_dir, rank=d.rank)
    resume_dir = _resume_dir(config, run)

    if d.mode == "fsdp" and config.lora.enabled:
        raise ConfigError("LoRA with parallel=fsdp is not supported; use parallel=ddp (the default)")
    run_id = _run_id(resume_dir, d)
    _claim(config, run, run_id, resume_dir, d)
    # the dump (tracer) and the profiler take the run id from the environment
    os.environ[RUN_ID_ENV] = run_id
    model = build_model(config, resume_dir)
    start_step, position = 0, 0
    if resume_dir is not None:
        meta = read_meta(resume_dir)
        if meta["config"]["model"] != config.to_dict()["model"]:
            raise CheckpointError(f"{resume_dir} was trained with model {meta['config']['model']}, "
                                  f"not {config.to_dict()['model']}; resume with the same model settings")
        load_model_into(model, resume_dir)
    model.to(d.device)
    wrapped = _distributed.wrap(model, d)
    o = config.optim
    optimizer = model.configure_optimizer(lr=o.lr, weight_decay=o.weight_decay,
                                          betas=(o.beta1, o.beta2), eps=o.eps)
    if resume_dir is not None:
        saved = load_trainer_state(resume_dir)
        try:
            _distributed.load_optimizer_state(model, optimizer, saved["optimizer"], d)
            start_step, position = int(saved["step"]), int(saved["data_position"])
            set_rng_state(saved["rng"])
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
            raise CheckpointError(f"{resume_dir}/trainer.pt does not fit this run ({e}); resume "
                                  f"with the settings it was trained with, or from another "
                                  f"checkpoint") from e

    train_ds, val_ds = build_datasets(config.data, run.data_cache)
    sampler = Sampler(len(train_ds), seed=config.seed, rank=d.rank, world_size=d.world_size)
    if d.is_main and not run.run_json.exists():
        write_run_json(run.path, name=config.name, argv=argv, world_size=d.world_size,
                       config=config.to_dict(), run_id=run_id, exclusive=True)
    metrics_file = run.open_metrics(run_id, resume_step=start_step if resume_dir is not None
                                    else None)
    state = TrainState(step=start_step, micro_step=0, model=model, optimizer=optimizer,
                       run_dir=run.path, rank=d.rank, world_size=d.world_size, config=config,
                       example_batch=_to(train_ds.batch(sampler.local_rows(position, config.batch_size)), d))
    events = _CallbackList(callbacks)
    stop = config.stop_after or config.steps
    global_micro = config.batch_size * d.world_size
    params = [p for p in model.parameters() if p.requires_grad]
    if d.is_main:
        print(f"training {model.num_params():,} parameters ({len(params)} tensors trainable) on "
              f"{d.device} x{d.world_size}, steps {start_step}-{stop - 1} of {config.steps} "
              f"(counted from 0, as in metrics.jsonl and the dump), run dir {run.path}", flush=True)
    events.on_run_start(state)
    try:
        for step in range(start_step, stop):
            t0 = time.perf_counter()
            state.step, state.micro_step = step, 0
            lr = lr_at(step, o, config.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            events.on_step_begin(state)

            with _phase("sleuth.data"):
                batches = [train_ds.batch(sampler.local_rows(position + m * global_micro, config.batch_size))
                           for m in range(config.grad_accum)]
                position += config.grad_accum * global_micro
                counts = [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches]
                n_global = int(_distributed.all_reduce_sum(torch.tensor(sum(counts), device=d.device), d))
                if n_global == 0:
                    raise DataError(f"step {step} has no target tokens (every label is masked); "
                                    f"check data.mode and the response fields")
                batches = [_to(b, d) for b in batches]
            # DDP averages gradients over ranks, so each rank divides by its share of the tokens
            denom = n_global / d.world_size
            loss_sum = torch.zeros((), device=d.device)
            for m, batch in enumerate(batches):
                state.micro_step = m
                with _distributed.no_sync(wrapped, d, m == len(batches) - 1):
                    with _phase("sleuth.forward"), _autocast(config, d.device):
                        logits, loss = wrapped(**batch)
                        # a micro-batch without targets still joins backward so DDP's hooks fire
                        scaled = loss * (counts[m] / denom) if counts[m] else logits.sum() * 0.0
                    with _phase("sleuth.backward"):
                        scaled.backward()
                if counts[m]:
                    loss_sum += loss.detach().float() * counts[m]
                events.on_after_backward(state)

            with _phase("sleuth.optimizer"):
                max_norm = o.grad_clip if o.grad_clip > 0 else float("inf")
                grad_norm = _distributed.full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm))
            events.on_before_optimizer_step(state)
            with _phase("sleuth.optimizer"):
                optimizer.step()
            events.on_after_optimizer_step(state)
            optimizer.zero_grad(set_to_none=True)

            # note: .item() below is a device sync point, once per step
            loss_value = float(_distributed.all_reduce_sum(loss_sum, d)) / n_global
            step_time = time.perf_counter() - t0
            tokens = config.grad_accum * global_micro * config.data.seq_len
            state.metrics = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                             "tokens_per_s": tokens / step_time, "step_time_s": step_time,
                             "tokens": n_global}
            state.history.append(dict(state.metrics))
            _write_line(metrics_file, state.metrics)
            if d.is_main and ((step + 1) % config.log_every == 0 or step + 1 == stop):
                # the number metrics.jsonl, the dump and the profile give this step, over the last
                print(f"step {step}/{config.steps - 1} loss {loss_value:.4f} lr {lr:.2e} "
                      f"grad_norm {float(grad_norm):.3f} tok/s {tokens / step_time:,.0f}", flush=True)
            events.on_step_end(state)

            done = step + 1
            if val_ds is not None and config.eval_every and (done % config.eval_every == 0 or done == config.steps):
                result = evaluate(model, val_ds, config, d.device, rank=d.rank, world_size=d.world_size)
                state.history.append({"step": step, **result})
                _write_line(metrics_file, {"step": step, **result})
                if d.is_main:
                    print(f"eval step {step}: loss {result['eval_loss']:.4f} ppl {result['eval_ppl']:.2f}",
                          flush=True)
                events.on_eval(state, result)
            if (config.checkpoint_every and (done % config.checkpoint_every == 0 or done == config.steps)) \
                    or (config.stop_after is not None and done == stop and done < config.steps):
                _checkpoint(run, model, optimizer, d, config, done, position, run_id)
    finally:
        metrics_file.close()
        events.on_run_end(state)
    return state


def _checkpoint(run: RunDir, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                d: _distributed.Dist, config: TrainConfig, done: int, position: int,
                run_id: str) -> None:
    # gathering full state dicts is collective under FSDP, so every rank calls these
    model_state = _distributed.model_state(model, d)
    optim_state = _distributed.optimizer_state(model, optimizer, d)
    if d.is_main:
        extra = {"adapter.pt": adapter_blob(model)} if config.lora.enabled else None
        save_checkpoint(run.checkpoint(done), model_state=model_state, optimizer_state=optim_state,
                        step=done, data_position=position, config=config.to_dict(), extra=extra,
                        run_id=run_id)
    if d.world_size > 1:
        torch.distributed.barrier()  # nobody resumes from a checkpoint still being written


def _to(batch: dict[str, torch.Tensor], d: _distributed.Dist) -> dict[str, torch.Tensor]:
    return {k: v.to(d.device, non_blocking=True) for k, v in batch.items()}


def _write_line(f, record: dict) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()
