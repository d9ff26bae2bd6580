"""Resolving and loading the newest committed checkpoint, safely (``weights_only=True``)."""

from __future__ import annotations

import os
import pickle
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from lplugins.callbacks._storage import Storage

#: The ``ckpt_path`` value that resolves to the newest committed, loadable checkpoint.
LATEST = "latest"


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint holds objects that ``torch.load(weights_only=True)`` refuses; nothing in it was run."""


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
    records = Storage(os.fspath(dirpath)).find_committed(deep=deep)
    if not records:
        return None
    return Storage(os.fspath(dirpath)).path(records[-1].name)


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


class SafeResumeIO(CheckpointIO):
    """Wraps the strategy's ``CheckpointIO``: resolves ``"latest"``, checks all ranks agree, loads weights-only.

    Saving and removing are passed through unchanged.

    Args:
        inner: The strategy's original ``CheckpointIO``.
        dirpath: The checkpoint directory ``"latest"`` refers to.
        agree: Called with this rank's resolved path on every rank; raises unless all ranks agree.
        deep: Check every byte's CRC of the candidates for ``"latest"``.
        on_resolved: Called with what ``"latest"`` resolved to (the path, or None).
    """

    def __init__(
        self, inner: CheckpointIO, dirpath: str, agree: Any, deep: bool = False, on_resolved: Any = None
    ) -> None:
        self.inner = inner
        self.deep = deep
        self.on_resolved = on_resolved
        self.dirpath = dirpath
        self._agree = agree
        self.resolved: str | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if isinstance(path, str) and path == LATEST:
            resolved = latest_checkpoint(self.dirpath, deep=self.deep)
            self._agree(resolved)
            self.resolved = resolved
            if self.on_resolved is not None:
                self.on_resolved(resolved)
            if resolved is None:
                import lightning

                return NoCheckpoint({"pytorch-lightning_version": lightning.__version__})
            path = resolved
        else:
            self._agree(os.fspath(path))
        if weights_only is False:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                "DurableCheckpoint loads every checkpoint with weights_only=True; ignoring weights_only=False."
            )
        return load_weights_only(self.inner, path, map_location)
