"""Lightning: a small CNN (convolution, BatchNorm, dropout) as a LightningModule with automatic
optimization, which runs each forward and backward inside `optimizer.step(closure)`.

    python lightning_cnn.py       # 3 optimizer steps on CPU, no logger, checkpoint or bar
"""
from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

from _compat import nan_now, save, set_step


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn(self.conv(images))), 2)
        if nan_now():
            h = torch.sqrt(h - 1e4)  # compat: NaN
        return self.head(self.drop(h).flatten(1))


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = CNN()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):  # noqa: ANN201
        set_step(self.trainer.global_step)
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    L.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(64, 1, 8, 8), torch.randint(0, 3, (64,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    module = Classifier()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, loader)
    save(module.net, trainer.global_step)


if __name__ == "__main__":
    main()
