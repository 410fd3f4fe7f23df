"""A nanoGPT-style training script: a tiny GPT on synthetic tokens, written the way nanoGPT's
train.py is (gradient accumulation, fp16 autocast with a GradScaler, gradient clipping, an
evaluation before the first step), with its DDP (torchrun), FSDP2 and torch.compile options.

    python nanogpt.py                                  # 3 optimizer steps on one process
    torchrun --nproc_per_node=2 nanogpt.py             # DDP over 2 processes (gloo)
    torchrun --nproc_per_node=2 nanogpt.py --fsdp      # FSDP2 (fully_shard) instead of DDP
    python nanogpt.py --compile inductor               # torch.compile with that backend
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
from torch import nn
from torch.nn import functional as F

from _compat import nan_now, save, set_step

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 64, 16, 32, 2, 2


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * EMBD, EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gelu(self.c_fc(x))
        if nan_now():
            h = torch.sqrt(h - 1e4)  # compat: NaN
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.wpe = nn.Embedding(BLOCK, EMBD)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard), not DDP")
    parser.add_argument("--compile", choices=["eager", "inductor"], help="torch.compile backend")
    parser.add_argument("--no-amp", action="store_true", help="no fp16 autocast, no GradScaler")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = 0
    if distributed:
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    raw = GPT()
    model: nn.Module = raw
    if distributed and args.fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in raw.h:
            fully_shard(block)
        fully_shard(raw)
    elif distributed:
        model = nn.parallel.DistributedDataParallel(raw)
    if args.compile:
        model = torch.compile(model, backend=args.compile)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2, weight_decay=0.1)
    amp = not args.no_amp
    ctx = torch.autocast("cpu", dtype=torch.float16) if amp else contextlib.nullcontext()
    scaler = torch.amp.GradScaler("cpu", enabled=amp)

    data = torch.randint(VOCAB, (4096,), generator=torch.Generator().manual_seed(7))
    batches = torch.Generator().manual_seed(1 + rank)  # each rank its own batches

    def get_batch(batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - BLOCK - 1, (batch_size,), generator=batches)
        x = torch.stack([data[i:i + BLOCK] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])
        return x, y

    @torch.no_grad()
    def estimate_loss() -> float:
        model.eval()
        x, y = get_batch()
        with ctx:
            _, loss = model(x, y)
        model.train()
        return loss.item()

    for it in range(args.steps):
        if it == 0:  # nanoGPT evaluates at iter 0, before the first optimizer step
            eval_loss = estimate_loss()
            if rank == 0:
                print(f"eval before step 0: loss {eval_loss:.4f}", flush=True)
        set_step(it)
        for micro in range(args.accum):
            if distributed and not args.fsdp:  # all-reduce on the last micro-step only
                model.require_backward_grad_sync = micro == args.accum - 1
            x, y = get_batch()
            with ctx:
                _, loss = model(x, y)
                loss = loss / args.accum
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {it} loss {loss.item() * args.accum:.4f}", flush=True)

    save(raw, args.steps, rank)
    if distributed:
        # a last collective before the group goes (docs/frameworks.md: a hang at exit)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
