"""The errors checkpointing raises on purpose: each an :class:`~lplugins.LPluginsError` with its old builtin base."""

from __future__ import annotations

from lplugins._errors import LPluginsError

__all__ = [
    "CheckpointConfigError",
    "CheckpointDirectoryError",
    "CheckpointResumeError",
    "CheckpointWriteError",
    "UnsafeCheckpointError",
]


class CheckpointConfigError(LPluginsError, ValueError):
    """An argument of :class:`~lplugins.callbacks.DurableCheckpoint` is invalid (the message names it)."""


class CheckpointWriteError(LPluginsError, OSError):
    """Writing a checkpoint failed (disk full, I/O error, ...). The checkpoints committed before are intact."""


class CheckpointDirectoryError(LPluginsError, OSError):
    """The checkpoint directory cannot be created or written; raised at setup, before any training."""


class CheckpointResumeError(LPluginsError, RuntimeError):
    """The ranks resolved different checkpoints to resume from (the directory is not shared)."""


class UnsafeCheckpointError(LPluginsError, RuntimeError):
    """A checkpoint holds objects that ``torch.load(weights_only=True)`` refuses; nothing in it was run."""
