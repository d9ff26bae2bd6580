"""Asking for a checkpoint from one rank: :func:`request_checkpoint` (a flag, carried to every rank by the callback)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lplugins.callbacks._errors import CheckpointConfigError
from lplugins.callbacks.checkpoint import DurableCheckpoint

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["request_checkpoint"]


def request_checkpoint(trainer: Trainer) -> None:
    """Ask every :class:`DurableCheckpoint` of ``trainer`` for a checkpoint at the next step boundary.

    Safe to call on one rank only, e.g. inside ``if trainer.is_global_zero:``: it only sets a flag, and
    the callback carries it to all ranks with the collective it runs at each step boundary, so all
    ranks save together. This replaces the pattern that deadlocks under DDP::

        if batch_idx % 1000 == 0 and self.trainer.is_global_zero:
            self.trainer.save_checkpoint(...)  # save_checkpoint is collective: the other ranks never join

    (With lplugins installed, the collective watchdog turns that hang into an error on every rank after
    ``LPLUGINS_COLLECTIVE_TIMEOUT`` seconds, naming the call and the line; this function avoids it.)

    Raises:
        CheckpointConfigError: (a ``ValueError``) ``trainer`` has no ``DurableCheckpoint`` callback.
    """
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, DurableCheckpoint)]  # type: ignore[attr-defined]
    if not callbacks:
        raise CheckpointConfigError(
            "request_checkpoint(trainer): the trainer has no DurableCheckpoint callback; add one."
        )
    for cb in callbacks:
        cb.request()
