"""On-disk layout and the atomic, durable commit protocol of :class:`~lplugins.callbacks.DurableCheckpoint`.

A checkpoint directory holds, for every committed checkpoint ``NAME``:

* ``NAME`` -- the data: a file (``torch.save`` zip) or a directory (sharded strategies such as DeepSpeed);
* ``NAME.commit`` -- the commit marker, a small JSON record written *last*.

A checkpoint exists for resume only when its marker exists and the data matches it. Everything is
written under a temporary name (``.tmp.*``) in the target directory, flushed and ``fsync``-ed, then
renamed; the directory is ``fsync``-ed after every rename, so a crash at any instant leaves either
the previous state or the new one. Uncommitted leftovers (``.tmp.*`` entries, data without a
marker) are invisible to :func:`find_committed` and removed by :func:`clean_leftovers`.

Remote ``fsspec`` paths get the same order of operations (data first, marker last, marker removed
first on delete) but no ``fsync``: durability is whatever the store gives a finished upload.

Checkpoint data goes through :class:`StreamWriter`: ``torch.save`` writes into it, it passes the bytes
straight to the file descriptor, asks the kernel to start writing them back every few MiB (so the
final ``fsync`` only waits for the tail), and computes the CRC32 of the whole file without holding
the writes up (tensor storages are hashed in place on a second thread while ``torch.save`` pickles).
The CRC goes into the commit marker, where ``verify="deep"`` checks it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import shutil
import sys
import threading
import time
import uuid
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import IO, Any

COMMIT_SUFFIX = ".commit"
TMP_PREFIX = ".tmp."
FORMAT_VERSION = 1
NAME_RE = re.compile(r"^step=(\d+)-epoch=(\d+)(-v\d+)?\.ckpt$")


def checkpoint_name(global_step: int, epoch: int, version: int = 0) -> str:
    """The name of the checkpoint taken after ``global_step`` optimizer steps in ``epoch``.

    ``version`` > 0 adds ``-vN``: a name that a checkpoint of another run holds already is never reused.
    """
    suffix = f"-v{version}" if version else ""
    return f"step={global_step:09d}-epoch={epoch:04d}{suffix}.ckpt"


def is_remote(path: str) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://...``) rather than a local path."""
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


@dataclass
class Record:
    """What a commit marker says about one committed checkpoint.

    Attributes:
        name: The checkpoint's name in its directory.
        global_step: ``trainer.global_step`` when it was taken.
        epoch: ``trainer.current_epoch`` when it was taken.
        time: Wall-clock time of the commit (seconds since the epoch).
        kind: ``"file"`` or ``"dir"``.
        size: Size in bytes of a file checkpoint.
        files: For a directory checkpoint, each file's relative path and size.
        monitor: The monitored metric's name, if any.
        metric: Its value when the checkpoint was taken, if it was logged.
        reason: What triggered the save (``"step"``, ``"epoch"``, ``"time"``, ``"request"``, ...).
        seq: Commit sequence number in this directory (1, 2, ...): "newest" means the highest, whatever
            the step numbers and clocks say (a fresh run in a used directory is newer than the old run).
        crc32: CRC32 of the whole file checkpoint, when it was computed (``verify="deep"`` checks it).
        zip_crc: Whether the archive's per-record CRC32s were written (checked by ``verify="deep"``
            when there is no ``crc32``).
    """

    name: str
    global_step: int
    epoch: int
    time: float
    kind: str = "file"
    size: int = 0
    files: dict[str, int] = field(default_factory=dict)
    monitor: str | None = None
    metric: float | None = None
    reason: str = ""
    seq: int = 0
    crc32: int | None = None
    zip_crc: bool = True
    format: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Record:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise ValueError("not a commit marker of a known format")
        allowed = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in allowed})


