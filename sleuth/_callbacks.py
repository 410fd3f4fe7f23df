"""Trainer callbacks that drive the tools: the one place where trainer and tools meet.

The trainer knows only its `Callback` contract and the tools know nothing of the trainer; these
thin adapters map trainer events onto each tool's public API (`tracer.Dumper.step`,
`profiler.Collector.step`, `profiler.SummaryWriter.add_scalars`, `irdump.save_graphs`).
Every adapter closes its tool in `on_run_end`, which the trainer calls also when a run fails.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import trainer


class DumpCallback(trainer.Callback):
    """Dump tensors with `tracer.Dumper`; one dump step per optimizer step.

    The Dumper's optimizer hook ends each step, so dump step S is the trainer's step S in
    metrics.jsonl (numbered from the resumed step); ending steps here as well would end a
    second step per optimizer step."""

    def __init__(self, config: str) -> None:
        """`config`: a dump config JSON file, or inline JSON (as $SLEUTH_DUMP_CONFIG takes)."""
        from sleuth._configs import dump_config

        self.config = dump_config(config)  # a bad config fails before training
        self.dumper: Any = None

    def on_run_start(self, state: trainer.TrainState) -> None:
        import tracer

        config = self.config
        if not config.path:  # the dump belongs in this run's directory unless told otherwise
            config = dataclasses.replace(config, path=str(state.run_dir))
        self.dumper = tracer.Dumper(state.model, config, rank=state.rank,
                                    world_size=state.world_size, first_step=state.step)

    def on_run_end(self, state: trainer.TrainState) -> None:
        if self.dumper is not None:
            # called from the trainer's `finally`: the exception ending a failed run, if any,
            # is the one being handled; its step is written marked interrupted
            self.dumper.close(interrupted=sys.exc_info()[1])


class ProfileCallback(trainer.Callback):
    """Profile steps with `profiler.Collector` on its wait/warmup/active schedule."""

    def __init__(self, config_path: str | None) -> None:
        import profiler

        from sleuth._configs import collector_config

        self.config = (collector_config(config_path) if config_path
                       else profiler.CollectorConfig())
        self.collector: Any = None

    def on_run_start(self, state: trainer.TrainState) -> None:
        import profiler

        config = self.config
        if config.tokens_per_step is None:
            c = state.config
            tokens = c.batch_size * c.grad_accum * c.data.seq_len * state.world_size
            config = dataclasses.replace(config, tokens_per_step=tokens)
        self.collector = profiler.Collector(state.run_dir, config=config, rank=state.rank)
        self.collector.start()

    def on_step_end(self, state: trainer.TrainState) -> None:
        self.collector.step()

    def on_run_end(self, state: trainer.TrainState) -> None:
        if self.collector is not None:
            self.collector.close()


class SummaryCallback(trainer.Callback):
    """Scalars every step (loss, lr, grad norm, throughput, eval) and weight/grad histograms."""

    def __init__(self, histogram_every: int = 10) -> None:
        self.histogram_every = histogram_every
        self.writer: Any = None

    def on_run_start(self, state: trainer.TrainState) -> None:
        import profiler

        self.writer = profiler.SummaryWriter(
            state.run_dir, rank=state.rank, frequency={"histogram": self.histogram_every})

    def on_before_optimizer_step(self, state: trainer.TrainState) -> None:
        # Gradients exist only between backward and the optimizer's zero_grad.
        if state.step % self.histogram_every == 0:
            self.writer.add_model_histograms(state.model, state.step, kinds=("weights", "grads"))

    def on_step_end(self, state: trainer.TrainState) -> None:
        scalars = {f"train/{k}": float(v) for k, v in state.metrics.items()
                   if isinstance(v, (int, float))}
        self.writer.add_scalars(scalars, state.step)

    def on_eval(self, state: trainer.TrainState, metrics: dict[str, float]) -> None:
        self.writer.add_scalars({f"eval/{k}": float(v) for k, v in metrics.items()}, state.step)

    def on_run_end(self, state: trainer.TrainState) -> None:
        if self.writer is not None:
            self.writer.close()


class GraphsCallback(trainer.Callback):
    """Export the model's IR graphs once, on rank 0, before the first step trains."""

    def __init__(self, path: str | None = None, depth: int | None = None) -> None:
        self.path = path
        self.depth = depth

    def on_run_start(self, state: trainer.TrainState) -> None:
        import irdump

        if state.rank != 0:
            return
        out = Path(self.path) if self.path else state.run_dir / "ir"
        batch = state.example_batch

        def loss_fn(output: Any) -> Any:
            logits, loss = output if isinstance(output, tuple) else (output, None)
            return loss if loss is not None else logits.float().sum()

        try:
            irdump.save_graphs(state.model, batch, out, depth=self.depth, loss_fn=loss_fn)
        except (irdump.IrDumpError, OSError) as e:
            from sleuth.common import go_off  # observing never stops the run

            go_off(e, tool="IR graphs", off="the IR graphs are not saved", doing="saving them",
                   raise_as=irdump.IrDumpError, stacklevel=2)


def callbacks_from_flags(*, dump: str | None, profile: str | None, summary: bool,
                         save_graphs: bool, graphs_path: str | None = None
                         ) -> list[trainer.Callback]:
    """The callbacks that `sleuth train`'s tool flags ask for.

    SLEUTH_* variables are not read here: in a process where they are set, the start-up hook
    (`sleuth._autoattach`) already attached the tools, and reading them twice would attach twice.
    """
    callbacks: list[trainer.Callback] = []
    if save_graphs:
        callbacks.append(GraphsCallback(graphs_path))
    if summary:
        callbacks.append(SummaryCallback())
    if dump:
        callbacks.append(DumpCallback(dump))
    if profile:
        callbacks.append(ProfileCallback(None if profile == "1" else profile))
    return callbacks
