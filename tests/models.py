"""The models and data the tests train, in one place (importable from the test processes' scripts too).

Most tests need "a small LightningModule that learns something and whose state matters": a regression of
``y = x.sum(1)`` through :class:`Regression`, configured per test (dropout so the RNG matters, an LR scheduler
so its state matters, hidden layers so there is something to shard).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["Regression", "regression_data", "regression_loader"]

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


class Regression(LightningModule):
    """Learns ``y = x.sum(1)`` with an MSE loss; ``self.net`` is an ``nn.Sequential``.

    Args:
        features: Input width.
        hidden: Widths of the hidden layers (none: one linear layer).
        activation: ``"tanh"`` or ``"relu"`` between layers.
        dropout: Dropout on the input (so each process's RNG state matters), 0 for none.
        optimizer: ``"adam"`` or ``"sgd"``.
        lr: Learning rate.
        step_lr: With a value, a ``StepLR(step_size=step_lr, gamma=0.5)`` scheduler (so its state matters).
        seed: With a value, ``torch.manual_seed(seed)`` before the layers are built.

    Attributes:
        losses: The training loss of every step this instance ran.
        steps_run: How many training steps this instance ran.
    """

    def __init__(
        self,
        features: int = 4,
        hidden: Sequence[int] = (),
        *,
        activation: str = "tanh",
        dropout: float = 0.0,
        optimizer: str = "adam",
        lr: float = 0.05,
        step_lr: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Dropout(dropout)] if dropout else []
        widths = [features, *hidden]
        for width_in, width_out in itertools.pairwise(widths):
            layers += [nn.Linear(width_in, width_out), _ACTIVATIONS[activation]()]
        layers.append(nn.Linear(widths[-1], 1))
        self.net = nn.Sequential(*layers)
        self.optimizer, self.lr, self.step_lr = optimizer, lr, step_lr
        self.losses: list[float] = []
        self.steps_run = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(loss.item())
        self.steps_run += 1
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y.float()), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt: torch.optim.Optimizer
        if self.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.step_lr is None:
            return opt
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=self.step_lr, gamma=0.5)]


def regression_data(n: int = 64, features: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs drawn from a seeded generator, and their targets ``x.sum(1)``."""
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(seed))
    return x, x.sum(1, keepdim=True)


def regression_loader(
    n: int = 64, features: int = 4, batch_size: int = 4, *, shuffle: bool = False, seed: int = 0
) -> DataLoader:
    """A DataLoader over :func:`regression_data`."""
    return DataLoader(TensorDataset(*regression_data(n, features, seed)), batch_size=batch_size, shuffle=shuffle)
