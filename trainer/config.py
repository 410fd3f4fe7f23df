"""Training configuration: frozen keyword-only dataclasses, presets, JSON files and `--set` overrides.

A config is built in three layers, each validated: a preset (`tiny()`, `small()`), then an
optional JSON file holding any subset of the nested keys, then dotted overrides such as
`optim.lr=1e-3`. Unknown keys are rejected with the closest valid name.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import stat
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer._errors import ConfigError

FORMAT_VERSION = "1.0"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the GPT."""

    vocab_size: int = 264
    """Embedding rows; at least the tokenizer's 261 ids (256 bytes + 5 specials), padded to 8."""
    block_size: int = 64
    """Longest sequence the position embedding covers."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 2
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 64
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability in attention, MLP and embeddings (0 turns it off)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "block_size", "n_layer", "n_head", "n_embd")
        if self.vocab_size < 261:
            raise ConfigError(f"model.vocab_size={self.vocab_size} is below the tokenizer's 261 ids; use 264")
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}")
        _fraction(self, "dropout")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where examples come from and how they become token batches."""

    mode: Literal["pretrain", "sft"] = "pretrain"
    """pretrain: pack a text field; sft: prompt/response (or messages), loss on responses only."""
    train_files: tuple[str, ...] = ()
    """json, jsonl or parquet files; empty means the built-in demo corpus (stdlib docstrings)."""
    val_files: tuple[str, ...] = ()
    """Held-out files; empty means the last `val_fraction` of the training examples."""
    val_fraction: float = 0.05
    """Share of training examples held out for eval when no val_files are given."""
    seq_len: int = 64
    """Tokens per training sequence; at most model.block_size."""
    text_field: str = "text"
    """Field holding the document in pretrain mode."""
    prompt_field: str = "prompt"
    """Field holding the prompt in sft mode."""
    response_field: str = "response"
    """Field holding the response in sft mode."""
    messages_field: str = "messages"
    """Field holding a multi-turn list of {role, content} in sft mode (used when present)."""

    def __post_init__(self) -> None:
        _positive(self, "seq_len")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 1e-3
    """Peak learning rate, reached after warmup."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 2
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on biases, norms or embeddings of size 1-D)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off (the norm is still logged)."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ConfigError(f"need 0 <= optim.min_lr <= optim.lr and lr > 0; got lr={self.lr}, min_lr={self.min_lr}")
        if not (self.warmup_steps >= 0 and self.weight_decay >= 0 and self.grad_clip >= 0
                and self.eps > 0):
            raise ConfigError("optim.warmup_steps, weight_decay and grad_clip must be >= 0 and eps > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"optim.beta1={self.beta1} and beta2={self.beta2} must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters; when enabled only the adapters train."""

    enabled: bool = False
    """Wrap the target Linear layers with adapters and freeze everything else."""
    rank: int = 8
    """Rank r of the update B @ A."""
    alpha: float = 16.0
    """Scale of the update is alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input."""
    targets: str = r"attn\.(c_attn|c_proj)$"
    """Regex searched in each Linear module's dotted name; matching layers get adapters."""
    base_checkpoint: str | None = None
    """Checkpoint directory (or run directory: its latest checkpoint) holding the base weights."""

    def __post_init__(self) -> None:
        _positive(self, "rank")
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha={self.alpha} must be > 0")
        _fraction(self, "dropout")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one training run needs; `dataclasses.asdict` of it goes into run.json."""

    name: str = "run"
    """Name of the run, recorded in run.json."""
    run_dir: str = "runs/run"
    """Run directory: run.json, metrics.jsonl, checkpoints/ and whatever the tools add."""
    seed: int = 1337
    """Seeds the weights, dropout and the data order."""
    steps: int = 20
    """Optimizer steps in the whole run (the schedule spans them)."""
    stop_after: int | None = None
    """End this invocation after this many steps (a checkpoint is written); resume to continue."""
    batch_size: int = 8
    """Sequences per micro-batch per process."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16 runs forward and loss under torch.autocast; weights and optimizer stay fp32."""
    recompute: bool = False
    """Recompute each block's activations in backward (torch.utils.checkpoint) to save memory."""
    parallel: Literal["auto", "ddp", "fsdp"] = "auto"
    """With several processes (torchrun): auto and ddp use DDP, fsdp uses fully_shard (GPU only)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto picks cuda when available."""
    log_every: int = 1
    """Print progress every N steps (metrics.jsonl gets every step)."""
    eval_every: int = 10
    """Evaluate validation loss every N steps and at the end; 0 turns eval off."""
    eval_batches: int = 2
    """Validation batches per evaluation."""
    checkpoint_every: int = 0
    """Write a checkpoint every N steps and at the end; 0 writes only at a stop_after stop."""
    resume: str | None = None
    """Checkpoint directory to continue from, or 'latest' for the newest one under run_dir."""
    overwrite: bool = False
    """Replace the files of another run found in run_dir (only files Sleuth writes) instead of
    refusing to train there."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and schedule."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA fine-tuning."""

    def __post_init__(self) -> None:
        _positive(self, "steps", "batch_size", "grad_accum", "log_every", "eval_batches")
        if self.eval_every < 0 or self.checkpoint_every < 0:
            raise ConfigError("eval_every and checkpoint_every must be >= 0 (0 turns them off)")
        if self.stop_after is not None and not 0 < self.stop_after <= self.steps:
            raise ConfigError(f"stop_after={self.stop_after} must be in [1, steps={self.steps}]")
        if self.data.seq_len > self.model.block_size:
            raise ConfigError(f"data.seq_len={self.data.seq_len} exceeds model.block_size="
                              f"{self.model.block_size}; lower seq_len or raise block_size")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready nested dict (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Build from a nested dict; unknown keys raise ConfigError with a suggestion."""
        return _build(cls, data, "")

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        """Read a JSON file of nested keys (all optional) on top of the defaults."""
        return cls.from_dict(_read_json(path))


def tiny() -> TrainConfig:
    """A 2-layer, 64-wide GPT on 64-byte sequences: a step takes milliseconds on a CPU."""
    return TrainConfig(name="tiny")


def small() -> TrainConfig:
    """A 4-layer, 256-wide GPT on 256-byte sequences: minutes of CPU for a visible loss drop."""
    return TrainConfig(
        name="small", steps=200, batch_size=16, eval_every=50, checkpoint_every=100,
        model=ModelConfig(block_size=256, n_layer=4, n_head=4, n_embd=256, dropout=0.1),
        data=DataConfig(seq_len=256), optim=OptimConfig(lr=6e-4, min_lr=6e-5, warmup_steps=20),
    )


PRESETS = {"tiny": tiny, "small": small}


def load_config(path: str | Path | None = None, *, preset: str = "tiny",
                overrides: Iterable[str] = (), run_dir: str | None = None,
                resume: str | None = None) -> TrainConfig:
    """Preset, then the JSON file at `path` (any subset of keys), then `key.sub=value` overrides,
    then `run_dir` and `resume` when given (the command lines' --run-dir and --resume).

    Raises:
        ConfigError: unknown preset or key (with the closest name), a value of the wrong type,
            or a file that is not a JSON object.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}{_suggest(preset, PRESETS)}; choose from {sorted(PRESETS)}")
    merged = PRESETS[preset]().to_dict()
    if path is not None:
        _merge(merged, _read_json(path))
    overrides = list(overrides)
    if run_dir:
        overrides.append(f"run_dir={run_dir}")
    if resume:
        overrides.append(f"resume={resume}")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (for example optim.lr=1e-3)")
        _set_dotted(merged, key.strip(), _parse_value(raw))
    return TrainConfig.from_dict(merged)


# --- building nested dataclasses with type checks --------------------------------------------

def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown key '{prefix}{key}'{_suggest(prefix + key, [prefix + n for n in names])}")
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    try:
        return cls(**kwargs)
    except TypeError as e:  # only reachable through programming errors: fields are all defaulted
        raise ConfigError(str(e)) from e


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not one of {list(args)}{_suggest(str(value), map(str, args))}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_coerce(v, args[0], key) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):  # NaN passes every `<` check below it, so it never fails
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise AssertionError(f"unhandled config type {tp!r} for {key}")


