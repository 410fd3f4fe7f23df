"""Tracer overhead: training-step time with a Dumper attached, as a ratio to no dump.

Two models: `gpt` (vocab 512, 4 layers, d 256, seq 128, batch 8; the trainer's
GPT when importable) and `tiny` (the trainer's tiny preset: 2 layers, d 64, seq 64, batch 8,
where per-record costs dominate). For each, every condition runs in one process, interleaved
round by round, and each condition's block of steps is bracketed by two baseline blocks; a
condition's ratio is the median over rounds of (its median step time / the mean of the two
baseline medians around it), which cancels the drifts of a shared machine, down to the seconds
between blocks. `baseline_again` (no Dumper, measured like a condition) shows what is left.
`sustained_ratios` is the same over each block's wall time per step, counted from the end of
its first step to the return of `Dumper.close()`: the async writer's drain (its backlog of
step files still to write and fsync) is in it, which the per-step median leaves out as long
as a block fits the queue (16 tiny op tensor steps are 310 MB, under the 1 GiB default cap).
It is what a long run, whose queue fills and applies back-pressure, pays per step; the goals
are judged on it (for the sync writer the two agree). Prints one JSON object. Conditions and goals:

  module_statistics     level module, statistics, sync writer          goal <= 1.15x
  op_statistics         level op, statistics, sync writer              goal <= 1.5x
  op_tensor_async       level op, tensor, async writer                 goal <= 4x
  module/op_statistics_async  the same statistics with the async writer (no goal of its own)
  attached_unselected   Dumper attached, current step not selected     goal <= 1.02x
  module/op_capture_only  Python hooks and dispatch mode, a writer that drops every record
  baseline_again        no Dumper, timed like a condition: the run's noise floor
  floor_module_hooks    no Dumper: no-op global module hooks and output gradient hooks
  floor_dispatch_mode   no Dumper: a TorchDispatchMode that only runs each op
  floor_dispatch_mode_default  the same with torch's default dynamo wrapper per op
  floor_op_observer     no Dumper: torch.profiler (CPU, record_shapes): torch's C++ per-op
                        callbacks, reading every op's inputs, with no Python per op
  floor_step_file       no Dumper: each optimizer step writes a 56 KiB file (a tiny module
                        statistics step file's size) as *.partial, fsyncs and renames it,
                        the durable file per dumped step that docs/architecture.md asks of every writer
  module_statistics_minimal  level module, statistics, sync, one module's forward output and
                        no parameters: every hook runs, one record a step, and its step file

msprobe (mindstudio-probe) reference numbers on the gpt model (benchmarks/RESULTS.md): L0 statistics 1.9x, L1 statistics
4.9x, L1 tensor 22.9x. Run: PYTHONPATH=. python3 benchmarks/tracer_overhead.py [--rounds N]
[--models gpt,tiny] [--conditions a,b] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tracer  # noqa: E402
import tracer._dumper as dumper_module  # noqa: E402

real_writer = dumper_module._make_writer

VOCAB, LAYERS, D, HEADS, SEQ, BATCH = 512, 4, 256, 4, 128, 8

CONDITIONS = {
    "baseline": None,
    "module_statistics": {"level": "module", "mode": "statistics", "writer": "sync"},
    "op_statistics": {"level": "op", "mode": "statistics", "writer": "sync"},
    "op_tensor_async": {"level": "op", "mode": "tensor", "writer": "async"},
    # statistics computed in the async writer's thread from a snapshot (the hot path copies)
    "module_statistics_async": {"level": "module", "mode": "statistics", "writer": "async"},
    "op_statistics_async": {"level": "op", "mode": "statistics", "writer": "async"},
    "attached_unselected": {"level": "mix", "steps": "1000000"},
    # the least a dumped step costs: every module hook runs, one record is kept (the model's
    # last module's forward output, resolved by `one_module`), and the step file is written
    "module_statistics_minimal": {"level": "module", "mode": "statistics", "writer": "sync",
                                  "params": False, "phases": "forward", "io": "output",
                                  "_one_module": True},
    # capture alone (hooks, dispatch mode, naming, source lines) with a writer that drops
    # records: separates the tracer's capture cost from the statistics and storage cost
    "module_capture_only": {"level": "module", "_null_writer": True},
    "op_capture_only": {"level": "op", "_null_writer": True},
    # no Dumper at all, measured like a condition: its ratio is the noise floor of the run
    "baseline_again": "baseline",
    # what torch's own mechanisms cost before any tool does anything (no Dumper): global
    # module forward hooks plus a no-op gradient hook on every module output, the least a
    # module-level dump attaches; and a TorchDispatchMode that only calls each op, the least
    # an op-level dump attaches. A goal below these cannot be met by hooks in Python.
    "floor_module_hooks": "floor_module_hooks",
    "floor_dispatch_mode": "floor_dispatch_mode",
    # the same with torch's default dynamo `disable` wrapper around the handler, which the
    # tracer opts out of (its cost per op is the difference)
    "floor_dispatch_mode_default": "floor_dispatch_mode_default",
    # torch's C++ per-op callbacks (RecordFunction, what torch.profiler uses), reading every
    # op's inputs: the least an op-level capture in compiled code would cost, next to the
    # Python dispatch mode's floor
    "floor_op_observer": "floor_op_observer",
    # the write, fsync and rename of one step file per step with no tracer at all: with
    # floor_module_hooks, the least a sync module-level dump can cost under docs/architecture.md's
    # atomic, durable files
    "floor_step_file": "floor_step_file",
}
FLOOR_FILE_BYTES = 56 * 1024
GOALS = {"module_statistics": 1.15, "op_statistics": 1.5, "op_tensor_async": 4.0,
         "attached_unselected": 1.02}
MSPROBE_REFERENCE = {"L0_statistics": 1.9, "L1_statistics": 4.9, "L1_tensor": 22.9}


def make_tiny() -> tuple[nn.Module, int, int, int]:
    """The trainer's tiny preset: (model, vocab, seq, batch)."""
    from trainer import GPT, config

    cfg = config.tiny()
    return GPT(cfg.model), cfg.model.vocab_size, cfg.data.seq_len, cfg.batch_size


