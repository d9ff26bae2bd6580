"""``choose_writer``: which :class:`~lplugins.callbacks._writer.CheckpointWriter` a fit gets, from its strategy.

* the strategy's checkpoint is a plain ``torch.save`` on rank 0 (:func:`~lplugins.callbacks._writer.writes_itself`):
  :class:`~lplugins.callbacks._writer.SyncWriter`, or with ``async_save``
  :class:`~lplugins.callbacks._async.AsyncWriter`;
* it is a DCP directory of every rank's shards (:func:`~lplugins.callbacks._writer.saves_shards_async`, FSDP2's
  ``save_distributed_checkpoint=True``) and ``async_save`` is on:
  :class:`~lplugins.callbacks._sharded_async.ShardedAsyncWriter`;
* otherwise the strategy writes it: :class:`~lplugins.callbacks._writer.StrategyWriter` (synchronously, said
  when ``async_save`` was asked for).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities import rank_zero_warn

from lplugins.callbacks._async import AsyncWriter
from lplugins.callbacks._config import CheckpointConfig
from lplugins.callbacks._pacing import announce_continuous
from lplugins.callbacks._retention import Ledger
from lplugins.callbacks._sharded_async import ShardedAsyncWriter
from lplugins.callbacks._writer import CheckpointWriter, StrategyWriter, SyncWriter, saves_shards_async, writes_itself

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["choose_writer"]


def choose_writer(trainer: Trainer, config: CheckpointConfig, ledger: Ledger, dirpath: str | None) -> CheckpointWriter:
    """The writer of this fit's saves (every rank calls it, in ``setup``: a writer may create a process group)."""
    sharded = config.async_save and saves_shards_async(trainer)  # every rank writes its own shards
    if not writes_itself(trainer) and not sharded:
        if config.async_save:
            rank_zero_warn(
                f"DurableCheckpoint(async_save=True): {type(trainer.strategy).__name__} writes its own"
                " checkpoints; saving synchronously."
            )
        return StrategyWriter(ledger, config.crc32).describe(trainer)
    if config.continuous:
        announce_continuous(dirpath, config.keep_last, config.max_slowdown)
    if config.async_save:
        writer: CheckpointWriter = (ShardedAsyncWriter if sharded else AsyncWriter)(
            ledger, config.crc32, config.max_in_flight, writes=trainer.is_global_zero,
            max_slowdown=config.max_slowdown if config.continuous else None,
        )  # fmt: skip
        return writer.describe(trainer)
    return SyncWriter(ledger, config.crc32).describe(trainer)
