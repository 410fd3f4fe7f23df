"""The training-step zoo: the bugs people ship around the model (optimizer settings, parameter
groups, a scheduler one step off, clipping, frozen parameters, buffers, config constants,
dropout, seeds, accumulation, gradients cleared between micro-batches, labels, token ids edited
in place, data order, gradients edited by hand), one in run B, at
a site and value a seeded generator picks, on three model families (a plain token MLP, and a
Llama and a GPT-2 built from configs at the installed transformers release) with AdamW or SGD
with momentum.

`train` is one training run written out as a user writes it: build, optimizer with a decay and
a no-decay group, a scheduler, two steps of two micro-batches, clipping, the optimizer step;
each fault is a marked line (`# FAULT: name`) or an argument B builds with. `Expect` says what
`sleuth explain` must answer and what its verdict must name.
"""
from __future__ import annotations

import logging
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fault_zoo
import torch
from fault_zoo import marked_line
from torch import nn
from torch.nn import functional as F

VOCAB, BATCH, SEQ = 64, 2, 8


class TokenMLP(nn.Module):
    """A plain PyTorch language model: embedding, MLP block with a norm and dropout, head, and
    a buffer its forward reads."""

    def __init__(self, eps: float = 1e-5, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.block = nn.ModuleDict({"fc": nn.Linear(32, 64), "norm": nn.LayerNorm(64, eps=eps),
                                    "drop": nn.Dropout(dropout), "out": nn.Linear(64, 32)})
        self.head = nn.Linear(32, VOCAB)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 32))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * self.scale
        b = self.block
        h = h + b["out"](b["drop"](F.gelu(b["norm"](b["fc"](h)))))
        return self.head(h)


