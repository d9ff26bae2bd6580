"""The errors checkpointing raises on purpose: each an :class:`~lplugins.LPluginsError` with its old builtin base."""

from __future__ import annotations

from lplugins._errors import (  # in the foundation: strategies raise it too
    LPluginsError,
    UnsafeCheckpointError,
    shown_from,
)

__all__ = [
    "CheckpointClaimError",
    "CheckpointConfigError",
    "CheckpointDirectoryError",
    "CheckpointResumeError",
    "CheckpointWriteError",
    "DamagedCheckpointError",
    "InconsistentCheckpointError",
    "UnsafeCheckpointError",
]


class CheckpointConfigError(LPluginsError, ValueError):
    """An argument of :class:`~lplugins.callbacks.DurableCheckpoint` is invalid (the message names it)."""


class CheckpointWriteError(LPluginsError, OSError):
    """Writing a checkpoint failed (disk full, I/O error, ...). The checkpoints committed before are intact."""


class CheckpointDirectoryError(LPluginsError, OSError):
    """The checkpoint directory cannot be created or written; raised at setup, before any training."""


class CheckpointClaimError(CheckpointDirectoryError):
    """Another job holds the checkpoint directory (its claim names host, pid and start time); raised at setup,
    before any training and before anything in the directory is touched. ``DurableCheckpoint(take_over=True)``
    takes it over instead."""


class CheckpointResumeError(LPluginsError, RuntimeError):
    """A resume cannot proceed: the ranks resolved different checkpoints (the directory is not shared), or
    ``ckpt_path="latest"`` was given to a Trainer without a ``DurableCheckpoint``."""


class DamagedCheckpointError(CheckpointResumeError):
    """A committed checkpoint's bytes do not match its commit marker (CRC32, size or archive): it was damaged
    after it was written. ``ckpt_path="latest"`` skips it (and quarantines it); an explicit path raises this."""


class InconsistentCheckpointError(CheckpointResumeError):
    """What a checkpoint holds (its ``global_step`` or ``epoch``) differs from what its commit marker says."""


shown_from(
    "lplugins.callbacks",
    CheckpointConfigError,
    CheckpointClaimError,
    CheckpointWriteError,
    CheckpointDirectoryError,
    CheckpointResumeError,
    DamagedCheckpointError,
    InconsistentCheckpointError,
)