class Storage:
    """File operations on one checkpoint directory, local (with ``fsync``) or fsspec remote (without).

    Args:
        dirpath: The checkpoint directory (a local path or an fsspec URL).
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = str(dirpath)
        self.remote = is_remote(self.dirpath)
        self._fs: Any = None
        if self.remote:
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.dirpath)[0]

    # --- paths -------------------------------------------------------------------------------
    def path(self, name: str) -> str:
        """The full path of entry ``name``."""
        if self.remote:
            return self.dirpath.rstrip("/") + "/" + name
        return os.path.join(_local(self.dirpath), name)

    def tmp_name(self, name: str, unique: bool = True) -> str:
        """A temporary name for ``name`` in the same directory (same filesystem, so rename is atomic)."""
        return f"{TMP_PREFIX}{name}.{uuid.uuid4().hex[:12]}" if unique else f"{TMP_PREFIX}{name}"

    # --- primitives ----------------------------------------------------------------------------
    def makedirs(self) -> None:
        """Create the directory (and parents)."""
        if self.remote:
            self._fs.makedirs(self.dirpath, exist_ok=True)
        else:
            os.makedirs(_local(self.dirpath), exist_ok=True)

    def listdir(self) -> list[str]:
        """Entry names in the directory (empty when it does not exist)."""
        if self.remote:
            try:
                return [p.rstrip("/").rsplit("/", 1)[-1] for p in self._fs.ls(self.dirpath, detail=False)]
            except FileNotFoundError:
                return []
        try:
            return os.listdir(_local(self.dirpath))
        except FileNotFoundError:
            return []

    def exists(self, name: str) -> bool:
        """Whether entry ``name`` exists."""
        return bool(self._fs.exists(self.path(name))) if self.remote else os.path.lexists(self.path(name))

    def fsync_dir(self) -> None:
        """Make renames and unlinks in the directory durable (no-op on remote stores)."""
        if self.remote:
            return
        fd = os.open(_local(self.dirpath), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_tree(self, name: str) -> None:
        """``fsync`` a file, or every file and directory under a directory (no-op on remote stores)."""
        if self.remote:
            return
        top = self.path(name)
        if os.path.isdir(top):
            for root, _dirs, files in os.walk(top):
                for f in files:
                    _fsync_path(os.path.join(root, f))
                _fsync_path(root)
        else:
            _fsync_path(top)

    def open_write(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """Open ``name`` for writing (binary)."""
        if self.remote:
            return self._fs.open(self.path(name), "wb")
        return open(self.path(name), "xb")  # "x": never overwrite anything in place

    def write_durable(self, name: str, write: Callable[[Any], None], sync_dir: bool = True) -> None:
        """Write ``name`` atomically: write to a temporary name, flush, ``fsync``, rename, ``fsync`` the directory.

        Args:
            name: The final entry name.
            write: Called with the temporary file's path (local) or an open binary file (remote); it
                writes the whole contents (``torch.save`` accepts either).
            sync_dir: ``fsync`` the directory after the rename. The data of a checkpoint skips it: the
                commit marker's directory ``fsync`` persists both renames, and a marker whose data did
                not survive a crash is invisible (the data check fails) and cleaned up.

        Raises:
            FileExistsError: ``name`` exists already (a finished file is never overwritten).
            OSError: the write failed; the temporary file is removed and nothing else changed.
        """
        if self.exists(name):
            raise FileExistsError(f"{self.path(name)} exists already; a committed file is never overwritten")
        tmp = self.tmp_name(name)
        try:
            if self.remote:
                with self.open_write(tmp) as f:
                    write(f)
            else:
                write(self.path(tmp))
                _fsync_path(self.path(tmp))
            self.rename(tmp, name, sync_dir=sync_dir)
        except BaseException:
            self.remove(tmp)
            raise

    def write_stream(
        self, name: str, write: Callable[[StreamWriter], None], checksum: bool, stable: dict[int, int] | None = None
    ) -> int | None:
        """Write file ``name`` atomically through a :class:`StreamWriter`; return its CRC32 (or None).

        Like :meth:`write_durable` (temporary name, ``fsync``, rename; the directory is not synced: the
        commit marker's directory ``fsync`` persists the rename), but the data streams straight to the
        file descriptor with early write-back, and the checksum is computed while writing.

        Args:
            name: The final entry name.
            write: Called with the open stream; writes the whole contents (``torch.save(obj, stream)``).
            checksum: Compute the CRC32 of the whole file.
            stable: ``{address: size}`` of memory that stays unchanged until this returns (the tensor
                storages being saved): hashed in place on a second thread, from the start.

        Raises:
            FileExistsError: ``name`` exists already.
            OSError: the write failed; the temporary file is removed and nothing else changed.
        """
        if self.exists(name):
            raise FileExistsError(f"{self.path(name)} exists already; a committed file is never overwritten")
        tmp = self.tmp_name(name)
        try:
            if self.remote:
                with self.open_write(tmp) as f, StreamWriter(f, checksum=checksum, stable=stable) as stream:
                    write(stream)
                    crc = stream.finish()
            else:
                fd = os.open(self.path(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
                try:
                    with StreamWriter(fd, checksum=checksum, stable=stable) as stream:
                        write(stream)
                        crc = stream.finish()
                finally:
                    os.close(fd)
            self.rename(tmp, name, sync_dir=False)
        except BaseException:
            self.remove(tmp)
            raise
        return crc

    def rename(self, src: str, dst: str, sync_dir: bool = True) -> None:
        """Rename entry ``src`` to ``dst`` (atomic locally; copy+delete on most object stores) and persist it."""
        if self.remote:
            self._fs.mv(self.path(src), self.path(dst), recursive=True)
            return
        if os.path.lexists(self.path(dst)):
            raise FileExistsError(f"{self.path(dst)} exists already; a committed checkpoint is never overwritten")
        os.rename(self.path(src), self.path(dst))
        if sync_dir:
            self.fsync_dir()

    def remove(self, name: str) -> None:
        """Remove entry ``name`` (file or directory); missing entries are ignored."""
        path = self.path(name)
        if self.remote:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm(path, recursive=True)
            return
        with contextlib.suppress(FileNotFoundError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)

    def read_bytes(self, name: str) -> bytes:
        """The contents of file ``name``."""
        if self.remote:
            return bytes(self._fs.cat_file(self.path(name)))
        with open(self.path(name), "rb") as f:
            return f.read()

    def size(self, name: str) -> int:
        """Size in bytes of file ``name``."""
        return int(self._fs.size(self.path(name))) if self.remote else os.path.getsize(self.path(name))

    def isdir(self, name: str) -> bool:
        """Whether entry ``name`` is a directory."""
        return bool(self._fs.isdir(self.path(name))) if self.remote else os.path.isdir(self.path(name))

    def tree_sizes(self, name: str) -> dict[str, int]:
        """Relative path -> size of every file under directory ``name``."""
        top = self.path(name)
        out: dict[str, int] = {}
        if self.remote:
            for p, info in self._fs.find(top, detail=True).items():
                out[p[len(top) :].lstrip("/")] = int(info.get("size", 0))
            return out
        for root, _dirs, files in os.walk(top):
            for f in files:
                full = os.path.join(root, f)
                out[os.path.relpath(full, top)] = os.path.getsize(full)
        return out

    # --- the commit protocol -------------------------------------------------------------------
    def commit(self, record: Record) -> None:
        """Write the commit marker of ``record.name`` (durably, last). The data must be in place and synced."""
        self.write_durable(record.name + COMMIT_SUFFIX, lambda target: write_bytes(target, record.to_json()))

    def delete(self, name: str) -> None:
        """Delete a committed checkpoint: the marker first (it stops being visible), then the data.

        One directory ``fsync`` at the end: if a crash persists the data's removal but not the marker's,
        the marker's data check fails, so it is invisible and cleaned up at the next start.
        """
        self.remove(name + COMMIT_SUFFIX)
        self.remove(name)
        self.fsync_dir()

    def check(self, record: Record, deep: bool = False) -> str | None:
        """Why the data of ``record`` does not match its marker, or ``None`` when it does.

        Args:
            record: The commit record.
            deep: Also read every byte of a file checkpoint and check its zip CRCs.
        """
        name = record.name
        if not self.exists(name):
            return "data missing"
        if record.kind == "dir":
            if not self.isdir(name):
                return "not a directory"
            sizes = self.tree_sizes(name)
            for rel, size in record.files.items():
                if sizes.get(rel) != size:
                    return f"{rel}: size {sizes.get(rel)} != {size}"
            return None
        try:
            size = self.size(name)
        except OSError as err:
            return f"unreadable: {err}"
        if size != record.size:
            return f"size {size} != committed size {record.size} (truncated or overwritten)"
        if deep and record.crc32 is not None:
            try:
                crc = self.file_crc32(name)
            except OSError as err:
                return f"unreadable: {err}"
            return None if crc == record.crc32 else f"CRC32 {crc:#010x} != committed {record.crc32:#010x}"
        if self.remote:
            return None
        try:
            with zipfile.ZipFile(self.path(name)) as zf:
                if deep and record.zip_crc and (bad := zf.testzip()) is not None:
                    return f"CRC mismatch in {bad}"
        except (zipfile.BadZipFile, OSError) as err:
            return f"not a readable checkpoint archive: {err}"
        return None

    def file_crc32(self, name: str) -> int:
        """CRC32 of every byte of file ``name``."""
        crc = 0
        with self._fs.open(self.path(name), "rb") if self.remote else open(self.path(name), "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        return crc

    def records(self) -> Iterator[tuple[Record | None, str]]:
        """Every commit marker in the directory: ``(record, marker name)``; ``record`` is None when unreadable."""
        for entry in self.listdir():
            if not entry.endswith(COMMIT_SUFFIX) or entry.startswith(TMP_PREFIX):
                continue
            try:
                record: Record | None = Record.from_json(self.read_bytes(entry))
            except (OSError, ValueError, TypeError):
                record = None
            if record is not None and record.name + COMMIT_SUFFIX != entry:
                record = None
            yield record, entry

    def find_committed(self, deep: bool = False) -> list[Record]:
        """Committed checkpoints whose data matches their marker, oldest (lowest ``seq``) first."""
        out = [r for r, _ in self.records() if r is not None and self.check(r, deep=deep) is None]
        out.sort(key=order)
        return out

    def clean_leftovers(self) -> list[str]:
        """Remove what a crash can leave behind; return the removed names.

        Removes temporary entries, data that was never committed, unreadable markers, and markers whose
        data is missing or does not match. Only names this module creates are touched.
        """
        entries = self.listdir()
        removed: list[str] = []
        committed: set[str] = set()
        for record, marker in list(self.records()):
            if record is None or self.check(record) is not None:
                self.remove(marker)
                removed.append(marker)
            else:
                committed.add(record.name)
        for entry in entries:
            if entry.startswith(TMP_PREFIX) or (NAME_RE.match(entry) and entry not in committed):
                self.remove(entry)
                removed.append(entry)
        if removed:
            self.fsync_dir()
        return removed

    def probe_writable(self) -> None:
        """Create, sync and delete a file in the directory.

        Raises:
            OSError: the directory cannot be created or written.
        """
        self.makedirs()
        name = f"{TMP_PREFIX}probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            with self.open_write(name) as f:
                f.write(b"ok")
                f.flush()
                if not self.remote:
                    os.fsync(f.fileno())
        finally:
            self.remove(name)


_CHUNK = 8 << 20
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


# CRC32 of a concatenation from the CRC32s of its parts (zlib's crc32_combine; Python's zlib lacks it):
# polynomial arithmetic modulo the CRC-32 polynomial over GF(2), bit-reflected as in zlib.
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
    """The CRC32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    return _multmodp(_shift(len2), crc1) ^ crc2 if len2 else crc1


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
                self._crcs[address] = zlib.crc32((ctypes.c_char * size).from_address(address))
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
                self._run_crc = zlib.crc32(view, self._run_crc)
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


def order(record: Record) -> tuple[int, int, float]:
    """Sort key: commit order."""
    return (record.seq, record.global_step, record.time)


def write_bytes(target: Any, data: bytes) -> None:
    """Write ``data`` to a path or an open binary file."""
    if isinstance(target, str):
        with open(target, "xb") as f:
            f.write(data)
    else:
        target.write(data)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def now() -> float:
    """Wall-clock time for commit records."""
    return time.time()
