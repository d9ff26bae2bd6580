"""Resuming: ``"latest"`` resolved once, by :class:`LatestResolver`, for both ways Lightning loads a checkpoint.

Lightning loads through the strategy's ``CheckpointIO`` (wrapped in :class:`SafeResumeIO`), except
for strategies with their own ``load_checkpoint`` (DeepSpeed, FSDP2), which is wrapped on the
instance. Both call the same resolver: ``"latest"`` becomes the newest committed, loadable checkpoint
(or a fresh start), every rank must resolve the same path, ``trainer.ckpt_path`` reports it, and rank
zero says which checkpoint and why (Lightning's "Restoring states from the checkpoint path at latest"
is kept off the log: it would name a path that does not exist).

Lightning's own words are understood too (:func:`understand_ckpt_path`): ``ckpt_path="last"`` on a
Trainer with a ``DurableCheckpoint`` means ``"latest"``, and ``"latest"`` on one without is a clear error.
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from lplugins import _lightning
from lplugins._log import announce
from lplugins.callbacks._collective import agree_on_path
from lplugins.callbacks._errors import CheckpointResumeError, UnsafeCheckpointError
from lplugins.callbacks._record import Record, order
from lplugins.callbacks._storage import Storage, open_storage

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "LAST",
    "LATEST",
    "LatestResolver",
    "NoCheckpoint",
    "SafeResumeIO",
    "latest_checkpoint",
    "load_weights_only",
    "understand_ckpt_path",
]

#: The ``ckpt_path`` value that resolves to the newest committed, loadable checkpoint.
LATEST = "latest"
#: Lightning's word for the newest checkpoint; with a ``DurableCheckpoint`` it means :data:`LATEST`.
LAST = "last"


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
    record, _ = newest_loadable(storage, deep=deep)
    return storage.path(record.name) if record is not None else None


def newest_loadable(storage: Storage, *, deep: bool = False) -> tuple[Record | None, list[tuple[str, str]]]:
    """The newest committed checkpoint whose data matches its marker, and the newer ones skipped with why.

    Returns:
        ``(record or None, [(name, problem), ...])``, the skipped ones newest first.
    """
    records = sorted((r for r, _ in storage.records() if r is not None), key=order)
    skipped: list[tuple[str, str]] = []
    for record in reversed(records):
        problem = storage.check(record, deep=deep)
        if problem is None:
            return record, skipped
        skipped.append((record.name, problem))
    return None, skipped


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
        self._unhide: Callable[[], None] | None = None

    def resolve(self, path: Any) -> Any:
        """The checkpoint to load for ``path``, or ``None`` for a fresh start; all ranks must agree (collective).

        Raises:
            CheckpointResumeError: ranks resolved different paths.
        """
        if not (isinstance(path, str) and path == LATEST):
            agree_on_path(self.trainer, os.fspath(path))
            return path
        storage = open_storage(self.dirpath)
        record, skipped = newest_loadable(storage, deep=self.deep)
        resolved = storage.path(record.name) if record is not None else None
        agree_on_path(self.trainer, resolved)
        self.resolved = resolved
        _lightning.set_ckpt_path(self.trainer, resolved)
        self._announce(record, resolved, skipped)
        return resolved

    def _announce(self, record: Record | None, resolved: str | None, skipped: list[tuple[str, str]]) -> None:
        """Say on rank zero what ``"latest"`` resolved to, and why."""
        check = "every byte checked against its CRC32" if self.deep else "size and archive directory checked"
        passed = "; ".join(f"skipped newer {name}: {problem}" for name, problem in skipped)
        passed = f" ({passed})" if passed else ""
        if record is None:
            announce(
                "lplugins: ckpt_path='latest': no committed checkpoint in %s: starting fresh%s", self.dirpath, passed
            )
            return
        announce(
            "lplugins: ckpt_path='latest': resuming from %s (step %d, epoch %d, trigger: %s): the newest committed"
            " checkpoint in %s whose data matches its commit marker (%s)%s",
            resolved, record.global_step, record.epoch, record.reason or "unknown", self.dirpath, check,
            passed,
        )  # fmt: skip

    def install(self) -> None:
        """Resolve in front of the strategy's ``CheckpointIO`` and, if it has one, its own ``load_checkpoint``."""
        strategy = self.trainer.strategy
        if not isinstance(strategy.checkpoint_io, SafeResumeIO):
            self._io = SafeResumeIO(strategy.checkpoint_io, self)
            strategy.checkpoint_io = self._io
        if loads_itself(self.trainer):
            _lightning.wrap_strategy_load(strategy, self._resolving_load)
        if self._unhide is None:
            # Lightning would log "Restoring states from the checkpoint path at latest" even for a fresh start
            self._unhide = _lightning.hide_lightning_info(f"Restoring states from the checkpoint path at {LATEST}")

    def uninstall(self) -> None:
        """Give the strategy its own ``CheckpointIO`` and ``load_checkpoint`` back."""
        strategy = self.trainer.strategy
        if self._io is not None and strategy.checkpoint_io is self._io:
            strategy.checkpoint_io = self._io.inner
        self._io = None
        _lightning.unwrap_strategy_load(strategy)
        if self._unhide is not None:
            self._unhide()
            self._unhide = None

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


def understand_ckpt_path(trainer: Trainer, durable: type) -> None:
    """Read Lightning's ``ckpt_path`` words the lplugins way on this trainer (its own instance only; idempotent).

    * ``"last"`` with a ``DurableCheckpoint`` in ``trainer.callbacks``: its newest committed checkpoint
      (resolved as ``"latest"``), said once on rank zero. Lightning's ``"last"`` only knows
      ``ModelCheckpoint`` and would start from scratch.
    * ``"latest"`` without one: :class:`~lplugins.callbacks.CheckpointResumeError` naming the fix, instead
      of Lightning's ``FileNotFoundError: Checkpoint file not found: latest`` (unless the LightningModule's
      ``configure_callbacks`` may add one later).

    Args:
        trainer: The Trainer, before ``fit`` (in ``Trainer()`` or any hook).
        durable: The class whose instances in ``trainer.callbacks`` resolve ``"latest"``
            (:class:`~lplugins.callbacks.DurableCheckpoint`; passed in, this module sits below it).
    """
    _lightning.translate_ckpt_path(trainer, functools.partial(_translate, durable))


def _translate(durable_type: type, trainer: Trainer, state_fn: Any, ckpt_path: Any) -> Any:
    """``ckpt_path`` as lplugins reads it (see :func:`understand_ckpt_path`)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not isinstance(ckpt_path, str) or ckpt_path not in (LAST, LATEST):
        return ckpt_path
    durable = [cb for cb in trainer.callbacks if isinstance(cb, durable_type)]  # type: ignore[attr-defined]
    fn = getattr(state_fn, "value", state_fn)
    if ckpt_path == LAST and durable:
        announce(
            "lplugins: %s(ckpt_path='last') means DurableCheckpoint's newest committed checkpoint (as 'latest')", fn
        )
        return LATEST
    if ckpt_path == LATEST and not durable:
        module = trainer.lightning_module
        if module is None or not is_overridden("configure_callbacks", module):
            raise CheckpointResumeError(
                f"trainer.{fn}(ckpt_path='latest') resumes from a DurableCheckpoint's directory, but this Trainer"
                " has no DurableCheckpoint: add DurableCheckpoint(dirpath=...) to the Trainer's callbacks"
                " (lplugins.callbacks.DurableCheckpoint, or the name 'durable_checkpoint'), or pass the path"
                " of a checkpoint file."
            )
    return ckpt_path


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
