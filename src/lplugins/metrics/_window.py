"""The logging window the metrics callbacks share: how many training batches between two logs."""

from __future__ import annotations

from lightning.pytorch import Trainer


def window_length(trainer: Trainer, log_every_n_steps: int | None) -> int:
    """``log_every_n_steps`` if given, else the Trainer's ``log_every_n_steps`` (at least 1).

    Args:
        trainer: The Trainer.
        log_every_n_steps: The callback's own window, or ``None``.

    Returns:
        The window, in training batches.
    """
    return log_every_n_steps or max(int(getattr(trainer, "log_every_n_steps", 50)), 1)