def _parse_value(raw: str) -> Any:
    raw = raw.strip()
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # a bare string such as a file name


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    node, parts = tree, key.split(".")
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if part not in node:
            candidates = [".".join(parts[:i] + [k]) for k in node]
            raise ConfigError(f"unknown key '{here}'{_suggest(here, candidates)}")
        if i == len(parts) - 1:
            if isinstance(node[part], dict):
                raise ConfigError(f"'{here}' is a section; set one of its keys, e.g. {here}.{next(iter(node[part]))}")
            node[part] = value
        elif not isinstance(node[part], dict):
            raise ConfigError(f"'{here}' is not a section, so '{key}' does not exist")
        else:
            node = node[part]


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value  # unknown keys survive here and are reported by from_dict


def _read_json(path: str | Path) -> dict[str, Any]:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen:  # json keeps the last one silently: the user meant one of them
                raise ConfigError(f"config file {path}: key {key!r} appears twice; keep one")
            seen.add(key)
        return dict(items)

    try:
        data = json.loads(_read_regular_file(path), object_pairs_hook=pairs)
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path} does not exist") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object, got {type(data).__name__}")
    return data


_MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""A config file is kilobytes; past this it is not one (the tools' JSON readers use the same)."""


def _read_regular_file(path: str | Path) -> str:
    """The text of the config file at `path`, refusing what is not a regular file of bounded
    size: `/dev/zero` would be read until memory runs out, a FIFO would block forever.

    The trainer imports none of the tools, so this is its own small check (the tools share
    `tracer.storage.read_text_bounded`)."""
    st = os.stat(path)  # FileNotFoundError is reported by the caller
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"config file {path} is not a regular file (a device, FIFO or folder); "
                          "give the path of a JSON file")
    with open(path, "rb") as f:
        data = f.read(_MAX_CONFIG_BYTES + 1)
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {_MAX_CONFIG_BYTES:,} bytes; it is "
                          "not a config file")
    return data.decode("utf-8")


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


_SECTIONS = {"ModelConfig": "model.", "DataConfig": "data.", "OptimConfig": "optim.", "LoRAConfig": "lora."}


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ConfigError(f"{_SECTIONS.get(type(obj).__name__, '')}{name}={value} must be > 0")


def _fraction(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{_SECTIONS.get(type(obj).__name__, '')}{name}={value} must be in [0, 1)")
