"""Profile a few steps of a model we did not write, with or without a slowdown injected.

Run as a script (`python slow_models.py KIND VARIANT RUN_DIR`) so that two runs can be profiled
at the same time, sharing one machine's load; test_profiler_diff_models.py compares them.

KIND: `llama` (Hugging Face Llama built from a config; the slowdown: gradient checkpointing
turned on, so backward recomputes each layer's forward), `gpt2` (Hugging Face GPT-2 from a
config; the slowdown: the logits upcast to float64 for a log-softmax by a forward hook, a new
cast) or `resnet` (Hugging Face ResNet, a torchvision-style CNN, from a config; the slowdown:
a smaller batch, 2 images instead of 8, accumulated over 4 micro-batches to the same 8 a step,
as one does to fit memory). VARIANT: `base` or `slow`.
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


def resnet(slow: bool, run_dir: str) -> None:
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        num_labels=10)).train()
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    micro = 2 if slow else 8  # the injected slowdown: a smaller batch, accumulated
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    cfg = profiler.CollectorConfig(wait=0, warmup=1, active=5, with_stack=True,
                                   count_flops=False)
    with profiler.Collector(run_dir, config=cfg) as collector:
        for _ in range(6):
            for i in range(0, 8, micro):
                out = model(pixel_values=images[i:i + micro], labels=labels[i:i + micro])
                (out.loss * micro / 8).backward()
            opt.step()
            opt.zero_grad()
            collector.step()


def main(kind: str, variant: str, run_dir: str) -> None:
    torch.set_num_threads(1)  # two runs share the machine: one thread each
    if kind == "resnet":
        return resnet(variant == "slow", run_dir)
    model, batch = build(kind, variant == "slow")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = profiler.CollectorConfig(wait=1, warmup=1, active=8, with_stack=True,
                                   count_flops=False)
    with profiler.Collector(run_dir, config=cfg) as collector:
        for _ in range(10):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            collector.step()


if __name__ == "__main__":
    main(*sys.argv[1:4])
