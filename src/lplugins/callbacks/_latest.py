"""Which committed checkpoint is the newest loadable one: :func:`latest_checkpoint`, and the word ``"latest"``.

Reads the directory's commit markers and checks each candidate's data against its marker, newest
first; nothing is unpickled and nothing is moved. Lightning-free: one function serves both namespaces
(``lplugins.callbacks._resume`` loads what it finds, through Lightning).
"""

from __future__ import annotations

import os

from lplugins.callbacks._record import Record, order
from lplugins.callbacks._storage import Storage
from lplugins.callbacks._storages import open_storage

__all__ = ["LAST", "LATEST", "latest_checkpoint", "newest_loadable"]

#: The ``ckpt_path`` value that resolves to the newest committed, loadable checkpoint.
LATEST = "latest"
"""The ``ckpt_path`` value that resolves to the newest committed, loadable checkpoint (or a fresh start)."""
#: Lightning's word for the newest checkpoint; with a ``DurableCheckpoint`` it means :data:`LATEST`.
LAST = "last"


def latest_checkpoint(dirpath: str | os.PathLike[str], *, deep: bool = False) -> str | None:
    """The newest committed checkpoint in ``dirpath`` whose data matches its commit marker, or ``None``.

    Uncommitted leftovers (temporary files, data without a commit marker) and unreadable or ill-typed
    markers are never returned, and a committed checkpoint whose file was truncated or changed since is
    skipped in favour of the next newest. Nothing is unpickled and nothing is moved. Pass the result to
    ``trainer.fit(ckpt_path=...)``; ``None`` starts from scratch, so the same line works for the first run
    and every restart. (``ckpt_path="latest"`` goes further: it verifies every byte while loading, and
    falls back past a checkpoint that fails to load or does not match.)

    Args:
        dirpath: The directory a :class:`~lplugins.callbacks.DurableCheckpoint` writes to.
        deep: Also read every byte and check the archive's CRCs (slower; default checks the size and
            the archive's directory).

    Returns:
        The checkpoint's path, or ``None`` when there is none.

    Examples:
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
