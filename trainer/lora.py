"""LoRA: low-rank adapters on chosen Linear layers, freezing, saving, loading and merging.

`apply_lora` replaces each matching `nn.Linear` with a `LoRALinear` that keeps the original
layer as `.base` and adds `scale * B @ A` with `A` random and `B` zero (so training starts from
the base model's output). Adapter files are plain state dicts saved with `torch.save` and read
with `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch
import torch.nn as nn

from trainer._errors import CheckpointError, ConfigError
from trainer.config import LoRAConfig

ADAPTER_FORMAT_VERSION = 1


class LoRALinear(nn.Module):
    """`base(x) + (dropout(x) @ A.T @ B.T) * alpha / rank`, with `base` frozen."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.lora_dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scale

    def merged(self) -> nn.Linear:
        """A plain Linear whose weight includes the adapter's update."""
        out = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None,
                        device=self.base.weight.device, dtype=self.base.weight.dtype)
        with torch.no_grad():
            out.weight.copy_(self.base.weight + (self.lora_B @ self.lora_A) * self.scale)
            if self.base.bias is not None:
                out.bias.copy_(self.base.bias)
        return out


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def apply_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Wrap Linear layers whose dotted name matches `config.targets` (re.search); freeze the rest.

    Returns the wrapped module names.

    Raises:
        ConfigError: the regex is invalid or matches no Linear layer (the message lists them).
    """
    try:
        pattern = re.compile(config.targets)
    except re.error as e:
        raise ConfigError(f"lora.targets={config.targets!r} is not a valid regex: {e}") from e
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    chosen = [n for n in linears if pattern.search(n)]
    if not chosen:
        raise ConfigError(f"lora.targets={config.targets!r} matches no Linear layer; "
                          f"names look like {linears[:6]}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        base = model.get_submodule(name)
        _set_submodule(model, name, LoRALinear(base, rank=config.rank, alpha=config.alpha,
                                               dropout=config.dropout))
    return chosen


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, keyed by their names in the model."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if k.endswith(".lora_A") or k.endswith(".lora_B")}


def adapter_blob(model: nn.Module) -> dict:
    """What an adapter file holds: format version, adapter tensors, per-layer (rank, alpha)."""
    meta = {n: torch.tensor([m.rank, m.alpha], dtype=torch.float64)
            for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    return {"format_version": ADAPTER_FORMAT_VERSION, "adapters": lora_state_dict(model), "rank_alpha": meta}


def save_lora(model: nn.Module, path: str | Path) -> Path:
    """Write the adapters (plus their rank and alpha) atomically to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        torch.save(adapter_blob(model), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    return path


def load_lora(model: nn.Module, path: str | Path) -> None:
    """Load adapters saved by `save_lora` into a model that `apply_lora` already wrapped.

    Raises:
        CheckpointError: the file is missing, of another format, or its adapters do not fit.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"adapter file {path} does not exist")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if blob.get("format_version") != ADAPTER_FORMAT_VERSION:
        raise CheckpointError(f"{path} is adapter format {blob.get('format_version')}, expected "
                              f"{ADAPTER_FORMAT_VERSION}")
    expected = lora_state_dict(model)
    missing = sorted(set(expected) - set(blob["adapters"]))
    extra = sorted(set(blob["adapters"]) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{path} does not fit this model: missing {missing[:4]}, unexpected "
                              f"{extra[:4]}; apply_lora with the same targets first")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for k, v in blob["adapters"].items():
            if params[k].shape != v.shape:
                raise CheckpointError(f"{path}: {k} has shape {tuple(v.shape)}, model has "
                                      f"{tuple(params[k].shape)} (different lora.rank?)")
            params[k].copy_(v)


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by a plain Linear holding base + update; returns the model."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            _set_submodule(model, name, module.merged())
    return model
