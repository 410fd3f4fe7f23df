"""The fault zoo: Hugging Face model families built from configs at the installed transformers
release, with one fault injected into run B at a site a seeded generator picks.

A `Case` is (family, fault class, level); `dump_pair` writes dump A (the reference code) and dump
B (the same code with the fault) of one forward and backward, and says where the fault sits: the
record scope of the site module, the phase, the line of this file that runs B's faulty op, and
the verdict `sleuth explain` must give. The tests (test_fault_zoo.py) hold diff, explain and
check to that. The injected code is written out here, not generated, so a failing case reads as
the plain PyTorch it runs.
"""
from __future__ import annotations

import logging
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

VOCAB, BATCH, SEQ = 64, 2, 8
TINY = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 32}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2,
                                        attn_implementation="eager"))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**TINY, num_key_value_heads=2, sliding_window=None,
                                            attn_implementation="eager"))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, attn_implementation="eager"))


def _bert():
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(**TINY, hidden_dropout_prob=0.0, type_vocab_size=2,
                                      attention_probs_dropout_prob=0.0,
                                      attn_implementation="eager"))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                                               num_layers=2, num_heads=4, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0,
                                               attn_implementation="eager"))


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": _llama, "mistral": _mistral, "gpt2": _gpt2, "bert": _bert, "t5": _t5}


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


# -- sites ------------------------------------------------------------------------------------

def _is_projection(m: nn.Module) -> bool:
    # nn.Linear, or GPT-2's Conv1D (a linear layer with its weight stored transposed)
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def _is_norm(m: nn.Module) -> bool:
    return "Norm" in type(m).__name__ and any(
        isinstance(getattr(m, a, None), float) for a in ("eps", "variance_epsilon"))


def pick_site(model: nn.Module, kind: str, seed: int) -> str:
    """The dotted name of a module of `kind` ("projection" or "norm") inside the model's blocks
    (a name with a layer number), picked by a seeded generator."""
    test = _is_norm if kind == "norm" else _is_projection
    names = [n for n, m in model.named_modules()
             if test(m) and any(part.isdigit() for part in n.split("."))]
    assert names, f"no {kind} site in {type(model).__name__}"
    return random.Random(seed).choice(sorted(names))


# -- faults: (site kind, explain's verdict, phase of the fault) ----------------------------------

@dataclass(frozen=True)
class Fault:
    site: str
    verdict: str
    phase: str = "forward"
    op: str | None = None


FAULTS: dict[str, Fault] = {
    "constant": Fault("norm", "bug"),
    "extra_forward": Fault("projection", "bug", op="aten.mul"),
    # an extra op that changes values by 1%, less than bfloat16's rounding, in a float32 run
    "extra_small": Fault("projection", "bug", op="aten.mul"),
    "dropped_op": Fault("projection", "bug", op="aten.mul"),
    "extra_backward": Fault("projection", "bug", phase="backward", op="aten.mul"),
    "swapped": Fault("projection", "bug", op="aten.sub"),
    "permutation": Fault("projection", "bug", op="aten.roll"),
    "dtype_island": Fault("projection", "precision"),
    "other_data": Fault("projection", "inputs"),
    # a NaN written into a mask the site's output is multiplied by
    "nan": Fault("projection", "bug"),
    # the site's module calls its twin of the other layer (weights shared by mistake)
    "two_places": Fault("projection", "bug"),
}


