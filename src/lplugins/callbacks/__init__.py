"""Callbacks shipped with lplugins.

* :class:`DurableCheckpoint` -- atomic, durable, rank-safe checkpoints (``docs/checkpoint.md``), with
  :func:`latest_checkpoint` and ``ckpt_path="latest"`` (or Lightning's ``"last"``) for resume and
  :func:`request_checkpoint` for asking for a save from one rank.

The package, one concern per module (arrows point down: a module imports only those below it)::

    checkpoint.py        DurableCheckpoint: the policy -- triggers, retention and top-K, its state, Lightning hooks
    _config.py           CheckpointConfig: the constructor's arguments, checked and frozen
    _request.py          request_checkpoint: a save asked for from one rank
    _latest.py           latest_checkpoint: the newest committed checkpoint whose data matches its marker
    _refusals.py         why a checkpoint was not loaded: kinds of failure, weights-only refusals, resume refusals
    _resume.py           LatestResolver: every load for both load paths; "latest" falls back past damaged, disallowed,
                         inconsistent or unreadable checkpoints (ranks agreeing); SafeResumeIO, latest_checkpoint;
                         understand_ckpt_path: Lightning's "last" and "latest" in fit's parsing
    _verify.py           every byte checked against the marker's CRC32s, on a second thread while loading
    _preemption.py       preemption signals caught as a flag; SLURM requeue; PREEMPTED_EXIT_CODE
    _rng.py              capturing and restoring the random number generators
    _sharded_async.py    ShardedAsyncWriter: each rank snapshots its own shards (reused buffers), torch DCP writes
                         them on a background thread and its own gloo group, rank 0 commits
    _async.py            AsyncWriter: CPU snapshots (deferred copies, buffer reuse) written on a background thread
    _writers.py          choose_writer: which CheckpointWriter a fit gets, from its strategy
    _writer.py           the CheckpointWriter interface; SyncWriter and StrategyWriter (sharded directories)
    _retention.py        Retention (which checkpoints to keep) and the Ledger of committed ones (background deletes)
    _claim.py            DirectoryClaim: one job writes a dirpath at a time (rank 0's claim, heartbeat, stale takeover)
    _collective.py       the collectives, through the trainer's strategy; ranks agreeing on a path
    _background.py       BackgroundQueue: one thread running jobs in order, errors kept for the training thread
    _serialization.py    the torch.save stream without torch's per-record CRCs; the storages it writes
    _storage.py          the Storage protocol (file primitives) and the commit protocol on top; the quarantine;
                         open_storage
    _storage_local.py    LocalStorage: local paths, fsync at every step
    _storage_fsspec.py   FsspecStorage: fsspec URLs, no fsync
    _stream.py           StreamWriter: direct writes, early write-back, CRC32 off the critical path
    _crc.py              crc32_combine
    _record.py           the commit marker (Record), checkpoint names (NameTemplate: the ``filename`` template)
                         and their order
    _errors.py           the errors (each an LPluginsError with its builtin base)

Lightning internals (the checkpoint dict, ``trainer.ckpt_path``, wrapping a strategy's
``load_checkpoint``) are reached only through :mod:`lplugins._lightning`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lplugins.callbacks._errors import (
    CheckpointClaimError,
    CheckpointConfigError,
    CheckpointDirectoryError,
    CheckpointResumeError,
    CheckpointWriteError,
    DamagedCheckpointError,
    InconsistentCheckpointError,
    UnsafeCheckpointError,
)
from lplugins.callbacks._latest import LATEST, latest_checkpoint
from lplugins.callbacks._preemption import PREEMPTED_EXIT_CODE

if TYPE_CHECKING:
    from lplugins.callbacks._request import request_checkpoint
    from lplugins.callbacks.checkpoint import DurableCheckpoint

# Lightning-facing names load on first use: importing a Lightning-free module of this package
# (``lplugins.callbacks._storage``) never imports a Lightning namespace
_LAZY = {
    "DurableCheckpoint": "lplugins.callbacks.checkpoint",
    "request_checkpoint": "lplugins.callbacks._request",
}

__all__ = [
    "LATEST",
    "PREEMPTED_EXIT_CODE",
    "CheckpointClaimError",
    "CheckpointConfigError",
    "CheckpointDirectoryError",
    "CheckpointResumeError",
    "CheckpointWriteError",
    "DamagedCheckpointError",
    "DurableCheckpoint",
    "InconsistentCheckpointError",
    "UnsafeCheckpointError",
    "latest_checkpoint",
    "request_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