def _llama(**over: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager", **over))


def _gpt2(**over: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32,
           "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0,
           "eos_token_id": 0, "attn_implementation": "eager", **over}
    return GPT2LMHeadModel(GPT2Config(**cfg))


FAMILIES = {"mlp": TokenMLP, "llama": _llama, "gpt2": _gpt2}
# the config constant and the dropout probability each family's config (or constructor) takes
CONSTANT = {"mlp": {"eps": 1e-2}, "llama": {"rms_norm_eps": 1e-2},
            "gpt2": {"layer_norm_epsilon": 1e-2}}
DROPOUT = {"mlp": {"dropout": 0.2}, "llama": {"attention_dropout": 0.2},
           "gpt2": {"attn_pdrop": 0.2}}
OPTIMIZERS = ("adamw", "sgd")
# hyperparameters the generator may change, and B's value
HYPER = {"adamw": {"eps": 1e-3, "betas": (0.8, 0.9)},
         "sgd": {"momentum": 0.5, "dampening": 0.3, "nesterov": True}}


@dataclass(frozen=True)
class Expect:
    status: str
    """explain's status."""
    setup: bool
    """diff's changes begin with a setup difference (and only then)."""
    op_line: bool = False
    """a bug blamed at the fault's marked line (an op B adds or lacks there)."""


FAULTS: dict[str, Expect] = {
    "hyper": Expect("setup", True),
    "group_decay": Expect("setup", True),
    "group_moved": Expect("setup", True),
    "scheduler": Expect("setup", True),
    "clip_only_b": Expect("setup", True),
    "clip_norm": Expect("setup", True),
    "frozen": Expect("setup", True),
    # frozen, dumped in its first step alone: the weights still agree, and the runs part only
    # where the frozen weight's gradient is missing (the ops that make it, the clipping call
    # given one gradient fewer, the optimizer step), or nowhere both runs record
    "frozen_clipped": Expect("setup", True),
    "frozen_first": Expect("setup", True),
    "buffer": Expect("setup", True),
    "dropout": Expect("setup", True),
    "seed": Expect("setup", True),
    "constant": Expect("bug", True),
    "accumulation": Expect("bug", False, op_line=True),
    "labels": Expect("bug", False, op_line=True),
    # token ids remapped in place before the forward (an ignore index mapped to a real token)
    "ids_edited": Expect("bug", False, op_line=True),
    "grad_edit": Expect("bug", False, op_line=True),
    # the output head and the input embedding made one tensor at runtime (or, where the
    # config ties them, made two)
    "tied": Expect("setup", True),
    # gradients cleared between the two micro-batches of a step: the first one's are lost, and
    # A's backward adds into them where B's sets them (no op of B's marks the clearing)
    "cleared_between": Expect("bug", False),
    "data_order": Expect("inputs", False),
    # a forward pre-hook that scales a projection's weight in place
    "inplace_hook": Expect("bug", False, op_line=True),
    # a forward pre-hook that scales a buffer in place (a running statistic updated in B only):
    # the write at its line; that the buffers differ as the next step begins is the write's
    # doing, no setup of the run's
    "buffer_written": Expect("bug", False, op_line=True),
    # B's forward under bfloat16 autocast: rounding alone, then with a bug inside it
    "bf16": Expect("precision", False),
    "bf16_bug": Expect("bug", False, op_line=True),
    # under bfloat16 autocast, a gradient hook that halves a weight's gradient: a bug only the
    # backward has
    "bf16_grad_hook": Expect("bug", False, op_line=True),
    # B's forward under float16 autocast with a GradScaler (the setup: a scaler in B only),
    # rounding alone, then with a bug inside it
    "fp16": Expect("precision", True),
    "fp16_bug": Expect("bug", True, op_line=True),
    # a GradScaler in B alone, in float32: the loss and the gradients scaled, the updates alike
    "scaler_only": Expect("setup", True),
}
NEEDS_BUFFER = {"buffer", "buffer_written"}


class Case(fault_zoo.Case):
    """(family, fault class, level), as the fault zoo's, with the optimizer the generator picks."""

    @property
    def optimizer(self) -> str:
        return OPTIMIZERS[zlib.crc32(f"{self.family}/{self.fault}".encode()) % 2]

    @property
    def clips(self) -> bool:
        """Whether both runs clip their gradients (max_norm 0.5), as run A of these classes."""
        return self.fault in ("clip_norm", "frozen_clipped")

    @property
    def steps(self) -> int:
        """Training steps: a changed beta, momentum or dampening leaves the first update as it
        was (bias correction, the first momentum buffer): it shows from the second step's
        update, in the third's forward at level op."""
        return 3 if self.fault == "hyper" else 2

    @property
    def dumped(self) -> str:
        return "0" if self.fault in ("frozen_clipped", "frozen_first") else f"0-{self.steps - 1}"

    @property
    def id(self) -> str:
        return f"{self.family}-{self.fault}-{self.optimizer}-{self.level}"


def _pick(names: list[str], case: Case) -> str:
    return random.Random(zlib.crc32(case.id.encode())).choice(sorted(names))


def fault_line(fault: str) -> int:
    """The line of this file marked `# FAULT: fault`."""
    return marked_line(__file__, fault)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _scale_weight(module: nn.Module, args: Any) -> None:
    with torch.no_grad():
        module.weight.mul_(1.05)  # FAULT: inplace_hook


def _scale_buffer(name: str) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        with torch.no_grad():
            module.get_buffer(name).mul_(1.05)  # FAULT: buffer_written
    return hook


def _scale_output(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 1.5  # FAULT: bf16_bug


def _halve(grad: torch.Tensor) -> torch.Tensor:
    return grad * 0.5  # FAULT: bf16_grad_hook


def _shift_output(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out + 0.5  # FAULT: fp16_bug


def train(case: Case, faulty: bool, path: Path) -> dict[str, Any]:
    """Two dumped training steps of `case.family` (B: `faulty`, with `case.fault`); returns
    what the generator picked (`site`, `key`, `value`)."""
    import tracer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    fault = case.fault if faulty else ""
    torch.manual_seed(0)
    over = {**(CONSTANT[case.family] if fault == "constant" else {}),
            **(DROPOUT[case.family] if fault == "dropout" else {})}
    model = FAMILIES[case.family](**over)
    picked: dict[str, Any] = {}
    names = [n for n, _ in model.named_parameters()]
    no_decay = [n for n in names if n.endswith("bias") or "norm" in n or "ln_" in n]
    if case.fault == "group_moved":
        # weight decay does nothing to a parameter that is all zeros (a fresh bias)
        picked["site"] = _pick([n for n in no_decay if model.get_parameter(n).any()], case)
        if fault:
            no_decay.remove(picked["site"])  # FAULT: group_moved
    if case.fault in ("frozen", "frozen_clipped", "frozen_first"):
        picked["site"] = _pick([n for n in names if any(c.isdigit() for c in n.split("."))]
                               or names, case)
        if fault:
            model.get_parameter(picked["site"]).requires_grad_(False)  # FAULT: frozen
    if case.fault == "buffer":
        # a buffer the forward reads (transformers keeps an unread copy of the rotary one)
        picked["site"] = _pick([n for n, b in model.named_buffers() if b.is_floating_point()
                                and "original" not in n], case)
        if fault:
            with torch.no_grad():
                model.get_buffer(picked["site"]).mul_(1.05)  # FAULT: buffer
    if case.fault == "buffer_written":
        picked["site"] = _pick([n for n, b in model.named_buffers() if b.is_floating_point()
                                and "original" not in n], case)
        if fault:
            model.register_forward_pre_hook(_scale_buffer(picked["site"]))
    if case.fault in ("inplace_hook", "bf16_bug", "fp16_bug", "bf16_grad_hook"):
        linear = [n for n, m in model.named_modules()
                  if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
        picked["site"] = _pick([n for n in linear if any(c.isdigit() for c in n.split("."))]
                               or linear, case)
        if fault == "inplace_hook":
            model.get_submodule(picked["site"]).register_forward_pre_hook(_scale_weight)
        elif fault == "bf16_bug":
            model.get_submodule(picked["site"]).register_forward_hook(_scale_output)
        elif fault == "fp16_bug":
            model.get_submodule(picked["site"]).register_forward_hook(_shift_output)
        elif fault == "bf16_grad_hook":
            model.get_submodule(picked["site"]).weight.register_hook(_halve)
    if fault == "tied":
        if case.family == "gpt2":  # tied by its config: B unties them
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        else:
            head, embed = ("head", "embed") if case.family == "mlp" else \
                ("lm_head", "model.embed_tokens")
            model.get_submodule(head).weight = model.get_submodule(embed).weight  # FAULT: tied
    names = [n for n, _ in model.named_parameters()]
    no_decay = [n for n in no_decay if n in names]
    params = dict(model.named_parameters())
    groups = [{"params": [params[n] for n in names if n not in no_decay], "weight_decay": 0.1},
              {"params": [params[n] for n in no_decay],
               "weight_decay": 0.2 if fault == "group_decay" else 0.0}]  # FAULT: group_decay
    hyper = {}
    if case.fault == "hyper":
        picked["key"] = _pick(sorted(HYPER[case.optimizer]), case)
        if fault:
            hyper[picked["key"]] = HYPER[case.optimizer][picked["key"]]
    if case.optimizer == "adamw":
        opt = torch.optim.AdamW(groups, **{"lr": 1e-2, **hyper})
    else:
        opt = torch.optim.SGD(groups, **{"lr": 1e-2, "momentum": 0.9, **hyper})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if fault == "scheduler":
        sched.step()  # FAULT: scheduler
    torch.manual_seed(1 if fault == "seed" else 0)  # FAULT: seed
    steps = case.steps
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ)) for _ in range(2 * steps)]
    low = {"bf16": torch.bfloat16, "bf16_bug": torch.bfloat16, "bf16_grad_hook": torch.bfloat16,
           "fp16": torch.float16, "fp16_bug": torch.float16}.get(fault)
    # float16 needs its loss scaled (a scaler off in every other run does nothing)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10,
                                  enabled=low is torch.float16 or fault == "scaler_only")
    if fault == "data_order":
        batches = batches[2:] + batches[:2]  # FAULT: data_order
    with tracer.Dumper(model, {"path": str(path), "level": case.level, "mode": "tensor",
                               "steps": case.dumped}):
        for step in range(steps):
            for micro in batches[2 * step:2 * step + 2]:
                if fault == "ids_edited":
                    micro[micro < 8] = 0  # FAULT: ids_edited
                with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
                    logits = _logits(model, micro).float()
                if fault == "labels":
                    loss = F.cross_entropy(logits.reshape(-1, VOCAB), micro.reshape(-1))  # FAULT: labels
                else:
                    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                           micro[:, 1:].reshape(-1))
                if fault != "accumulation":
                    loss = loss / 2  # FAULT: accumulation
                scaler.scale(loss).backward()
                if fault == "cleared_between" and micro is batches[2 * step]:
                    opt.zero_grad()  # FAULT: cleared_between
            if fault == "grad_edit":
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)  # FAULT: grad_edit
            if fault == "clip_norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # FAULT: clip_norm
            elif case.clips or fault == "clip_only_b":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # FAULT: clip_only_b
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            sched.step()
    return picked


def families_for(fault: str) -> list[str]:
    """The families a fault class applies to (a buffer needs a model that has one)."""
    if fault in NEEDS_BUFFER:
        return ["mlp", "llama"]
    return list(FAMILIES)
