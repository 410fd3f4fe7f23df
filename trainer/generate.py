"""Text generation: greedy and sampled decoding, streamed token by token, and checkpoint loading.

Sampling draws from its own `torch.Generator` seeded by `seed`, so a seed fixes the output and
generation never disturbs the global RNG of a training run.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from trainer._checkpoint import load_model_into, read_meta, resolve_checkpoint
from trainer.config import LoRAConfig, ModelConfig
from trainer.model import GPT


def filter_logits(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None
                  ) -> torch.Tensor:
    """Set to -inf every logit outside the top k and outside the smallest set whose mass >= top_p.

    The most likely token always survives, so the result can be sampled from.
    """
    logits = logits.clone()
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits[logits < kth] = float("-inf")
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty: divide positive logits (multiply negative ones) of tokens already seen."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    logits = logits.clone()
    picked = logits[..., seen]
    logits[..., seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


@torch.no_grad()
def stream_generate(model: GPT, prompt_ids: Sequence[int], *, max_new_tokens: int = 64,
                    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                    repetition_penalty: float = 1.0, seed: int | None = 0,
                    stop_ids: Sequence[int] = ()) -> Iterator[int]:
    """Yield new token ids one at a time.

    Args:
        model: the GPT (put in eval mode here).
        prompt_ids: at least one token id.
        max_new_tokens: upper bound on yielded tokens.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
        top_k, top_p: keep only the k most likely tokens / the nucleus of mass top_p.
        repetition_penalty: > 1 discourages tokens already in the context.
        seed: seeds the sampler's own generator (None: nondeterministic).
        stop_ids: generation ends after yielding one of these.

    Raises:
        ValueError: empty prompt or a negative temperature.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. the <bos> id 256)")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy)")
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    block = model.config.block_size
    for _ in range(max_new_tokens):
        logits = model(ids[:, -block:])[0][0, -1].float()  # no KV cache: the model is small
        logits = apply_repetition_penalty(logits, ids[0].unique(), repetition_penalty)
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = filter_logits(logits / temperature, top_k=top_k, top_p=top_p)
            nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        yield nxt
        if nxt in stop_ids:
            return
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)


def generate(model: GPT, prompt_ids: Sequence[int], **kwargs) -> list[int]:
    """All of `stream_generate`'s tokens as a list (same arguments)."""
    return list(stream_generate(model, prompt_ids, **kwargs))


def load_model(checkpoint: str | Path, *, device: str = "cpu") -> GPT:
    """A GPT from a checkpoint directory or a run directory (its latest checkpoint).

    LoRA adapters in the checkpoint are merged into the weights.

    Raises:
        CheckpointError: no complete checkpoint there, or it does not fit the saved config.
    """
    from trainer.lora import apply_lora, merge_lora

    directory = resolve_checkpoint(checkpoint)
    config = read_meta(directory)["config"]
    try:
        model = GPT(ModelConfig(**config["model"]))
        lora = LoRAConfig(**{k: v for k, v in (config.get("lora") or {}).items()})
    except (TypeError, ValueError) as e:  # ConfigError is a ValueError
        raise CheckpointError(f"{directory}/meta.json holds a config this trainer cannot build "
                              f"({e}); use the sleuth version that wrote it") from e
    if lora.enabled:
        apply_lora(model, lora)
    load_model_into(model, directory)
    if lora.enabled:
        merge_lora(model)
    return model.to(device).eval()
