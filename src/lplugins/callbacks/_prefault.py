"""Make, in the background, the private copies of mapped pages a resume is about to write.

A verified resume maps the checkpoint file copy-on-write (:func:`~lplugins.callbacks._safe_io.mapped_load`);
the optimizer state stays on the mapping until the optimizer's first step writes it, and then every
4 KiB page costs a fault that copies it: measured 0.29 s for 120 MB on a 2-core virtual machine, ten
times the load itself. ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 and later) makes the same private
copies in one call per tensor, about six times cheaper, and :func:`prefault_writes` runs those calls on
a daemon thread while Lightning restores the rest. The bytes are unchanged (the kernel copies each page
as a write would, without writing); a page the training thread writes first is simply skipped. Where
the call does not exist (other systems, older kernels) nothing is done and the faults come as before.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
from typing import Any

__all__ = ["prefault_writes", "wait_for_prefaults"]

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
_PAGE = mmap.PAGESIZE
_pending: list[threading.Thread] = []
_supported = sys.platform.startswith("linux")


def _madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


def prefault_writes(tree: Any) -> None:
    """Populate writable, on a daemon thread, the pages of every CPU tensor in ``tree`` (dicts, lists, tuples).

    Meant for tensors on a private file mapping that will be written soon (a resumed optimizer's state);
    a tensor in ordinary memory gains nothing and loses nothing. The thread holds the storages until it
    is done, so the mapping outlives it.
    """
    global _supported
    if not _supported:
        return
    storages: dict[int, Any] = {}
    try:
        _collect(tree, storages)
    except Exception as err:  # an optimisation: never a reason for a resume to fail
        log.debug("lplugins: no prefault (%s: %s)", type(err).__name__, err)
        return
    if not storages:
        return
    try:
        madvise = _madvise()
    except (OSError, AttributeError):  # pragma: no cover -- a Linux without a C library to call
        _supported = False
        return

    def populate() -> None:
        global _supported
        for storage in storages.values():
            start = storage.data_ptr()
            aligned = start - start % _PAGE
            if madvise(aligned, start + storage.nbytes() - aligned, _MADV_POPULATE_WRITE) != 0:
                errno = ctypes.get_errno()
                log.debug("lplugins: MADV_POPULATE_WRITE failed (errno %d); those pages fault in when written", errno)
                if errno == 22:  # EINVAL: the kernel lacks it
                    _supported = False
                    return

    thread = threading.Thread(target=populate, name="lplugins-prefault", daemon=True)
    _pending[:] = [t for t in _pending if t.is_alive()]
    _pending.append(thread)
    thread.start()


def wait_for_prefaults(timeout: float | None = None) -> None:
    """Wait for every :func:`prefault_writes` thread started so far (benchmarks and tests time loads alone)."""
    for thread in list(_pending):
        thread.join(timeout)


def _collect(tree: Any, out: dict[int, Any]) -> None:
    """The CPU storages in ``tree``, each container visited once (no recursion: any nesting, any sharing)."""
    import torch

    seen: set[int] = set()
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, torch.Tensor):
            if node.device.type == "cpu" and node.layout == torch.strided:
                storage = node.untyped_storage()
                if storage.nbytes():
                    out.setdefault(storage.data_ptr(), storage)
        elif isinstance(node, (dict, list, tuple)):
            if id(node) in seen:
                continue
            seen.add(id(node))
            todo.extend(node.values() if isinstance(node, dict) else node)
