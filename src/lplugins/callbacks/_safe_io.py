"""The ``CheckpointIO`` side of resuming: :class:`SafeResumeIO`, weights-only loads, and the mapped load.

A committed local checkpoint file whose bytes are checked against its marker's CRC32 is loaded with
``torch.load(path, mmap=True, weights_only=True)`` (:func:`mapped_load`) when the strategy's
``CheckpointIO`` is Lightning's stock ``TorchCheckpointIO``: the tensors are views of the file's pages
(``MAP_PRIVATE``: copy-on-write, nothing written back), so loading makes no fresh copy of the state and
the CRC32 pass over the same pages (:func:`~lplugins.callbacks._verify.crc32_of`) is the only full read.
This is safe because a committed checkpoint file is immutable: it is written under a temporary name,
fsynced, renamed into place atomically and committed by its marker afterwards; nothing opens it for
writing again (retention deletes it, the quarantine renames it; a mapping keeps the bytes it mapped
either way). Every load is torch's own weights-only unpickler, after the file's resource bounds are
checked (:mod:`~lplugins._bounds`: zip sizes, pickle nesting and work) on the same open file torch
then reads (``/proc/self/fd``), so a file swapped after the check is not the one loaded. The state Lightning
copies into the model is released after the restore; the optimizer
state torch keeps as loaded (same dtype and device) stays on the mapping, its private copies made in the
background (:mod:`~lplugins.callbacks._prefault`) before the first step writes it page by page.
"""

from __future__ import annotations

import os
import pickle
import stat
from collections.abc import Callable
from typing import Any, TypeVar

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from lplugins._bounds import check_file
from lplugins.callbacks._errors import UnsafeCheckpointError
from lplugins.callbacks._prefault import prefault_writes
from lplugins.callbacks._refusals import unsafe_error
from lplugins.callbacks._verify import identity

__all__ = ["SafeResumeIO", "can_map", "checked_load", "load_weights_only", "mapped_load", "warn_not_weights_only"]

T = TypeVar("T")
#: The :func:`~lplugins.callbacks._verify.identity` of each file :func:`checked_load` opened, by the path it was
#: given: the resume compares it with the file its CRC32 pass read (the same file, unchanged, or refused).
OPENED: dict[str, tuple[int, int, int, int]] = {}
_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def checked_load(path: Any, load: Callable[[str], T], same_file: bool = True) -> T:
    """Open the local file ``path`` once, check its resource bounds, and ``load`` that same open file.

    ``load`` is given ``/proc/self/fd/N`` where the system has it and ``same_file`` (the file already opened,
    whatever its name points to by then), else ``path`` (a ``CheckpointIO`` of the user's reads names its own
    way). A path that is not a local file (a URL, a directory) is loaded as is.

    Raises:
        UnsafeCheckpointError: not a regular file, or a bound exceeded (:func:`lplugins._bounds.check_file`).
    """
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(name, str) or "://" in name or os.path.isdir(name):
        return load(path)
    fd = os.open(name, _FLAGS)  # non-blocking: a FIFO is refused below, never waited on
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeCheckpointError(f"Refusing to load checkpoint {name!r}: it is not a regular file")
        OPENED[name] = identity(fd)
        with os.fdopen(os.dup(fd), "rb") as file:
            check_file(name, file)
        same = f"/proc/self/fd/{fd}"
        return load(same if same_file and os.path.exists(same) else name)
    finally:
        os.close(fd)


def load_weights_only(
    io: CheckpointIO, path: Any, map_location: Any = None, weights_only: bool = True
) -> dict[str, Any]:
    """Load ``path`` through ``io`` (``weights_only=True`` unless told otherwise), a refused payload made clear.

    Raises:
        UnsafeCheckpointError: the file holds objects outside torch's weights-only allow-list.
    """

    def load(target: Any) -> dict[str, Any]:
        if map_location is None:
            return io.load_checkpoint(target, weights_only=weights_only)
        return io.load_checkpoint(target, map_location=map_location, weights_only=weights_only)

    try:
        return checked_load(path, load, same_file=can_map(io)) if weights_only else load(path)
    except pickle.UnpicklingError as err:
        raise unsafe_error(path, err) from err


def _keep_location(storage: Any, location: Any) -> Any:
    """Lightning's ``TorchCheckpointIO`` default ``map_location``: every storage stays on the CPU."""
    return storage


def can_map(io: CheckpointIO) -> bool:
    """Whether loads through ``io`` may be replaced by :func:`mapped_load` (Lightning's own ``TorchCheckpointIO``).

    A subclass or another ``CheckpointIO`` keeps its own ``load_checkpoint``.
    """
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    return type(io) is TorchCheckpointIO


def mapped_load(path: str, map_location: Any = None) -> dict[str, Any]:
    """``torch.load(path, mmap=True, weights_only=True)``: what ``TorchCheckpointIO`` loads, without the copy.

    A file torch cannot map (the legacy, non-zip format) is loaded the ordinary way.

    Raises:
        UnsafeCheckpointError: the file holds objects outside torch's weights-only allow-list.
    """
    import torch

    location = _keep_location if map_location is None else map_location

    def load(target: str) -> dict[str, Any]:
        try:
            loaded: dict[str, Any] = torch.load(target, map_location=location, weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            loaded = torch.load(target, map_location=location, weights_only=True)
        return loaded

    try:
        return checked_load(path, load)
    except pickle.UnpicklingError as err:
        raise unsafe_error(path, err) from err


def _prefault_optimizer(loaded: Any) -> None:
    """The optimizer state is written by the first step: its private copies made now, in the background."""
    if isinstance(loaded, dict):
        prefault_writes(loaded.get("optimizer_states"))


def warn_not_weights_only(path: str) -> None:
    """Rank zero: one warning that ``path`` is loaded without torch's weights-only guard, as asked."""
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(
        f"lplugins: about to unpickle checkpoint {path!r} with weights_only=False: you opted out of safe loading"
        " (passed to the Trainer), so torch.load runs any code pickled in it."
        " Do this only for a file you wrote yourself or otherwise trust."
    )


class SafeResumeIO(CheckpointIO):
    """Wraps the strategy's ``CheckpointIO``: loads go through a :class:`LatestResolver`, weights-only.

    ``weights_only=False`` (``fit(..., weights_only=False)``) is honoured, with a warning naming the file.
    Saving and removing are passed through unchanged. A committed local file whose bytes the resolver
    checks (:attr:`LatestResolver.mapping`) is loaded by :func:`mapped_load` when ``inner`` is Lightning's
    ``TorchCheckpointIO`` (:func:`can_map`).

    Args:
        inner: The strategy's original ``CheckpointIO``.
        resolver: Resolves and verifies every load.
    """

    def __init__(self, inner: CheckpointIO, resolver: Any) -> None:  # a _resume.LatestResolver
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
        trusted = weights_only is False

        mapped = []

        def attempt(target: str) -> dict[str, Any]:
            if trusted:
                warn_not_weights_only(target)
            elif self.resolver.mapping and can_map(self.inner):  # a committed local file, its CRC32 checked
                mapped.append(mapped_load(target, map_location))
                return mapped[-1]
            return load_weights_only(self.inner, target, map_location, weights_only=not trusted)

        result: dict[str, Any] = self.resolver.load(path, attempt)
        if mapped and result is mapped[-1]:  # after the check: its CRC32 thread has the other core until then
            _prefault_optimizer(result)
        return result
