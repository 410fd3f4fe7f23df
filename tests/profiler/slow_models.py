"""Profile a few steps of a model we did not write, with or without a slowdown injected.

Run as a script (`python slow_models.py KIND RUN_A RUN_B`): the base run into RUN_A, then the
slowed one into RUN_B, in one process, so the two are timed under the same load one after the
other (two processes at once on a busy machine get unequal shares of it) and the interpreter,
torch and transformers start once; test_profiler_diff_models.py compares them.

KIND: `llama` (Hugging Face Llama built from a config; the slowdown: gradient checkpointing
turned on, so backward recomputes each layer's forward), `gpt2` (Hugging Face GPT-2 from a
config; the slowdown: the logits upcast to float64 for a log-softmax by a forward hook, a new
cast) or `resnet` (Hugging Face ResNet, a torchvision-style CNN, from a config; the slowdown:
a smaller batch, 2 images instead of 8, accumulated over 4 micro-batches to the same 8 a step,
as one does to fit memory).

`python slow_models.py zoo OUT CLASS...` profiles the Llama's base run into OUT/a, again into
OUT/a2 (a repeat of A's config, for the variation between runs), then each slowdown CLASS
into OUT/CLASS: `longer` (the sequence eight times as long: on so small a model the ops'
own overhead hides a smaller change), `python` (Python work between the ops after backward,
no op of its own). test_profiler_diff_zoo.py compares them.
"""
from __future__ import annotations

import sys

import torch

import profiler


def upcast_logits(module, inputs, output):
    return output.double().log_softmax(-1).float()  # the injected slowdown: a float64 cast


def python_work() -> int:
    """Pure Python between ops, as a loop over a list or a log line's formatting is: no op,
    and one frame (a generator's every step would be a profiled Python event of its own)."""
    total = 0
    for i in range(400_000):
        total += i * i % 7
    return total


def build(kind: str, slow: bool, seq: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
            use_cache=False))
        if slow:
            model.gradient_checkpointing_enable()
        batch = torch.randint(0, 256, (4, seq))
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


def main(kind: str, run_a: str, run_b: str) -> None:
    torch.set_num_threads(1)  # the suite runs beside: one thread
    for slow, run_dir in ((False, run_a), (True, run_b)):
        if kind == "resnet":
            resnet(slow, run_dir)
        else:
            train(kind, slow, run_dir)


def zoo(out: str, *classes: str) -> None:
    torch.set_num_threads(1)
    train("llama", False, f"{out}/a")
    train("llama", False, f"{out}/a2")
    for name in classes:
        if name not in ("longer", "python"):
            raise SystemExit(f"unknown zoo class {name!r}: longer or python")
        train("llama", False, f"{out}/{name}", seq=256 if name == "longer" else 32,
              python=name == "python")


def train(kind: str, slow: bool, run_dir: str, seq: int = 32, python: bool = False) -> None:
    model, batch = build(kind, slow, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # five profiled steps a run: a rank test of 5 against 5 steps fully apart has p = 0.004
    cfg = profiler.CollectorConfig(wait=0, warmup=1, active=5, with_stack=True,
                                   count_flops=False)
    with profiler.Collector(run_dir, config=cfg) as collector:
        for _ in range(6):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            if python:
                python_work()  # the zoo's injected slowdown: Python work between ops
            opt.step()
            opt.zero_grad()
            collector.step()


if __name__ == "__main__":
    if sys.argv[1] == "zoo":
        zoo(*sys.argv[2:])
    else:
        main(*sys.argv[1:4])
