"""Profile a few steps of a model we did not write, with or without a slowdown injected.

Run as a script (`python slow_models.py KIND VARIANT RUN_DIR`) so that two runs can be profiled
at the same time, sharing one machine's load; test_profiler_diff_models.py compares them.

KIND: `llama` (Hugging Face Llama built from a config; the slowdown: gradient checkpointing
turned on, so backward recomputes each layer's forward) or `gpt2` (Hugging Face GPT-2 from a
config; the slowdown: the logits upcast to float64 for a log-softmax by a forward hook, a new
cast). VARIANT: `base` or `slow`.
"""
from __future__ import annotations

import sys

import torch

import profiler


def upcast_logits(module, inputs, output):
    return output.double().log_softmax(-1).float()  # the injected slowdown: a float64 cast


def build(kind: str, slow: bool):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
            use_cache=False))
        if slow:
            model.gradient_checkpointing_enable()
        batch = torch.randint(0, 256, (4, 32))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_embd=64, n_layer=2, n_head=4,
                                           n_positions=64, bos_token_id=0, eos_token_id=0))
        if slow:
            model.lm_head.register_forward_hook(upcast_logits)
        batch = torch.randint(0, 8192, (8, 32))
    return model.train(), batch


def main(kind: str, variant: str, run_dir: str) -> None:
    torch.set_num_threads(1)  # two runs share the machine: one thread each
    model, batch = build(kind, variant == "slow")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = profiler.CollectorConfig(wait=1, warmup=2, active=12, with_stack=True,
                                   count_flops=False)
    with profiler.Collector(run_dir, config=cfg) as collector:
        for _ in range(15):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            collector.step()


if __name__ == "__main__":
    main(*sys.argv[1:4])
