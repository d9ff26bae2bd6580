"""Resuming: ``"latest"`` resolved once, by :class:`LatestResolver`, for both ways Lightning loads a checkpoint.

Lightning loads through the strategy's ``CheckpointIO`` (wrapped in :class:`SafeResumeIO`), except
for strategies with their own ``load_checkpoint`` (DeepSpeed, FSDP2), which is wrapped on the
instance. Both call the same resolver: ``"latest"`` becomes the newest committed, loadable checkpoint
(or a fresh start), every rank must resolve the same path, and ``trainer.ckpt_path`` reports it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from lplugins import _lightning
from lplugins.callbacks._collective import agree_on_path
from lplugins.callbacks._errors import UnsafeCheckpointError
from lplugins.callbacks._storage import open_storage

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["LATEST", "LatestResolver", "NoCheckpoint", "SafeResumeIO", "latest_checkpoint", "load_weights_only"]

#: The ``ckpt_path`` value that resolves to the newest committed, loadable checkpoint.
LATEST = "latest"


def latest_checkpoint(dirpath: str | os.PathLike[str], *, deep: bool = False) -> str | None:
    """The newest committed checkpoint in ``dirpath`` whose data matches its commit marker, or ``None``.

    Uncommitted leftovers (temporary files, data without a commit marker) are never returned, and a
    committed checkpoint whose file was truncated or changed since is skipped in favour of the next
    newest. Nothing is unpickled. Pass the result to ``trainer.fit(ckpt_path=...)``; ``None`` starts
    from scratch, so the same line works for the first run and every restart.

    Args:
        dirpath: The directory a :class:`~lplugins.callbacks.DurableCheckpoint` writes to.
        deep: Also read every byte and check the archive's CRCs (slower; default checks the size and
            the archive's directory).

    Returns:
        The checkpoint's path, or ``None`` when there is none.

    Example:
        >>> import tempfile
        >>> latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    storage = open_storage(dirpath)
    records = storage.find_committed(deep=deep)
    return storage.path(records[-1].name) if records else None


def load_weights_only(io: CheckpointIO, path: Any, map_location: Any = None) -> dict[str, Any]:
    """Load ``path`` through ``io`` with ``weights_only=True``, turning a refused payload into a clear error.

    Raises:
        UnsafeCheckpointError: the file holds objects outside torch's weights-only allow-list.
    """
    try:
        if map_location is None:
            return io.load_checkpoint(path, weights_only=True)
        return io.load_checkpoint(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"Refusing to load checkpoint {os.fspath(path)!r}: it holds objects that torch.load(weights_only=True)"
            " does not allow (nothing in it was executed). If you wrote this file yourself and trust it, allow"
            " the types with torch.serialization.add_safe_globals([...]).\n"
            f"torch said: {str(err).splitlines()[0] if str(err) else err!r}"
        ) from err


class NoCheckpoint(dict[str, Any]):
    """What ``ckpt_path="latest"`` loads when there is nothing to resume: a falsy dict Lightning skips."""

    def __bool__(self) -> bool:
        return False

    @classmethod
    def new(cls) -> NoCheckpoint:
        """An empty checkpoint that carries the Lightning version (Lightning reads it)."""
        import lightning

        return cls({"pytorch-lightning_version": lightning.__version__})


class LatestResolver:
    """Resolves the ``ckpt_path`` of one trainer's loads, and installs itself in front of both load paths.

    Args:
        trainer: The trainer whose loads go through it.
        dirpath: The checkpoint directory ``"latest"`` refers to.
        deep: Check every byte's CRC of the candidates for ``"latest"``.
    """

    def __init__(self, trainer: Trainer, dirpath: str, deep: bool = False) -> None:
        self.trainer = trainer
        self.dirpath = dirpath
        self.deep = deep
        #: What the last ``"latest"`` resolved to.
        self.resolved: str | None = None
        self._io: SafeResumeIO | None = None

    def resolve(self, path: Any) -> Any:
        """The checkpoint to load for ``path``, or ``None`` for a fresh start; all ranks must agree (collective).

        Raises:
            CheckpointResumeError: ranks resolved different paths.
        """
        if not (isinstance(path, str) and path == LATEST):
            agree_on_path(self.trainer, os.fspath(path))
            return path
        resolved = latest_checkpoint(self.dirpath, deep=self.deep)
        agree_on_path(self.trainer, resolved)
        self.resolved = resolved
        _lightning.set_ckpt_path(self.trainer, resolved)
        return resolved

    def install(self) -> None:
        """Resolve in front of the strategy's ``CheckpointIO`` and, if it has one, its own ``load_checkpoint``."""
        strategy = self.trainer.strategy
        if not isinstance(strategy.checkpoint_io, SafeResumeIO):
            self._io = SafeResumeIO(strategy.checkpoint_io, self)
            strategy.checkpoint_io = self._io
        if loads_itself(self.trainer):
            _lightning.wrap_strategy_load(strategy, self._resolving_load)

    def uninstall(self) -> None:
        """Give the strategy its own ``CheckpointIO`` and ``load_checkpoint`` back."""
        strategy = self.trainer.strategy
        if self._io is not None and strategy.checkpoint_io is self._io:
            strategy.checkpoint_io = self._io.inner
        self._io = None
        _lightning.unwrap_strategy_load(strategy)

    def _resolving_load(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The strategy's own ``load_checkpoint`` with the path resolved in front."""
        strategy = self.trainer.strategy

        def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            target = self.resolve(checkpoint_path)
            if target is None:
                return NoCheckpoint.new()
            if "weights_only" in kwargs and not hasattr(strategy, "deepspeed_engine"):
                kwargs["weights_only"] = True  # DeepSpeed's engine loads its own files (docs/checkpoint.md)
            return original(target, *args, **kwargs)

        return load_checkpoint


def loads_itself(trainer: Trainer) -> bool:
    """Whether the strategy has its own ``load_checkpoint`` (DeepSpeed, FSDP2: they bypass ``CheckpointIO``)."""
    from lightning.pytorch.strategies import Strategy

    return type(trainer.strategy).load_checkpoint is not Strategy.load_checkpoint


class SafeResumeIO(CheckpointIO):
    """Wraps the strategy's ``CheckpointIO``: loads go through a :class:`LatestResolver`, weights-only.

    Saving and removing are passed through unchanged.

    Args:
        inner: The strategy's original ``CheckpointIO``.
        resolver: Resolves the path of every load.
    """

    def __init__(self, inner: CheckpointIO, resolver: LatestResolver) -> None:
        self.inner = inner
        self.resolver = resolver

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        target = self.resolver.resolve(path)
        if target is None:
            return NoCheckpoint.new()
        if weights_only is False:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                "DurableCheckpoint loads every checkpoint with weights_only=True; ignoring weights_only=False."
            )
        return load_weights_only(self.inner, target, map_location)
