"""acme's audit callback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class AcmeAudit(Callback):
    """Counts optimizer steps (state saved in checkpoints) and appends one line per fit on rank 0."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.steps = 0
        self.restored_steps: int | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(path=self.path)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps += 1

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.path and trainer.is_global_zero:
            with Path(self.path).open("a") as f:
                f.write(f"fit ended: world_size={trainer.world_size} steps={self.steps}\n")

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict["steps"])
        self.restored_steps = self.steps