def make_model() -> nn.Module:
    try:
        from trainer import GPT, ModelConfig

        return GPT(ModelConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS,
                               n_embd=D, dropout=0.0))
    except ImportError:  # a checkout without the trainer: the same shape, defined here
        layer = nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=0.0, batch_first=True,
                                           norm_first=True)

        class GPT(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
                self.h = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
                self.head = nn.Linear(D, VOCAB, bias=False)

            def forward(self, ids, labels):
                x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
                n = ids.shape[1]
                mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
                logits = self.head(self.h(x, mask=mask, is_causal=True))
                return logits, F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))

        return GPT()


class _NoopMode(TorchDispatchMode):
    """Runs every op and nothing else: the floor of any op-level capture. Like the tracer's
    OpMode it opts out of the dynamo `disable` wrapper torch puts around a mode's handler by
    default (`_DefaultNoopMode` keeps it)."""

    @classmethod
    def _should_skip_dynamo(cls):
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _DefaultNoopMode(_NoopMode):
    """`_NoopMode` with torch's default wrapper around the handler (torch wraps a handler the
    class itself defines, hence the assignment)."""

    @classmethod
    def _should_skip_dynamo(cls):
        return True

    __torch_dispatch__ = _NoopMode.__torch_dispatch__


def _noop_grad(grad):
    return None


def _noop_pre(module, args):
    return None


def _noop_post(module, args, kwargs, output):
    for t in output if isinstance(output, (tuple, list)) else (output,):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(_noop_grad)


