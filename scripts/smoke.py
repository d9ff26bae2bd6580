"""A smoke test of an installed lplugins (run by scripts/test-wheel.sh from outside the clone).

Composes a Trainer by names, trains a few steps with a durable checkpoint, resumes with "latest".
"""

from __future__ import annotations

import sys

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

import lplugins
from lplugins.callbacks import latest_checkpoint


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: str) -> None:
    lplugins.load()
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
    for max_steps in (4, 8):
        trainer = Trainer(**lplugins.compose(
            accelerator="cpu", devices=1, precision="auto", accumulate_grad_batches={0: 2},
            callbacks=[{"name": "durable_checkpoint", "dirpath": f"{out}/ckpts", "every_n_steps": 2}],
            max_steps=max_steps, logger=False, enable_progress_bar=False, default_root_dir=out,
        ))  # fmt: skip
        trainer.fit(Tiny(), data, ckpt_path="latest")
        assert trainer.global_step == max_steps, trainer.global_step
    assert latest_checkpoint(f"{out}/ckpts") is not None
    print("smoke OK:", lplugins.__version__, latest_checkpoint(f"{out}/ckpts"))


if __name__ == "__main__":
    main(sys.argv[1])
