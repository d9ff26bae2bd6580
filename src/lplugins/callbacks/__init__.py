"""Callbacks shipped with lplugins.

* :class:`DurableCheckpoint` -- atomic, durable, rank-safe checkpoints (``docs/checkpoint.md``), with
  :func:`latest_checkpoint` and ``ckpt_path="latest"`` for resume and :func:`request_checkpoint` for
  asking for a save from one rank.
"""

from lplugins.callbacks._resume import LATEST, UnsafeCheckpointError, latest_checkpoint
from lplugins.callbacks.checkpoint import (
    PREEMPTED_EXIT_CODE,
    CheckpointDirectoryError,
    CheckpointWriteError,
    DurableCheckpoint,
    request_checkpoint,
)

__all__ = [
    "LATEST",
    "PREEMPTED_EXIT_CODE",
    "CheckpointDirectoryError",
    "CheckpointWriteError",
    "DurableCheckpoint",
    "UnsafeCheckpointError",
    "latest_checkpoint",
    "request_checkpoint",
]
