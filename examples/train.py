"""A plain PyTorch training loop, written as a user would, with nothing of Sleuth in it.

The docs' examples run Sleuth on this script to show that the tools attach to any script
unmodified (`sleuth run -- python examples/train.py`, or the SLEUTH_* variables):

    python examples/train.py                          # 8 steps of a small MLP, a few seconds
    python examples/train.py --nan-at 2               # a bug: step 2 writes a NaN into a weight
    python examples/train.py --grow 16                # a bug: fc1's weight compounds, x16 a step
    python examples/train.py --swap-halves            # a bug: fc1's output units come swapped
    python examples/train.py --port                   # the same MLP written another way
    python examples/train.py --norm-eps 1e-2          # a bug: the LayerNorm's epsilon misread
    python examples/train.py --no-act                 # a bug: the activation left out
    python examples/train.py --bf16                   # not a bug: the forward in bf16 autocast
    python examples/train.py --scale-hook 1.001       # a bug: a pre-hook scales fc2's weight
    python examples/train.py --write-buffer 1.05      # a bug: a pre-hook scales a buffer
    python examples/train.py --fp16                   # float16 autocast with a GradScaler
    python examples/train.py --data-seed 2            # not a bug: other batches
    python examples/train.py --check-finite           # slower: a host sync per gradient a step
    python examples/train.py --recompute              # slower: the forward recomputed in backward
    torchrun --nproc_per_node=2 examples/train.py     # DDP over 2 processes (gloo on a CPU)
"""
from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    def __init__(self, act: bool = True, out_buffer: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.act = nn.GELU() if act else nn.Identity()
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 1)
        if out_buffer:  # a scale kept as a buffer, as a running statistic is
            self.register_buffer("out_scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(self.norm(self.act(self.fc1(x))))
        return out * self.out_scale if hasattr(self, "out_scale") else out


class PortedNet(nn.Module):
    """The same MLP as another codebase would write it: other names, the layers in a list."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64)])
        self.head = nn.Linear(64, 1)
        for mine, theirs in zip([*self.layers, self.head],
                                [net.fc1, net.act, net.norm, net.fc2]):
            mine.load_state_dict(theirs.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a small MLP on a synthetic regression.")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    parser.add_argument("--nan-at", type=int, metavar="STEP",
                        help="write a NaN into fc1.weight at this step (a bug to find)")
    parser.add_argument("--grow", type=float, metavar="FACTOR",
                        help="multiply fc1.weight by FACTOR after every step, a scale that "
                        "compounds (a bug to find before it overflows)")
    parser.add_argument("--swap-halves", action="store_true",
                        help="swap the two halves of fc1's output units when the model is built, "
                        "as a weight conversion that permutes rows does (a bug to find)")
    parser.add_argument("--norm-eps", type=float, metavar="EPS",
                        help="the LayerNorm's epsilon (default 1e-5; another value is a bug to "
                        "find, as a port that misreads a config)")
    parser.add_argument("--no-act", action="store_true",
                        help="leave the activation out, as a port that forgets it does (a bug "
                        "to find: an op one run runs and the other does not)")
    parser.add_argument("--adam-eps", type=float, default=1e-8, metavar="EPS",
                        help="AdamW's epsilon (default 1e-8; another value is a setup "
                        "difference to find)")
    parser.add_argument("--clip", type=float, metavar="MAX_NORM",
                        help="clip the gradients' norm to MAX_NORM before each optimizer step "
                        "(in one run only, a setup difference to find)")
    parser.add_argument("--bf16", action="store_true",
                        help="run the forward pass under bfloat16 autocast (rounding, not a bug)")
    parser.add_argument("--scale-hook", type=float, metavar="FACTOR",
                        help="a forward pre-hook on fc2 that multiplies its weight by FACTOR in "
                        "place at every call (a bug to find: a weight written during the step)")
    parser.add_argument("--out-buffer", action="store_true",
                        help="keep an output scale of 1 as a buffer the forward multiplies by")
    parser.add_argument("--write-buffer", type=float, metavar="FACTOR",
                        help="with --out-buffer: a forward pre-hook that multiplies that buffer "
                        "by FACTOR in place at every call (a bug to find: a buffer written "
                        "during the step)")
    parser.add_argument("--fp16", action="store_true",
                        help="run the forward pass under float16 autocast, its loss scaled by a "
                        "GradScaler (unscaled before clipping)")
    parser.add_argument("--data-seed", type=int, default=1, metavar="SEED",
                        help="the seed of the batches (default 1; another draws other data)")
    parser.add_argument("--check-finite", action="store_true",
                        help="check every gradient for NaN/Inf with .item() each step: a host "
                        "sync per parameter (a slowdown to find)")
    parser.add_argument("--recompute", action="store_true",
                        help="checkpoint the forward so backward recomputes it (a slowdown to "
                        "find)")
    parser.add_argument("--port", action="store_true",
                        help="train the same MLP, with the same weights, as another codebase "
                        "writes it (other module names)")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = 0
    if distributed:  # started by torchrun
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = Net(act=not args.no_act, out_buffer=args.out_buffer or args.write_buffer is not None)
    if args.port:
        net = PortedNet(net)
    fc1 = net.layers[0] if args.port else net.fc1
    if args.norm_eps is not None:
        (net.layers[2] if args.port else net.norm).eps = args.norm_eps
    if args.swap_halves:
        with torch.no_grad():
            for p in (fc1.weight, fc1.bias):
                p.copy_(p.roll(32, dims=0))
    if args.scale_hook is not None:
        def scale(module: nn.Module, inputs: tuple) -> None:
            with torch.no_grad():
                module.weight.mul_(args.scale_hook)

        (net.head if args.port else net.fc2).register_forward_pre_hook(scale)
    if args.write_buffer is not None:
        def write(module: nn.Module, inputs: tuple) -> None:
            with torch.no_grad():
                module.out_scale.mul_(args.write_buffer)

        net.register_forward_pre_hook(write)
    model = nn.parallel.DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.adam_eps)
    data = torch.Generator().manual_seed(args.data_seed + rank)  # each rank its own batches
    # float16 needs its loss scaled, or small gradients underflow to zero
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=args.fp16)
    low = torch.float16 if args.fp16 else torch.bfloat16

    for step in range(args.steps):
        x = torch.randn(32, 16, generator=data)
        y = x[:, :4].sum(dim=1, keepdim=True).sin()
        if step == args.nan_at:
            with torch.no_grad():
                fc1.weight[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=low, enabled=args.bf16 or args.fp16):
            if args.recompute:
                out = checkpoint(model, x, use_reentrant=False)
            else:
                out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if args.check_finite:
            for p in model.parameters():
                if not torch.isfinite(p.grad).all().item():
                    raise FloatingPointError("a gradient is not finite")
        if args.clip is not None:
            scaler.unscale_(optimizer)  # clip the gradients as they are, not scaled
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        if args.grow is not None:
            with torch.no_grad():
                fc1.weight.mul_(args.grow)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    if distributed:
        # a last collective before the group goes: gloo's worker thread frees the last
        # all-reduce of backward (whose saved thread state holds a Python object of torch's)
        # while this thread can still give it the GIL (docs/frameworks.md, "A hang at exit")
        torch.distributed.barrier()
        del model
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
