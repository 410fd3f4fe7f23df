"""Hugging Face `Trainer` (with accelerate) on a tiny Llama built from its config.

Nothing is downloaded: the model comes from a `LlamaConfig`, the token ids are made here. The
MLP's activation is this script's own module, so that the model's code has a line of ours
where `COMPAT_NAN_STEP` makes a NaN.

    python hf_trainer.py          # 3 optimizer steps, batch 4, gradient accumulation 2
"""
from __future__ import annotations

import tempfile

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from _compat import nan_now, save, set_step

VOCAB, SEQ = 64, 16


class SiLU(nn.Module):
    """Llama's activation, written in the script."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(x)
        if nan_now():
            h = torch.sqrt(h - 1e4)  # compat: NaN
        return h


class Tokens(torch.utils.data.Dataset):
    """Synthetic causal-LM samples: token ids and the same ids as labels."""

    def __init__(self, n: int = 64) -> None:
        self.ids = torch.randint(VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepOfModel(TrainerCallback):
    """Tells the model which optimizer step its coming forwards belong to."""

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        set_step(state.global_step)


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp.act_fn = SiLU()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, learning_rate=1e-2, seed=0,
                                 report_to="none", save_strategy="no", logging_steps=1,
                                 use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                          callbacks=[StepOfModel()])
        trainer.train()
    save(model, trainer.state.global_step)


if __name__ == "__main__":
    main()
