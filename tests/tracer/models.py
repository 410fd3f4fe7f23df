"""Tiny third-party-style models for the capture tests: code the tracer was not written for.

`TinyCausalLM` mimics a Hugging Face transformer (a config dataclass, keyword inputs, tuple
layer outputs holding None, a dict-like output object, tied embeddings) without importing
transformers. The others: a CNN with BatchNorm and in-place ReLU, an LSTM, a plain MLP, a model
with a custom autograd Function, and one with activation checkpointing.
"""
from __future__ import annotations

import math
from pathlib import Path
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class TinyConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 64
    max_position_embeddings: int = 32
    tie_word_embeddings: bool = True


class ModelOutput(OrderedDict):
    """Dict with attribute access, like transformers.utils.ModelOutput."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.h = cfg.num_attention_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        b, t, d = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, t, self.h, d // self.h).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.h)
        causal = torch.ones(t, t, dtype=torch.bool, device=att.device).tril()
        att = att.masked_fill(~causal, float("-inf"))
        if attention_mask is not None:
            att = att.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        y = att.softmax(-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d)), None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, cfg.intermediate_size), nn.GELU(),
                                 nn.Linear(cfg.intermediate_size, cfg.hidden_size))

    def forward(self, hidden_states, attention_mask=None):
        attn, weights = self.self_attn(self.input_layernorm(hidden_states),
                                       attention_mask=attention_mask)
        hidden_states = hidden_states + attn
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return (hidden_states, weights)


class TinyCausalLM(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, labels=None):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed_tokens(input_ids) + self.embed_positions(pos)
        hidden = (h,)
        for layer in self.layers:
            h = layer(h, attention_mask=attention_mask)[0]
            hidden += (h,)
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1))
        return ModelOutput(loss=loss, logits=logits, hidden_states=hidden)


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class SmallLSTM(nn.Module):
    def __init__(self, vocab: int = 32, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        out, (h, c) = self.lstm(self.embed(ids))
        return self.head(out)


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Square(torch.autograd.Function):
    """x**2 with a hand-written backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class CustomFnModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Square.apply(self.fc(x)).sum(-1)


class CheckpointedMLP(nn.Module):
    """Two blocks, each recomputed in backward with torch.utils.checkpoint."""

    def __init__(self, d: int = 8, reentrant: bool = False):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


class SharedLayer(nn.Module):
    """One Linear called twice per forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(x)))


class InplaceModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        y.mul_(2)  # in place: the op records must see y before and after
        return y.add_(1)


class FakeWriter:
    """Collects records in memory behind the Writer's interface (`tracer.storage.Writer`): lets
    capture tests run without HDF5. ``records`` holds (step, meta, tensor clone) in the order
    the writer got them; a dropped step's records are removed, as the real writers write
    nothing of it; ``ended`` holds (step, status_reason, drop) per `end_step`.

    As `Writer.add` says, a record that comes with its statistics (a parameter update the fused
    kernel measured) brings its values only where bytes are kept: mode tensor or full."""

    def __init__(self, config=None, rank=0, world_size=1):
        self.records: list = []
        self.steps: list[int] = []
        self.ended: list = []
        self.attrs: dict = {}  # (step, key) -> value, as `set_attr` got them
        self.step = None
        self.closed = False
        self.observers: list = []
        self.enabled = True
        self.keep_bytes = config is not None and config.mode in ("tensor", "full")
        self.sketch = False

    def begin_step(self, step):
        assert self.step is None, "begin_step twice without end_step"
        self.step = step
        self.steps.append(step)
        self._first = len(self.records)

    def add(self, meta, tensor, stable=True, version=None, stats=None):
        assert self.step is not None, "add outside a step"
        self.records.append((self.step, meta, tensor.detach().clone()))

    @property
    def next_seq(self):
        return len(self.records) - self._first if self.step is not None else 0

    def add_call(self, seq, name, spec):
        pass

    def forget(self, tensors):
        pass

    def launch_pending(self):
        pass

    def same_bytes(self, snapshot, source):
        pass

    def set_attr(self, key, value):
        self.attrs[(self.step, key)] = value

    def end_step(self, status_reason=None, *, drop=False):
        assert self.step is not None
        self.ended.append((self.step, status_reason, drop))
        if drop:
            del self.records[self._first:]
        self.step = None

    def close(self):
        self.closed = True

    def names(self, step=None):
        return [m.name for s, m, _ in self.records if step is None or s == step]


def train_and_dump(model_fn, batch_fn, path, steps=2, micro=1, dump_steps=None, lr=0.05,
                   **config):
    """Train `steps` SGD steps (learning rate `lr`) of `micro` backward passes each under a
    Dumper writing to `path` with `config` (and, as its `steps`, the selection `dump_steps`
    when given); returns `tracer.open_dump(path)`."""
    import tracer

    if dump_steps is not None:
        config = {**config, "steps": dump_steps}
    torch.manual_seed(0)
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with tracer.Dumper(model, {"path": str(path), **config}):
        for _ in range(steps):
            for _ in range(micro):
                out = model(*batch_fn())
                loss = out["loss"] if isinstance(out, dict) else out.float().pow(2).mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
    return tracer.open_dump(path)


def _lm_batch():
    ids = torch.randint(0, 64, (2, 8))
    return ids, None, ids


def _channels_last_cnn():
    return SmallCNN().to(memory_format=torch.channels_last)


def stranger_models() -> list[tuple[str, Any, Any]]:
    """(id, model factory, batch factory) of eight models we did not write, each with a hard
    case: attention slices, BatchNorm with in-place ReLU, channels_last, LSTM gates, a custom
    Function, recomputation, a layer called twice, in-place ops."""
    return [
        ("causal_lm", lambda: TinyCausalLM(TinyConfig()), _lm_batch),
        ("cnn", SmallCNN, lambda: (torch.randn(2, 3, 8, 8),)),
        ("cnn_channels_last", _channels_last_cnn,
         lambda: (torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),)),
        ("lstm", SmallLSTM, lambda: (torch.randint(0, 32, (2, 6)),)),
        ("custom_fn", CustomFnModel, lambda: (torch.randn(3, 4),)),
        ("checkpointed", CheckpointedMLP, lambda: (torch.randn(4, 8),)),
        ("shared_layer", SharedLayer, lambda: (torch.randn(3, 4),)),
        ("inplace", InplaceModel, lambda: (torch.randn(3, 4),)),
    ]


def torchrun_ddp(source: str, folder: Path, ranks: int = 2) -> Path:
    """Run script `source` (given the run directory as its argument) under torchrun with
    `ranks` processes; the run directory it dumped to (folder/run)."""
    import os
    import subprocess
    import sys

    script = folder / "ddp.py"
    script.write_text(source)
    run = folder / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "OMP_NUM_THREADS": "1"}
    env.pop("SLEUTH_RUN_ID", None)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={ranks}", str(script), str(run)],
                         capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return run