@contextlib.contextmanager
def floor(kind: str):
    """The hooks (or mode) of a floor condition, attached for the duration. floor_step_file
    yields the folder its files go to (removed at exit)."""
    if kind == "floor_step_file":
        with step_files() as folder:
            yield folder
        return
    modes = {"floor_dispatch_mode": _NoopMode, "floor_dispatch_mode_default": _DefaultNoopMode}
    if kind in modes:
        with modes[kind]():
            yield
        return
    if kind == "floor_op_observer":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True):
            yield
        return
    handles = [nn.modules.module.register_module_forward_pre_hook(_noop_pre),
               nn.modules.module.register_module_forward_hook(_noop_post, with_kwargs=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def step_files():
    """An optimizer step post-hook writing one FLOOR_FILE_BYTES file per step as `*.partial`
    and committing it with the tracer's own `PendingFile.commit` (fsync, rename), with no
    Dumper. Yields the folder."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from tracer.storage._file_io import PendingFile

    folder = Path(tempfile.mkdtemp(prefix="sleuth_floor_"))
    payload = os.urandom(FLOOR_FILE_BYTES)
    count = [0]

    def write(optimizer, args, kwargs):
        final = folder / f"step{count[0]}.h5"
        partial = final.with_name(final.name + ".partial")
        count[0] += 1
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pending = PendingFile(fd, partial, final)
        try:
            os.write(fd, payload)
        except BaseException:
            pending.abort()
            raise
        pending.commit()

    handle = register_optimizer_step_post_hook(write)
    try:
        yield folder
    finally:
        handle.remove()
        shutil.rmtree(folder, ignore_errors=True)


def one_module(model: nn.Module, config: dict) -> dict:
    """`config` without its `_one_module` flag, its module filter set to the model's last
    module in `named_modules()` order when the flag was set."""
    config = dict(config)
    if config.pop("_one_module", False):
        config["modules"] = [[name for name, _ in model.named_modules()][-1]]
    return config


class _NullWriter:
    """The Writer's interface (tracer.storage.Writer), storing nothing."""

    observers: list = []
    enabled = True
    sketch = False
    next_seq = 0

    def begin_step(self, step): pass
    def add(self, meta, tensor, stable=True, version=None, stats=None): pass
    def add_call(self, seq, name, spec): pass
    def forget(self, tensors): pass
    def launch_pending(self): pass
    def same_bytes(self, snapshot, source): pass
    def set_attr(self, key, value): pass
    def end_step(self, status_reason=None, *, drop=False): pass
    def close(self): pass


class Block(NamedTuple):
    """One timed block of training steps (see `timed_block`)."""

    steps: list[float]
    """each step's seconds, the first step of the block left out"""
    wall: float
    """seconds from the end of the first step until the block's attachment was closed"""

    @property
    def median(self) -> float:
        return statistics.median(self.steps)

    @property
    def per_step(self) -> float:
        return self.wall / len(self.steps)


def timed_block(model, opt, batches, attach: Callable[[], Any] | None = None) -> Block:
    """Train on `batches` inside `attach()` (a Dumper, hooks, or nothing). The first step
    (which opens the writer) is untimed; the wall time runs until `attach()`'s exit returns,
    so an async writer's drain is counted."""
    with (attach() if attach is not None else contextlib.nullcontext()):
        train_steps(model, opt, batches[:1])
        start = time.perf_counter()
        steps = train_steps(model, opt, batches[1:])
    return Block(steps, time.perf_counter() - start)


def _no_sync() -> None:
    pass


# waits for the device at each step's end (`--device cuda`: torch.cuda.synchronize), so a step's
# time is its kernels' and not only their launches'
step_sync: Callable[[], None] = _no_sync


def train_steps(model, opt, batches) -> list[float]:
    times = []
    for ids, labels in batches:
        t0 = time.perf_counter()
        _, loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_sync()
        times.append(time.perf_counter() - t0)
    return times


def msprobe_steps(model, opt, batches, debugger) -> list[float]:
    """The same steps under msprobe's documented loop: start(model) ... stop(); step()."""
    times = []
    for ids, labels in batches:
        t0 = time.perf_counter()
        debugger.start(model)
        _, loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        debugger.stop()
        debugger.step()
        times.append(time.perf_counter() - t0)
    return times


def make_msprobe(which: str, work: Path):
    """msprobe's PrecisionDebugger for "L0_statistics", "L1_statistics" or "L1_tensor".

    It is a process-wide singleton (the first config wins), so one msprobe configuration is
    measured per process, interleaved with the baseline.
    """
    from msprobe.pytorch import PrecisionDebugger

    level, task = which.split("_", 1)
    config = {"task": task, "dump_path": str(work / "msprobe"), "rank": [], "step": [],
              "level": level, "async_dump": False,
              task: {"scope": [], "list": [], "data_mode": ["all"]}}
    path = work / "msprobe.json"
    path.write_text(json.dumps(config))
    return PrecisionDebugger(config_path=str(path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0,
                    help="timed steps per condition per round (default: 4 for gpt, 16 for tiny, "
                         "whose steps are 25x shorter)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: leave as is); 1 by default because OpenMP threads on a "
                         "shared, oversubscribed machine made the baseline 10x slower and noisy")
    ap.add_argument("--msprobe", choices=sorted(MSPROBE_REFERENCE), default=None,
                    help="measure this msprobe configuration against the baseline instead of "
                         "the tracer (pip install mindstudio-probe)")
    ap.add_argument("--conditions", default="",
                    help="comma-separated subset of: " + ", ".join(list(CONDITIONS)[1:]))
    ap.add_argument("--models", default="gpt,tiny",
                    help="comma-separated: gpt (4 layers, d 256), tiny (the trainer's preset)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the model trains (cuda: the tracer's device paths, each step "
                         "synchronized before it is timed)")
    args = ap.parse_args(argv)
    global step_sync
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device here")
        step_sync = torch.cuda.synchronize
    if args.threads:
        torch.set_num_threads(args.threads)
    conditions = dict(CONDITIONS)
    if args.conditions:
        wanted = args.conditions.split(",")
        unknown = sorted(set(wanted) - set(CONDITIONS))
        if unknown:
            ap.error(f"unknown condition(s) {unknown}; choose from {list(CONDITIONS)[1:]}")
        conditions = {k: v for k, v in CONDITIONS.items() if k == "baseline" or k in wanted}
    models = args.models.split(",")
    if set(models) - {"gpt", "tiny"}:
        ap.error(f"--models: choose from gpt, tiny (got {args.models!r})")
    result = {"benchmark": "tracer_overhead", "device": args.device,
              "torch_threads": torch.get_num_threads(),
              "goals": {k: v for k, v in GOALS.items() if k in conditions},
              "msprobe_reference": MSPROBE_REFERENCE}
    for which in models:
        result[which] = measure(which, conditions, args)
    print(json.dumps(result, indent=1))
    return 0


def bracketed_rounds(rounds: int, baseline: Callable[[], Block],
                     runs: dict[str, Callable[[], Block]]
                     ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each run's ratios per round, (median, sustained): the median of its step times over the
    mean of the baseline medians measured right before and right after it, and its wall time
    per step over the baselines' likewise. The order rotates each round so no run always
    follows the same one (memory freed by a tensor-mode condition makes the next one fault
    pages back in)."""
    medians: dict[str, list[float]] = {name: [] for name in runs}
    sustained: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs.items())
    for r in range(rounds):
        before = baseline()
        for name, run in order[r % len(order):] + order[:r % len(order)]:
            block = run()
            after = baseline()
            medians[name].append(block.median / ((before.median + after.median) / 2))
            sustained[name].append(block.per_step / ((before.per_step + after.per_step) / 2))
            before = after
    return medians, sustained


def measure(which: str, conditions: dict, args: argparse.Namespace) -> dict:
    """Interleaved rounds of every condition on one model; its part of the JSON."""
    torch.manual_seed(0)
    if which == "tiny":
        model, vocab, seq, batch = make_tiny()
    else:
        model, vocab, seq, batch = make_model(), VOCAB, SEQ, BATCH
    model = model.to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps_per_round = args.steps or (16 if which == "tiny" else 4)
    batches = [(torch.randint(0, vocab, (batch, seq), device=args.device),
                torch.randint(0, vocab, (batch, seq), device=args.device))
               for _ in range(steps_per_round + 1)]
    work = Path(tempfile.mkdtemp(prefix="sleuth_bench_"))
    debugger = None
    if args.msprobe:
        conditions = {"baseline": None, f"msprobe_{args.msprobe}": "msprobe"}
        with contextlib.redirect_stdout(sys.stderr):  # msprobe logs to stdout
            debugger = make_msprobe(args.msprobe, work)
    times: dict[str, list[float]] = {name: [] for name in conditions}
    # per round, each condition's median step over the mean of the baseline medians measured
    # right before and right after it
    records: dict[str, int] = {}
    stored_mb: dict[str, float] = {}

    def baseline() -> Block:
        block = timed_block(model, opt, batches)
        times["baseline"] += block.steps
        return block

    def run(name: str, config: Any) -> Block:
        if config == "baseline":
            return timed_block(model, opt, batches)
        if isinstance(config, str) and config.startswith("floor_"):
            return timed_block(model, opt, batches, functools.partial(floor, config))
        if config == "msprobe":
            with contextlib.redirect_stdout(sys.stderr):
                start = time.perf_counter()
                steps = msprobe_steps(model, opt, batches, debugger)
                wall = time.perf_counter() - start - steps[0]
            shutil.rmtree(work / "msprobe", ignore_errors=True)
            return Block(steps[1:], wall)
        path = work / name
        config = one_module(model, config)
        null = config.pop("_null_writer", False)
        dumper_module._make_writer = (lambda *a: _NullWriter()) if null else real_writer
        block = timed_block(model, opt, batches,
                            lambda: tracer.Dumper(model, {**config, "path": str(path)}))
        if name not in records and (path / "dump").exists():
            dump = tracer.open_dump(path)
            records[name] = len(dump.stats(0, dump.steps(0)[-1]))
            stored_mb[name] = round(float(dump.summary().tensor_bytes.iloc[-1]) / 1e6, 1)
        shutil.rmtree(path, ignore_errors=True)
        # untimed: write back what this condition left dirty in the page cache, so the
        # kernel's writeback (290 MB a step in tensor mode) does not slow what comes next
        if hasattr(os, "sync"):
            os.sync()
        return block

    try:
        train_steps(model, opt, batches[:2])  # warm up kernels and the optimizer state

        def timed(name: str, config: Any) -> Block:
            block = run(name, config)
            times[name] += block.steps
            return block

        bracketed, sustained = bracketed_rounds(args.rounds, baseline, {
            name: functools.partial(timed, name, config)
            for name, config in conditions.items() if name != "baseline"})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(times["baseline"])
    return {
        "model": {"params": sum(p.numel() for p in model.parameters()), "vocab": vocab,
                  "seq": seq, "batch": batch},
        "baseline_step_s": round(base, 4),
        "ratios": {name: round(statistics.median(r), 3) for name, r in bracketed.items()},
        "sustained_ratios": {name: round(statistics.median(r), 3)
                             for name, r in sustained.items()},
        "ratios_of_pooled_medians": {name: round(statistics.median(t) / base, 3)
                                     for name, t in times.items() if name != "baseline"},
        "records_per_step": records,
        "tensor_mb_per_step": {k: v for k, v in stored_mb.items() if v},
        "samples_per_condition": len(times["baseline"]),
        "spread": {name: [round(min(t) / base, 3), round(max(t) / base, 3)]
                   for name, t in times.items()},
    }


if __name__ == "__main__":
    raise SystemExit(main())
