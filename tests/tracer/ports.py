"""Faithful ports of Hugging Face models, written as a user porting them would: their own module
names and containers, nn.Linear where GPT-2 has Conv1D (weights stored transposed), no dropout
modules at all, and the weights copied from the Hugging Face model. `sleuth map` must pair such
a port with the original module for module, so that the mapped diff of a faithful port is "same"
and a fault put in one block is named in that block.

`GPT2Port` mirrors GPT2LMHeadModel (tiny config, eager attention, every dropout p = 0);
`LlamaPort` mirrors LlamaForCausalLM with one fused `qkv` projection where Llama has q, k, v.
Both take a `fault` that breaks one block the way a port goes wrong.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import nn
from torch.nn import functional as F

D, HEADS, LAYERS, VOCAB, T, FF = 32, 2, 3, 64, 8, 64


def hf_gpt2(trained: bool = True) -> nn.Module:
    """GPT2LMHeadModel from a tiny config (nothing downloaded), dropouts at p = 0 as a
    fine-tuning config sets them, eager attention. `trained`: biases and norms moved off their
    initial zeros and ones, as training leaves them (else every LayerNorm holds the same
    values)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=LAYERS,
                        n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and trained:
                p.add_(torch.randn_like(p) * 0.02)
    return model



def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: each position predicts the next label."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))

class _Attention(nn.Module):
    def __init__(self, scale: float | None) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2)
                   for z in self.qkv(x).split(D, dim=2))
        scale = 1 / math.sqrt(D // HEADS) if self.scale is None else self.scale
        att = (q @ k.transpose(-1, -2)) * scale
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, torch.finfo(att.dtype).min).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, D))


class _MLP(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D, bias=bias)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class _GPT2Block(nn.Module):
    def __init__(self, scale: float | None = None, bias: bool = True) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.mlp = _Attention(scale), _MLP(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2Port(nn.Module):
    """GPT-2 as a port writes it. `fault`: None (faithful), "scale" (block 1's attention
    without its 1/sqrt(head_dim)) or "bias" (block 1's MLP output projection without its
    bias)."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(16, D)
        self.blocks = nn.ModuleList(
            _GPT2Block(scale=1.0 if fault == "scale" and i == 1 else None,
                       bias=not (fault == "bias" and i == 1)) for i in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).float()
        return next_token_loss(logits, labels)

    @classmethod
    def of(cls, hf: nn.Module, fault: str | None = None) -> GPT2Port:
        """A port holding `hf`'s weights."""
        port = cls(fault)
        h = hf.transformer
        with torch.no_grad():
            port.wte.weight.copy_(h.wte.weight)
            port.wpe.weight.copy_(h.wpe.weight)
            port.ln_f.load_state_dict(h.ln_f.state_dict())
            for mine, theirs in zip(port.blocks, h.h):
                mine.ln1.load_state_dict(theirs.ln_1.state_dict())
                mine.ln2.load_state_dict(theirs.ln_2.state_dict())
                for lin, conv in ((mine.attn.qkv, theirs.attn.c_attn),
                                  (mine.attn.proj, theirs.attn.c_proj),
                                  (mine.mlp.fc, theirs.mlp.c_fc),
                                  (mine.mlp.proj, theirs.mlp.c_proj)):
                    lin.weight.copy_(conv.weight.t())  # Conv1D stores (in, out)
                    if lin.bias is not None:
                        lin.bias.copy_(conv.bias)
        return port


def hf_llama() -> nn.Module:
    """LlamaForCausalLM from a tiny config, eager attention, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, max_position_embeddings=16,
                         attn_implementation="eager", tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.02)
    return model


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
                              ).to(x.dtype)


class _LlamaBlock(nn.Module):
    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.norm1, self.norm2 = _RMSNorm(), _RMSNorm()
        self.qkv, self.o = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.gate, self.up = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.down = nn.Linear(FF, D, bias=False)
        self.scale = scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(D, dim=2))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        scale = 1 / math.sqrt(D // HEADS) if self.scale is None else self.scale
        att = (q @ k.transpose(-1, -2)) * scale
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, torch.finfo(att.dtype).min).softmax(-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, D))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaPort(nn.Module):
    """Llama with one fused qkv projection. `fault`: None or "scale" (block 1's attention
    without its 1/sqrt(head_dim))."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(_LlamaBlock(1.0 if fault == "scale" and i == 1 else None)
                                    for i in range(LAYERS))
        self.norm = _RMSNorm()
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        half = D // HEADS // 2
        freq = 1.0 / (10000.0 ** (torch.arange(0, half, dtype=torch.float32) / half))
        angles = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * freq[None]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return next_token_loss(logits, labels)

    @classmethod
    def of(cls, hf: nn.Module, fault: str | None = None) -> LlamaPort:
        port = cls(fault)
        m = hf.model
        with torch.no_grad():
            port.embed.weight.copy_(m.embed_tokens.weight)
            port.norm.weight.copy_(m.norm.weight)
            port.head.weight.copy_(hf.lm_head.weight)
            for mine, theirs in zip(port.blocks, m.layers):
                a, mlp = theirs.self_attn, theirs.mlp
                mine.norm1.weight.copy_(theirs.input_layernorm.weight)
                mine.norm2.weight.copy_(theirs.post_attention_layernorm.weight)
                mine.qkv.weight.copy_(torch.cat((a.q_proj.weight, a.k_proj.weight,
                                                 a.v_proj.weight)))
                mine.o.weight.copy_(a.o_proj.weight)
                mine.gate.weight.copy_(mlp.gate_proj.weight)
                mine.up.weight.copy_(mlp.up_proj.weight)
                mine.down.weight.copy_(mlp.down_proj.weight)
        return port
