"""CRC32 for checkpoints: :func:`crc32`, the fastest implementation installed, and :func:`crc32_combine`.

:func:`crc32` is ISA-L's SIMD CRC32 (the ``isal`` package, a dependency: ~4x ``zlib.crc32`` on this
project's x86 machines, ~14 GB/s) or, where ``isal`` cannot be installed, ``zlib.crc32``. Both compute the
same checksum (zlib's polynomial) and release the GIL while they hash, so markers written with either
verify with the other.

:func:`crc32_combine` gives the CRC32 of a concatenation from the CRC32s of its parts (Python's ``zlib``
lacks it): polynomial arithmetic modulo the CRC-32 polynomial over GF(2), bit-reflected as in zlib's
``crc32_combine``. :class:`~lplugins.callbacks._stream.StreamWriter` uses it to hash the pieces of a
checkpoint on two threads and join the results in stream order.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

__all__ = ["CRC32_IMPLEMENTATION", "crc32", "crc32_combine"]

crc32: Callable[..., int]
try:
    from isal.isal_zlib import crc32 as crc32

    #: Which library :func:`crc32` comes from (``"isal"`` or ``"zlib"``).
    CRC32_IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover -- isal has wheels for Linux, macOS and Windows on x86-64 and arm64
    crc32 = zlib.crc32
    CRC32_IMPLEMENTATION = "zlib"

_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (``a`` nonzero)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


@functools.lru_cache(maxsize=1024)
def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the CRC polynomial."""
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``.

    >>> crc32_combine(crc32(b"ab", 0), crc32(b"cd", 0), 2) == zlib.crc32(b"abcd")
    True
    """
    return _multmodp(_shift(len2), crc1) ^ crc2 if len2 else crc1
