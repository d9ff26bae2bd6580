"""Every byte of a checkpoint checked against its commit marker, while (or before) it is loaded.

A file checkpoint is checked against the marker's whole-file CRC32 (``Record.crc32``; markers without
one: the archive's per-record CRC32s, when they were written); a directory checkpoint against the
per-file CRC32s (``Record.crcs``), its files shared out among the ranks (each rank hashes every
``world``-th file). :class:`Overlapped` runs the check on a second thread while the caller loads the
same bytes: the read and the CRC32 (:func:`~lplugins.callbacks._crc.crc32`, ISA-L's where installed)
release the GIL, so the check costs a second core, not time (a local file is memory-mapped and hashed
without taking the GIL back in between, split among up to 4 hashing threads when the cores are there).
"""

from __future__ import annotations

import mmap
import os
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

from lplugins.callbacks._crc import crc32, crc32_combine
from lplugins.callbacks._record import Record
from lplugins.callbacks._storage import Storage

__all__ = ["Overlapped", "bytes_problem", "can_verify", "crc32_of", "hash_threads", "identity"]

_CHUNK = 8 << 20


def can_verify(record: Record) -> bool:
    """Whether the marker carries checksums of every byte (False: written with ``crc32=False`` or by 0.1)."""
    if record.kind == "dir":
        return bool(record.crcs) and set(record.crcs) == set(record.files)
    return record.crc32 is not None or record.zip_crc


def hash_threads() -> int:
    """Threads for hashing one file: the cores the loading thread leaves free, at most 4 (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover -- not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores - 1))


def identity(fd: int) -> tuple[int, int, int, int]:
    """Which file an open descriptor is, as a check and a load compare it: device, inode, size, modification time."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def crc32_of(
    storage: Storage, name: str, threads: int | None = None, map_file: bool = True, seen: list[Any] | None = None
) -> int:
    """The CRC32 of every byte of file ``name`` (``map_file=False``: read in pieces, nothing memory-mapped).

    A local file is memory-mapped and hashed by :func:`~lplugins.callbacks._crc.crc32` in as few calls
    as possible: each call releases the GIL for its whole range, so a load running on another thread is
    not held up (reading in pieces would take the GIL back after every piece), and no copy is made. A
    large one is split into ``threads`` ranges (default: :func:`hash_threads`) hashed in parallel and
    joined with :func:`crc32_combine`. Other storage is read in 8 MiB pieces. ``seen`` gets the
    :func:`identity` of the local file hashed (opened beneath the directory, never through a link).
    """
    if not storage.parallel_reads or not map_file:
        return _range_crc32(storage, name, 0, None)
    threads = hash_threads() if threads is None else threads
    with storage.open_read(name) as f:
        if seen is not None:
            seen.append(identity(f.fileno()))
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                if threads <= 1 or size < 4 * _CHUNK:
                    return crc32(view)
                step = -(-size // threads // _CHUNK) * _CHUNK  # ranges in whole pieces
                ranges = [(start, min(step, size - start)) for start in range(0, size, step)]
                with ThreadPoolExecutor(len(ranges), thread_name_prefix="lplugins-checkpoint-verify") as pool:
                    crcs = list(pool.map(lambda r: crc32(view[r[0] : r[0] + r[1]]), ranges))
            finally:
                view.release()
    crc = crcs[0]
    for part, (_, length) in zip(crcs[1:], ranges[1:], strict=True):
        crc = crc32_combine(crc, part, length)
    return crc


def _range_crc32(storage: Storage, name: str, start: int, length: int | None) -> int:
    """The CRC32 of ``length`` bytes of file ``name`` from ``start`` (``None``: to the end), read in pieces."""
    crc = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    left = length
    with storage.open_read(name) as f:
        if start:
            f.seek(start)
        while left is None or left > 0:
            want = _CHUNK if left is None else min(_CHUNK, left)
            n = f.readinto(view[:want])  # type: ignore[attr-defined]
            if not n:
                break
            crc = crc32(view[:n], crc)
            if left is not None:
                left -= n
    return crc


def bytes_problem(
    storage: Storage, record: Record, rank: int = 0, world: int = 1, seen: list[Any] | None = None
) -> str | None:
    """Why the bytes of ``record``'s checkpoint do not match its marker, or ``None`` when they do.

    A file checkpoint is read whole on every rank (every rank loads all of it); of a directory
    checkpoint this rank reads every ``world``-th file (sorted by name), starting at its ``rank``.
    A marker without checksums (:func:`can_verify` is False) passes.
    """
    try:
        if record.kind == "dir":
            for rel in sorted(record.crcs)[rank::world]:
                crc = crc32_of(storage, f"{record.name}/{rel}")
                if crc != record.crcs[rel]:
                    return f"{rel}: CRC32 {crc:#010x} != committed {record.crcs[rel]:#010x}"
            return None
        if record.crc32 is not None:
            crc = crc32_of(storage, record.name, seen=seen)
            return None if crc == record.crc32 else f"CRC32 {crc:#010x} != committed {record.crc32:#010x}"
        if record.zip_crc:
            with storage.open_read(record.name) as f:
                try:
                    with zipfile.ZipFile(f) as zf:
                        bad = zf.testzip()
                except OSError:
                    raise
                except Exception as err:  # zipfile raises many types for a damaged archive
                    return f"damaged archive: {type(err).__name__}: {err}"
            return None if bad is None else f"archive CRC mismatch in {bad}"
    except OSError as err:
        return f"unreadable: {type(err).__name__}: {err}"
    return None


class Overlapped:
    """Runs ``check`` on a second thread from ``with`` until :meth:`result`.

    Args:
        check: Returns a problem (str) or ``None``; an exception it raises becomes the problem.

    Examples:
        >>> with Overlapped(lambda: None) as job:
        ...     pass  # load the same bytes here
        >>> job.result() is None
        True
    """

    def __init__(self, check: Callable[[], str | None]) -> None:
        self._check = check
        self._problem: str | None = None
        self._thread = threading.Thread(target=self._run, name="lplugins-checkpoint-verify", daemon=True)

    def _run(self) -> None:
        try:
            self._problem = self._check()
        except Exception as err:  # kept for result()
            self._problem = f"unreadable: {type(err).__name__}: {err}"

    def __enter__(self) -> Overlapped:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._thread.join()

    def result(self) -> str | None:
        """Wait for the check; its problem, or ``None`` when the bytes match."""
        self._thread.join()
        return self._problem
