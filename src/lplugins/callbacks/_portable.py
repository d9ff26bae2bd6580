"""Resuming a sharded directory of another strategy family: through one full checkpoint, made once.

When :func:`~lplugins.callbacks._reshard.needs_full_checkpoint` says so (a DeepSpeed ZeRO directory resumed by
DDP, a single device or FSDP2; an FSDP2 sharded directory resumed by DDP, a single device or DeepSpeed), global
rank zero converts the checkpoint to one full checkpoint file (:mod:`lplugins._lightning.portable`), kept next to
it as ``<checkpoint>.converted/full.ckpt`` and reused by every later resume (:mod:`lplugins._lightning.converted`:
committed atomically, verified before reuse, removed with its checkpoint by retention), and every rank then loads
that file as this run's strategy loads any full checkpoint. The checkpoint itself is only read, and verified
against its commit marker as always. A ZeRO directory is read once, in rank zero's process, each parameter cut out
of the ranks' partitions (:func:`lplugins._lightning.zero_shards.full_from_zero`; no universal conversion).
"""

from __future__ import annotations

import os
from typing import Any

from lplugins._lightning.converted import FULL_CHECKPOINT, cached_conversion, converted_dir
from lplugins._lightning.portable import DEEPSPEED_DIR, full_checkpoint, layout
from lplugins._lightning.zero_shards import compact, loss_scaled
from lplugins._log import announce
from lplugins.callbacks._record import Record
from lplugins.callbacks._reshard import ReshardError, family, needs_full_checkpoint

__all__ = ["FULL", "build_full_checkpoint", "portable_path"]

#: The name of the full-checkpoint conversion in ``<checkpoint>.converted``.
FULL = FULL_CHECKPOINT


def build_full_checkpoint(path: str, out: str) -> None:
    """Write the checkpoint ``path`` (any layout lplugins knows) as one full checkpoint file ``out``.

    Raises:
        LayoutError: the layout is not one lplugins knows.
    """
    import torch

    torch.save(compact(full_checkpoint(path)), out)


def portable_path(trainer: Any, record: Record, path: str) -> str:
    """What to load for the committed checkpoint ``path``: itself, or its full-checkpoint conversion (a collective).

    Raises:
        ReshardError: on every rank, when the conversion failed on rank zero (its reason in the message).
    """
    if not needs_full_checkpoint(trainer, record):
        return path
    error: str | None = None
    if "16-mixed" in str(getattr(trainer, "precision", "")) and layout(path) == DEEPSPEED_DIR and loss_scaled(path):
        raise ReshardError(  # the same on every rank (each reads rank 0's optimizer file)
            f"Cannot resume {path} (a DeepSpeed ZeRO directory trained in fp16 with DeepSpeed's loss scale) with"
            f" {type(trainer.strategy).__name__} and precision '16-mixed' on {trainer.world_size} rank(s): torch's"
            " GradScaler cannot take DeepSpeed's loss scale, so the loss scale would restart (steps skipped, not the"
            " run saved). Resume it with DeepSpeed (any stage, any number of ranks), or with precision 'bf16-mixed'"
            " or '32-true' (the fp32 weights and optimizer state move exactly)."
        )
    if trainer.is_global_zero:
        try:
            target, how = cached_conversion(path, FULL, lambda tmp: build_full_checkpoint(path, tmp))
            announce("lplugins: %s: one full checkpoint %s: %s", path, how, target)
        except Exception as err:  # said on every rank below
            error = f"{type(err).__name__}: {err}"
    error = trainer.strategy.broadcast(error)
    if error is not None:
        saved = family(record.strategy) if record.strategy else None
        raise ReshardError(
            f"Cannot resume {path} (a sharded directory written by {record.strategy} on {record.world_size or '?'}"
            f" rank(s)) with {type(trainer.strategy).__name__} on {trainer.world_size} rank(s): converting it to"
            f" one full checkpoint failed on rank 0 ({error}). Resume it with the {saved} strategy it was written"
            " with (any number of ranks)."
        )
    return os.path.join(converted_dir(path), FULL)
