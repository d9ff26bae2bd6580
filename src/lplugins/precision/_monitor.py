"""Loss-scale observability for fp16 mixed precision."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override


class LossScaleMonitor(Callback):
    """Logs the fp16 loss scale and the number of optimizer steps skipped because of inf/NaN gradients.

    ``GradScaler`` skips the optimizer step and halves the scale when gradients overflow; this
    callback notices the halving after each optimizer step and counts it. Metrics ``loss_scale``
    and ``skipped_steps`` go to the Trainer's loggers from global rank 0 only (no collective is
    involved: every rank has the same scale), every ``log_every_n_steps`` steps and when a step is
    skipped. Does nothing unless the precision plugin has a ``GradScaler``.

    Args:
        prefix: prefix of the metric names.
    """

    def __init__(self, prefix: str = "precision/") -> None:
        self.prefix = prefix
        self.skipped_steps = 0
        self._last_scale: float | None = None

    @staticmethod
    def _scaler(trainer: Trainer) -> Any:
        return getattr(trainer.precision_plugin, "scaler", None)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        scaler = self._scaler(trainer)
        if scaler is None or not scaler.is_enabled():
            return
        scale = float(scaler.get_scale())
        skipped = self._last_scale is not None and scale < self._last_scale
        if skipped:
            self.skipped_steps += 1
        self._last_scale = scale
        step = trainer.global_step
        if (
            trainer.is_global_zero
            and trainer.loggers
            and (skipped or step % max(1, int(getattr(trainer, "log_every_n_steps", 50))) == 0)
        ):
            metrics = {f"{self.prefix}loss_scale": scale, f"{self.prefix}skipped_steps": float(self.skipped_steps)}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
