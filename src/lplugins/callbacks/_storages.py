"""Which :class:`~lplugins.callbacks._storage.Storage` a checkpoint directory gets: :func:`open_storage`.

Above both implementations (``_storage_local``, ``_storage_fsspec``), which import the base class
from ``_storage``: the choice lives here so that no module imports one that imports it.
"""

from __future__ import annotations

import os

from lplugins.callbacks._storage import Storage, is_remote
from lplugins.callbacks._storage_fsspec import FsspecStorage
from lplugins.callbacks._storage_local import LocalStorage

__all__ = ["open_storage"]


def open_storage(dirpath: str | os.PathLike[str]) -> Storage:
    """The :class:`Storage` for ``dirpath``: fsspec for a URL, local otherwise.

    >>> import tempfile
    >>> type(open_storage(tempfile.mkdtemp())).__name__
    'LocalStorage'
    """
    path = os.fspath(dirpath)
    return FsspecStorage(path) if is_remote(path) else LocalStorage(path)
