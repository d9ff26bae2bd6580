"""The resource bounds of a checkpoint file, checked before torch unpickles it.

A file can pass its CRC check and torch's weights-only rules and still be built to hurt. torch's
unpickler admits tuples, lists, dicts, sets, ``bytearray`` and ``_codecs.encode``: ~40 nested tuples
that share their parts make a dict key that takes 2^40 steps to hash (a 700-byte file); lists that share
lists (a "billion laughs") make every later walk of the state exponential; lists nested 10^5 deep end a
walk in a ``RecursionError``; a list that holds itself makes it endless; 10^5 dict keys chosen to share
one hash make building the dict quadratic; ``bytearray(10**10)`` allocates; an ``encode`` with the
punycode codec is quadratic. And the zip around the pickle can say one thing to Python's reader and
another to torch's: an entry named ``DATA.PKL`` beside ``data.pkl`` (torch matches names without case),
a second central directory (torch reads the one the end record points to, Python the one just before it).
Each would hang or crash the resume *after* the file was accepted, where nothing falls back.

:func:`check_file` reads the zip's directory and its ``data.pkl`` (nothing is unpickled) and refuses:

* a file that is not a zip (torch has written zip files since 1.6); a zip with a comment or bytes after its
  end record, or whose central directory is not where its end record says; two entries whose names differ
  only in case; not exactly one top-level ``*/data.pkl``;
* entries that declare more bytes than :data:`INFLATION` times the file (torch stores them uncompressed);
* a ``data.pkl`` over :data:`MAX_PICKLE_BYTES`;
* an object graph (:mod:`lplugins._bounds._pickle`) nested deeper than 100, one that refers to itself, one
  that expands (each shared part counted every time it is used) to more than 16 objects per pickled byte
  (10^7 at least), one with more containers or memo entries than the file's size allows; a dict or set with
  more than 64 keys of one hash (numbers, tuples, complex numbers and ``torch.Size`` of them can be chosen to
  collide; strings are hashed at random per process) or whose hash cannot be known; ``bytearray`` of anything
  but bytes; ``_codecs.encode`` with another encoding than latin1; a legacy tensor constructor
  (``torch.FloatTensor(n)``) with a size; each of these also when called through
  ``torch._tensor._rebuild_from_type_v2``.

A checkpoint Lightning writes nests about 8 deep and expands to a few objects per pickled byte. A refusal
raises :class:`~lplugins._errors.UnsafeCheckpointError` naming the file and the bound; the resume treats it
as it treats what torch's weights-only load refuses: the file is skipped (left in place) and the next older
one tried. The check's own cost is linear in the pickle, with memory bounded by the file's size.
"""

from __future__ import annotations

import copy
import os
import struct
import zipfile
import zlib
from typing import Any, BinaryIO

from lplugins._bounds._pickle import Bounds, check_pickle
from lplugins._errors import UnsafeCheckpointError

__all__ = ["INFLATION", "MAX_PICKLE_BYTES", "check_file", "check_pickle"]

MAX_PICKLE_BYTES = 64 * 2**20
INFLATION = 2
#: Bytes of file per container (or memo entry) the pickle may have, beyond the first two million (~150 bytes each).
FILE_BYTES_PER_NODE = 16

_EOCD = struct.Struct("<4s4H2LH")  # signature, disks, entries (2), directory size, directory offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")


def check_file(path: Any, file: BinaryIO | None = None) -> None:
    """Refuse ``path`` before torch reads it when it exceeds a bound (see the module docstring).

    Args:
        path: The checkpoint file (named in the error).
        file: The file already opened (read from its start; left open), else ``path`` is opened.

    Raises:
        UnsafeCheckpointError: a bound exceeded, naming the file and the bound.
    """
    try:
        if file is None:
            with open(path, "rb") as opened:
                _check_zip(opened)
        else:
            file.seek(0)
            _check_zip(file)
    except Bounds as why:
        raise UnsafeCheckpointError(
            f"Refusing to load checkpoint {os.fspath(path)!r}: {why} (nothing in it was unpickled; lplugins' bounds"
            ' for a checkpoint file, docs/checkpoint.md, "The directory is untrusted input").'
        ) from None


def _directory_offset(file: BinaryIO, size: int) -> int:
    """Where the zip's end record (no comment, at the very end, as torch writes it) says its directory starts."""
    if size < _EOCD.size:
        raise Bounds("it is not a zip file as torch.save writes (too short)")
    file.seek(size - _EOCD.size)
    signature, _, _, _, _, _, offset, comment = _EOCD.unpack(file.read(_EOCD.size))
    if signature != b"PK\x05\x06" or comment:
        raise Bounds(
            "it is not a zip file ending in its end record, as torch.save writes (a comment or bytes after it)"
        )
    if offset != 0xFFFFFFFF:
        return int(offset)
    start = size - _EOCD.size - _ZIP64_LOCATOR.size
    file.seek(max(0, start))
    signature, _, record, _ = _ZIP64_LOCATOR.unpack(file.read(_ZIP64_LOCATOR.size))
    if start < 0 or signature != b"PK\x06\x07" or record > start:
        raise Bounds("its zip64 end record is not where its locator says")
    file.seek(record)
    fields = _ZIP64_EOCD.unpack(file.read(_ZIP64_EOCD.size))
    if fields[0] != b"PK\x06\x06":
        raise Bounds("its zip64 end record is not where its locator says")
    return int(fields[-1])


def _check_zip(file: BinaryIO) -> None:
    size = os.fstat(file.fileno()).st_size
    try:
        offset = _directory_offset(file, size)
        file.seek(0)
        archive = zipfile.ZipFile(file)
        if archive.start_dir != offset:  # Python found another directory than the one torch reads
            raise Bounds("its central directory is not where its end record says (data before or inside it)")
        entries = archive.infolist()
        names = [entry.filename.lower() for entry in entries]
        if len(set(names)) != len(names):
            raise Bounds("two of its entries have the same name but for case (torch matches names without case)")
        declared = sum(entry.file_size for entry in entries)
        if declared > INFLATION * size + 2**20:
            raise Bounds(f"its zip entries declare {declared} bytes in a file of {size} bytes")
        pickles = [e for e, n in zip(entries, names, strict=True) if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise Bounds(f"it holds {len(pickles)} top-level data.pkl entries, not one")
        if pickles[0].file_size > MAX_PICKLE_BYTES:
            raise Bounds(f"its data.pkl declares {pickles[0].file_size} bytes (at most {MAX_PICKLE_BYTES})")
        entry_info = copy.copy(pickles[0])
        del entry_info.CRC  # torch writes records without CRC32s when asked (DurableCheckpoint's own CRC covers them)
        with archive.open(entry_info) as entry:  # reads at most the declared size
            data = entry.read(MAX_PICKLE_BYTES + 1)
    except Bounds:
        raise
    except (
        zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError, OSError, ValueError, EOFError, KeyError,
        struct.error, IndexError, OverflowError,
    ) as err:  # fmt: skip
        raise Bounds(f"its zip archive cannot be read as torch.save writes it ({type(err).__name__}: {err})") from None
    if len(data) > MAX_PICKLE_BYTES:
        raise Bounds(f"its data.pkl is over {MAX_PICKLE_BYTES} bytes")
    check_pickle(data, node_limit=size // FILE_BYTES_PER_NODE)