class _Grad(torch.autograd.Function):
    """Identity forward; backward scales the gradient by `scale` (1.0: no op at all)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.scale == 1.0:
            return g, None
        return g * ctx.scale, None  # FAULT: extra_backward


def _wrap(module: nn.Module, fault: str, faulty: bool) -> None:
    """Replace `module.forward` with the reference (faulty=False) or the faulty variant of the
    code `fault` names; each faulty line is marked `# FAULT: name` for the tests to find."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        if fault == "extra_forward":
            return out * 1.5 if faulty else out  # FAULT: extra_forward
        if fault == "extra_small":
            return out * 1.01 if faulty else out  # FAULT: extra_small
        if fault == "dropped_op":
            return out if faulty else out * 1.5  # FAULT: dropped_op
        if fault == "extra_backward":
            return _Grad.apply(out, 1.5 if faulty else 1.0)
        if fault == "swapped":
            mean = out.mean(-1, keepdim=True)
            if faulty:
                return torch.sub(mean, out)  # FAULT: swapped
            return torch.sub(out, mean)
        if fault == "permutation":
            return out.roll(1 if faulty else 0, -1)  # FAULT: permutation
        if fault == "dtype_island":
            return out.to(torch.bfloat16).to(out.dtype) if faulty else out  # FAULT: dtype_island
        if fault == "nan":
            mask = torch.ones_like(out)
            if faulty:
                mask.view(-1)[0] = float("nan")  # FAULT: nan
            return out * mask
        return out

    module.forward = forward  # type: ignore[method-assign]


def _inject(model: nn.Module, fault: str, site: str, faulty: bool) -> None:
    module = model.get_submodule(site)
    if fault == "constant":
        if faulty:
            attr = "eps" if isinstance(getattr(module, "eps", None), float) else "variance_epsilon"
            setattr(module, attr, 1e-1)
        return
    if fault == "two_places":
        if faulty:
            twin = model.get_submodule(_twin(site))
            module.forward = lambda *args, **kwargs: twin(*args, **kwargs)  # FAULT: two_places
        return
    if fault != "other_data":
        _wrap(module, fault, faulty)


def _twin(site: str) -> str:
    """The same module of the neighbouring block: `h.1.mlp.c_fc` for `h.0.mlp.c_fc`."""
    parts = site.split(".")
    i = min(k for k, part in enumerate(parts) if part.isdigit())
    parts[i] = "1" if parts[i] == "0" else "0"
    return ".".join(parts)


def marked_line(path: str | Path, fault: str) -> int:
    """The line of file `path` marked `# FAULT: fault`."""
    lines = Path(path).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.endswith(f"# FAULT: {fault}"))


def fault_line(fault: str) -> int:
    """The line of this file that holds `fault`'s faulty op (its `# FAULT:` mark)."""
    return marked_line(__file__, fault)


@dataclass(frozen=True)
class Case:
    family: str
    fault: str
    level: str  # "op" or "mix"

    @property
    def id(self) -> str:
        return f"{self.family}-{self.fault}-{self.level}"


@dataclass
class Pair:
    a: Path
    b: Path
    site: str
    """The site's dotted module name: records made inside it have this scope or one below."""
    fault: Fault
    line: int | None
    """The line of fault_zoo.py that runs B's faulty op (None where the fault is no op)."""


def dump_pair(case: Case, root: Path, seed: int = 0) -> Pair:
    """Dump one forward and backward of run A and of run B (A with `case.fault` at a site picked
    by `seed`) at `case.level`, mode tensor; the same weights and data unless the fault is
    other data."""
    import tracer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    fault = FAULTS[case.fault]
    site = None
    paths = []
    for side in ("a", "b"):
        torch.manual_seed(0)
        model = FAMILIES[case.family]()
        if site is None:
            site = pick_site(model, fault.site, zlib.crc32(f"{case.family}/{case.fault}/{seed}".encode()))
        _inject(model, case.fault, site, faulty=side == "b")
        data_seed = 2 if side == "b" and case.fault == "other_data" else 1
        ids = torch.randint(1, VOCAB, (BATCH, SEQ),
                            generator=torch.Generator().manual_seed(data_seed))
        path = root / f"{case.id}-{side}"
        with tracer.Dumper(model, {"path": str(path), "level": case.level, "mode": "tensor"}):
            _loss(model, ids).backward()
        paths.append(path)
    # a changed constant runs no op of its own: its records carry the line that called the model
    line = fault_line(case.fault) if fault.verdict == "bug" and case.fault != "constant" \
        else None
    assert site is not None
    return Pair(paths[0], paths[1], site, fault, line)


def in_site(module: str, site: str) -> bool:
    """True when a record scope lies in the site (the site itself, or a scope below it)."""
    return module == site or module.startswith(site + ".")
