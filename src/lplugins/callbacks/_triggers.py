"""When a save is due at a step boundary: ``DurableCheckpoint``'s triggers, agreed by every rank in one collective.

Every rank contributes what it alone knows (a request, a preemption signal, a failed background write,
whether its writer is still busy, ``should_stop``); rank 0's clock decides ``every_n_seconds``. One
``reduce_max`` shares it all, so every rank reaches the same decision at the same step.
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass

from lightning.pytorch import Trainer

from lplugins.callbacks._collective import reduce_max
from lplugins.callbacks._config import CheckpointConfig

__all__ = ["Due"]


@dataclass(frozen=True)
class Due:
    """What every rank agreed at one step boundary (each flag: true on at least one rank)."""

    requested: bool = False  # ``request_checkpoint`` was called
    preempt: bool = False  # a preemption signal arrived
    failed: bool = False  # a background write failed
    time: bool = False  # ``every_n_seconds`` elapsed (rank 0's clock)
    stop: bool = False  # ``trainer.should_stop`` is set
    busy: bool = False  # a save is still being written (continuous mode waits for it)

    @classmethod
    def agree(cls, trainer: Trainer, config: CheckpointConfig, mine: Due, last_save_time: float) -> Due:
        """Combine this rank's flags with every other rank's (a collective: every rank calls it)."""
        every_n_seconds = config.every_n_seconds
        time_due = (
            trainer.is_global_zero
            and every_n_seconds is not None
            and time.monotonic() - last_save_time >= every_n_seconds
        )
        local = [int(flag) for flag in astuple(mine)]
        local[3] = int(time_due)
        return cls(*(bool(flag) for flag in reduce_max(trainer, local)))

    def reasons(self, config: CheckpointConfig, step: int) -> list[str]:
        """Why this boundary saves (empty: it does not), e.g. ``["step", "time"]``.

        >>> Due(time=True).reasons(CheckpointConfig(every_n_steps=5), step=10)
        ['step', 'time']
        >>> Due(busy=True).reasons(CheckpointConfig(async_save=True, continuous=True), step=3)
        []
        >>> Due().reasons(CheckpointConfig(async_save=True, continuous=True), step=3)
        ['continuous']
        """
        reasons = []
        if config.every_n_steps is not None and step > 0 and step % config.every_n_steps == 0:
            reasons.append("step")
        if self.time:
            reasons.append("time")
        if config.continuous and step > 0 and not self.busy:
            reasons.append("continuous")
        if self.requested:
            reasons.append("request")
        if self.preempt:
            reasons.append("preemption")
        return reasons
