"""The write-back stream: ``torch.save`` writes a checkpoint through :class:`StreamWriter`.

It passes the bytes straight to the file descriptor, asks the kernel to start writing them back every
few MiB (so the final ``fsync`` only waits for the tail), and computes the CRC32 of the whole file
without holding the writes up (tensor storages are hashed in place on a second thread while
``torch.save`` pickles). The CRC goes into the commit marker, where ``verify="deep"`` checks it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from types import TracebackType
from typing import IO, Any

from lplugins.callbacks._crc import crc32, crc32_combine

__all__ = ["WRITEBACK_BYTES", "StreamWriter"]

#: Start the kernel's write-back after every this many bytes (``sync_file_range``; Linux only).
WRITEBACK_BYTES = 8 << 20
#: Writes at least this large whose memory is "stable" are hashed in place on the second thread.
_IN_PLACE_BYTES = 64 << 10
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` back to disk, without waiting (advisory)."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _sync_file_range = fn
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # a failure only means no early write-back


def _address(view: memoryview) -> int | None:
    """The address of a read-only buffer's memory (None without NumPy: then every piece is hashed as written)."""
    try:
        import numpy
    except ImportError:  # pragma: no cover -- torchmetrics requires NumPy
        return None
    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


class StreamWriter:
    """A write-only binary stream for ``torch.save``: direct writes, early write-back, CRC32 off the critical path.

    ``torch.save`` pickles first, then hands every tensor storage to ``write`` in one piece, straight
    from the tensor's memory. Writes go to the descriptor (``os.write``; no user-space buffer); every
    :data:`WRITEBACK_BYTES` the kernel is asked to start flushing what was written, so
    :meth:`finish`'s ``fsync`` only waits for the tail.

    With ``checksum``, the CRC32 of the whole stream is computed without holding the writes up: the
    storages listed in ``stable`` are hashed in place by a second thread that starts right away (while
    ``torch.save`` is still pickling), everything else is hashed as it is written, and :meth:`finish`
    combines the pieces' CRCs in stream order.

    Args:
        target: An open file descriptor (local, synced by :meth:`finish`) or a binary file object.
        checksum: Compute the CRC32 of everything written.
        stable: ``{address: size}`` of memory that stays valid and unchanged until :meth:`finish` or
            the end of the ``with`` block (the tensor storages of the object being saved).
    """

    def __init__(self, target: int | IO[bytes], *, checksum: bool, stable: dict[int, int] | None = None) -> None:
        self._target = target
        self._checksum = checksum
        self._stable = dict(stable or {}) if checksum else {}
        self._offset = 0
        self._flushed = 0
        self._run_crc = 0  # CRC32 of the bytes written since the last stable piece
        self._run_len = 0
        self._pieces: list[tuple[int, int, int | None]] = []  # (crc, length, stable address or None)
        self._crcs: dict[int, int] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if self._stable:
            self._thread = threading.Thread(target=self._hash, name="lplugins-checkpoint-crc32", daemon=True)
            self._thread.start()

    def _hash(self) -> None:
        try:
            for address, size in self._stable.items():
                self._crcs[address] = crc32((ctypes.c_char * size).from_address(address))
        except BaseException as err:  # kept for finish()
            self._error = err

    def write(self, data: Any) -> int:
        """Write all of ``data`` (any buffer); return its length."""
        view = memoryview(data).cast("B")
        size = len(view)
        if self._checksum:
            address = _address(view) if size >= _IN_PLACE_BYTES and self._stable else None
            if address is not None and self._stable.get(address) == size:
                self._pieces.append((self._run_crc, self._run_len, None))
                self._pieces.append((0, size, address))
                self._run_crc, self._run_len = 0, 0
            else:
                self._run_crc = crc32(view, self._run_crc)
                self._run_len += size
        if isinstance(self._target, int):
            done = 0
            while done < size:
                done += os.write(self._target, view[done:])
            self._offset += size
            if self._offset - self._flushed >= WRITEBACK_BYTES:
                _start_writeback(self._target, self._flushed, self._offset - self._flushed)
                self._flushed = self._offset
        else:
            self._target.write(view)
            self._offset += size
        return size

    def flush(self) -> None:
        """Nothing is buffered here (``torch.save`` calls it)."""

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._offset

    def finish(self) -> int | None:
        """``fsync`` a descriptor target, then return the CRC32 of the stream (None without ``checksum``)."""
        if isinstance(self._target, int):
            os.fsync(self._target)
        self._join()
        if not self._checksum:
            return None
        if self._error is not None:
            raise self._error
        crc = 0
        for piece_crc, length, address in [*self._pieces, (self._run_crc, self._run_len, None)]:
            crc = crc32_combine(crc, self._crcs[address] if address is not None else piece_crc, length)
        return crc

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._join()  # the hashing thread reads the caller's memory: it must be done when the caller goes on
