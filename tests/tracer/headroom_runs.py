"""Models nobody here wrote, trained a few steps under the tracer with a fault that drives one
module toward the end of its dtype's range: Hugging Face GPT-2 and BERT built from configs
(nothing is downloaded), for `sleuth check --headroom`, its watch conditions and their tests.

- `gpt2_growing`: plain float16 parameters; after every optimizer step the weight of
  `transformer.h.1.mlp.c_fc` is doubled, so that layer's output grows by 1 bit a step toward
  float16's largest value (2^16), as a feedback loop or a compounding scale would make it.
- `bert_dying_relu`: float32, ReLU activations; after every optimizer step the bias of
  `bert.encoder.layer.1.intermediate.dense` is pushed down, so more and more of the ReLU's
  outputs are exactly zero (a dying ReLU).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import torch

import tracer

GROWING_MODULE = "transformer.h.1.mlp.c_fc"
DYING_MODULE = "bert.encoder.layer.1.intermediate.intermediate_act_fn"
GROWING = f"{GROWING_MODULE}.forward.0.output.0"
"""The record the growing fault drives toward overflow."""
DYING = f"{DYING_MODULE}.forward.0.output.0"
"""The record whose share of zeros the dying fault drives toward 1."""


def _quiet_transformers() -> None:
    # GPT-2's default bos/eos ids lie outside the tiny vocabulary; the ids are never used
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _train(model: torch.nn.Module, path: Path, steps: int, watch: Iterable[dict[str, Any]],
           fault: Any) -> Path:
    """`steps` SGD steps on one batch of token ids under a module-level statistics dump at
    `path`, calling `fault()` (None: no fault) after each optimizer step, outside autograd."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 8))
    dump = {"path": str(path), "level": "module", "mode": "statistics", "watch": list(watch)}
    with tracer.Dumper(model, dump):
        for _ in range(steps):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            if fault is not None:
                with torch.no_grad():
                    fault()
    return path


def gpt2_growing(path: Path, *, steps: int = 6, fault: bool = True,
                 watch: Iterable[dict[str, Any]] = ()) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config).half()
    weight = model.get_submodule(GROWING_MODULE).weight
    return _train(model, path, steps, watch, (lambda: weight.mul_(2)) if fault else None)


def bert_dying_relu(path: Path, *, steps: int = 6, fault: bool = True,
                    watch: Iterable[dict[str, Any]] = ()) -> Path:
    from transformers import BertConfig, BertForMaskedLM

    _quiet_transformers()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=16,
                        hidden_act="relu", hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(config)
    bias = model.get_submodule("bert.encoder.layer.1.intermediate.dense").bias
    return _train(model, path, steps, watch, (lambda: bias.sub_(0.02)) if fault else None)
