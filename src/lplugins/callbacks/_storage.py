"""The ``Storage`` protocol: file operations on one checkpoint directory, and the commit protocol on top.

A checkpoint exists for resume only when its commit marker (``NAME.commit``, see
:mod:`~lplugins.callbacks._record`) exists and the data matches it. Everything is written under a
temporary name in the target directory, flushed and ``fsync``-ed, then renamed; the directory is
``fsync``-ed after every rename, so a crash at any instant leaves either the previous state or the
new one. Uncommitted leftovers (``.tmp.*`` entries, data without a marker) are invisible to
:meth:`Storage.find_committed` and removed by :meth:`Storage.clean_leftovers`; a *committed*
checkpoint whose data no longer matches its marker, or an unreadable marker, is never deleted: it is
moved to ``dirpath/quarantine/`` (:meth:`Storage.quarantine`) with a file saying why.

:class:`Storage` declares the primitives (abstract) and implements the commit protocol once, on top
of them. Two implementations: :class:`~lplugins.callbacks._storage_local.LocalStorage` (with
``fsync``) and :class:`~lplugins.callbacks._storage_fsspec.FsspecStorage` (remote ``fsspec`` URLs:
the same order of operations, data first, marker last, marker removed first on delete, but no
``fsync``: durability is whatever the store gives a finished upload). :func:`open_storage` picks one.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from lplugins._lightning.converted import CONVERTED_SUFFIX
from lplugins.callbacks._crc import crc32
from lplugins.callbacks._record import COMMIT_SUFFIX, NAME_RE, QUARANTINE, TMP_PREFIX, Record, order
from lplugins.callbacks._stream import StreamWriter

__all__ = ["Cleanup", "Storage", "canonical_dirpath", "is_remote"]

#: The file in a quarantined checkpoint's folder that says why it was moved there.
REASON_FILE = "REASON.txt"


@dataclass
class Cleanup:
    """What :meth:`Storage.clean_leftovers` did.

    Attributes:
        uncommitted: Removed entries that were never committed (``.tmp.*``, data without a marker).
        orphans: Removed commit markers whose data is gone (an interrupted save or delete).
        quarantined: ``(name, reason, where)`` of each committed checkpoint (or unreadable marker) moved aside.
    """

    uncommitted: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    quarantined: list[tuple[str, str, str]] = field(default_factory=list)

    def announce(self, dirpath: str) -> None:
        """Say once on rank zero what was removed or moved aside in ``dirpath``."""
        from lplugins._log import announce

        def listing(names: list[str]) -> str:
            return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

        if self.uncommitted:
            announce(
                "lplugins: DurableCheckpoint removed %d uncommitted leftover(s) of interrupted saves in %s (never"
                " committed, never resumed from): %s",
                len(self.uncommitted), dirpath, listing(self.uncommitted),
            )  # fmt: skip
        if self.orphans:
            announce(
                "lplugins: DurableCheckpoint removed %d commit marker(s) whose data is gone (an interrupted save"
                " or delete) in %s: %s",
                len(self.orphans), dirpath, listing(self.orphans),
            )  # fmt: skip
        for name, reason, where in self.quarantined:
            announce(
                "lplugins: DurableCheckpoint: committed checkpoint %s is damaged (%s): moved to %s (kept for"
                " inspection, never resumed from)",
                name, reason, where,
            )  # fmt: skip


_CHUNK = 8 << 20
#: The most bytes a commit marker may hold (one lists a directory checkpoint's files: kilobytes, not more).
MARKER_LIMIT = 16 << 20


def is_remote(path: str) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://...``) rather than a local path."""
    return "://" in path and not path.startswith("file://")


def canonical_dirpath(dirpath: str | os.PathLike[str] | None) -> str | None:
    """``dirpath`` spelled one way: the same directory written ``ckpts``, ``ckpts/``, ``./ckpts`` is one string.

    Local paths are normalized (``~`` expanded, ``file://`` dropped, ``.``, ``..``, repeated and trailing
    separators removed) but not made absolute: a run directory moved or copied elsewhere keeps its
    spelling. URLs keep their scheme; their path is normalized the same way (trailing ``/`` removed).

    >>> [canonical_dirpath(p) for p in ("ckpts", "ckpts/", "./ckpts", "a/../ckpts//", "s3://b/ckpts/", None)]
    ['ckpts', 'ckpts', 'ckpts', 'ckpts', 's3://b/ckpts', None]
    """
    if dirpath is None:
        return None
    path = os.fspath(dirpath)
    if path.startswith("file://"):
        path = path[len("file://") :]
    if is_remote(path):
        scheme, rest = path.split("://", 1)
        return f"{scheme}://{posixpath.normpath(rest)}" if rest.strip("/") else f"{scheme}://{rest}"
    return os.path.normpath(os.path.expanduser(path))


class Storage(ABC):
    """One checkpoint directory: abstract file primitives, and the commit protocol written once on top.

    Args:
        dirpath: The checkpoint directory (a local path or an fsspec URL).
    """

    #: Whether several handles may read one file at once from threads (ranges hashed in parallel).
    parallel_reads = False

    def __init__(self, dirpath: str) -> None:
        self.dirpath = str(dirpath)

    # --- primitives (each implementation) ------------------------------------------------------
    @abstractmethod
    def path(self, name: str) -> str:
        """The full path of entry ``name``."""

    @abstractmethod
    def makedirs(self) -> None:
        """Create the directory (and parents)."""

    @abstractmethod
    def listdir(self) -> list[str]:
        """Entry names in the directory (empty when it does not exist)."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether entry ``name`` exists."""

    @abstractmethod
    def isdir(self, name: str) -> bool:
        """Whether entry ``name`` is a directory."""

    @abstractmethod
    def size(self, name: str) -> int:
        """Size in bytes of file ``name``."""

    @abstractmethod
    def tree_sizes(self, name: str) -> dict[str, int]:
        """Relative path -> size of every file under directory ``name``."""

    @abstractmethod
    def open_read(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """Open file ``name`` for reading (binary)."""

    @abstractmethod
    def open_write(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """Open a new file ``name`` for writing (binary)."""

    @abstractmethod
    def mkdir(self, name: str) -> None:
        """Create the directory ``name`` (a relative path; parents too) inside the checkpoint directory."""

    @abstractmethod
    def rename(self, src: str, dst: str, sync_dir: bool = True) -> None:
        """Rename entry ``src`` to ``dst`` (atomic locally; copy+delete on most object stores) and persist it."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Remove entry ``name`` (file or directory); missing entries are ignored."""

    @abstractmethod
    def _write_tmp(self, tmp: str, write: Callable[[Any], None]) -> None:
        """Have ``write`` fill the new temporary file ``tmp`` (given its path or an open file), durably."""

    @abstractmethod
    def _stream_tmp(
        self, tmp: str, write: Callable[[StreamWriter], None], checksum: bool, stable: dict[int, int] | None
    ) -> int | None:
        """Have ``write`` fill the new temporary file ``tmp`` through a :class:`StreamWriter`; its CRC32."""

    @abstractmethod
    def fsync_dir(self) -> None:
        """Make renames and unlinks in the directory durable (no-op where there is no ``fsync``)."""

    @abstractmethod
    def fsync_tree(self, name: str) -> None:
        """``fsync`` a file, or everything under a directory (no-op where there is no ``fsync``)."""

    @abstractmethod
    def sync_file(self, f: IO[bytes]) -> None:
        """``fsync`` an open, flushed file (no-op where there is no ``fsync``)."""

    def archive_problem(self, record: Record, deep: bool) -> str | None:
        """What is wrong with a file checkpoint's zip archive, or ``None`` (not checked where reading is costly)."""
        return None

    # --- writing -------------------------------------------------------------------------------
    def tmp_name(self, name: str, unique: bool = True) -> str:
        """A temporary name for ``name`` in the same directory (same filesystem, so rename is atomic)."""
        return f"{TMP_PREFIX}{name}.{uuid.uuid4().hex[:12]}" if unique else f"{TMP_PREFIX}{name}"

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
        self._refuse_existing(name)
        tmp = self.tmp_name(name)
        try:
            self._write_tmp(tmp, write)
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
        self._refuse_existing(name)
        tmp = self.tmp_name(name)
        try:
            crc = self._stream_tmp(tmp, write, checksum, stable)
            self.rename(tmp, name, sync_dir=False)
        except BaseException:
            self.remove(tmp)
            raise
        return crc

    def _refuse_existing(self, name: str) -> None:
        if self.exists(name):
            raise FileExistsError(f"{self.path(name)} exists already; a committed file is never overwritten")

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """The contents of file ``name``.

        Raises:
            ValueError: it holds more than ``limit`` bytes (it is not read further).
        """
        with self.open_read(name) as f:
            data = f.read() if limit is None else f.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise ValueError(f"{name} holds more than {limit} bytes: not a file lplugins wrote")
        return data

    def write_small(self, name: str, data: bytes) -> None:
        """Write a small new file ``name`` (any relative path) and sync it (not atomic: for notes)."""
        with self.open_write(name) as f:
            f.write(data)
            f.flush()
            self.sync_file(f)

    def file_crc32(self, name: str) -> int:
        """CRC32 of every byte of file ``name``."""
        crc = 0
        with self.open_read(name) as f:
            while chunk := f.read(_CHUNK):
                crc = crc32(chunk, crc)
        return crc

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
                self.sync_file(f)
        finally:
            self.remove(name)

    # --- the commit protocol -------------------------------------------------------------------
    def commit(self, record: Record) -> None:
        """Write the commit marker of ``record.name`` (durably, last). The data must be in place and synced."""
        data = record.to_json()
        self.write_durable(record.name + COMMIT_SUFFIX, lambda target: _write_bytes(target, data))

    def delete(self, name: str) -> None:
        """Delete a committed checkpoint: the marker first (it stops being visible), then the data.

        One directory ``fsync`` at the end: if a crash persists the data's removal but not the marker's,
        the marker's data check fails, so it is invisible and cleaned up at the next start.
        """
        self.remove(name + COMMIT_SUFFIX)
        self.remove(name)
        self.remove(name + CONVERTED_SUFFIX)  # its conversions (another world size, another strategy) go with it
        self.fsync_dir()

    def check(self, record: Record, deep: bool = False, archive: bool = True) -> str | None:
        """Why the data of ``record`` does not match its marker, or ``None`` when it does.

        Args:
            record: The commit record.
            deep: Also read every byte of a file checkpoint and check its CRC32 (or its zip CRCs).
            archive: Also parse a file checkpoint's zip directory (``False`` where its CRC32 is checked
                anyway: matching bytes are the committed, readable archive).
        """
        name = record.name
        if not self.exists(name):
            return "data missing"
        if record.kind == "dir":
            if not self.isdir(name):
                return "not a directory"
            try:
                sizes = self.tree_sizes(name)
            except OSError as err:  # a link, a FIFO or a device inside it (_untrusted)
                return f"unreadable: {err}"
            for rel, size in record.files.items():
                if sizes.get(rel) != size:
                    return f"{rel}: size {sizes.get(rel)} != {size}"
            if deep:
                for rel, committed in sorted(record.crcs.items()):
                    try:
                        crc = self.file_crc32(f"{name}/{rel}")
                    except OSError as err:
                        return f"{rel}: unreadable: {err}"
                    if crc != committed:
                        return f"{rel}: CRC32 {crc:#010x} != committed {committed:#010x}"
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
        return self.archive_problem(record, deep) if archive or deep else None

    def markers(self) -> Iterator[tuple[Record | None, str, str | None]]:
        """Every commit marker in the directory: ``(record, marker name, problem)``.

        ``record`` is None when the marker cannot be read, is not a marker of a known format, has a field
        of the wrong type, or names another checkpoint; ``problem`` then says which.
        """
        for entry in self.listdir():
            if not entry.endswith(COMMIT_SUFFIX) or entry.startswith(TMP_PREFIX):
                continue
            try:
                record: Record | None = Record.from_json(self.read_bytes(entry, limit=MARKER_LIMIT))
                problem = None
            except (OSError, ValueError, TypeError, RecursionError) as err:
                record, problem = None, f"unreadable commit marker: {err}"
            if record is not None and record.name + COMMIT_SUFFIX != entry:
                problem = f"commit marker names another checkpoint ({record.name!r})"
                record = None
            yield record, entry, problem

    def records(self) -> Iterator[tuple[Record | None, str]]:
        """Every commit marker in the directory: ``(record, marker name)``; ``record`` is None when unreadable."""
        for record, entry, _problem in self.markers():
            yield record, entry

    def find_committed(self, deep: bool = False) -> list[Record]:
        """Committed checkpoints whose data matches their marker, oldest (lowest ``seq``) first."""
        out = [r for r, _ in self.records() if r is not None and self.check(r, deep=deep) is None]
        out.sort(key=order)
        return out

    def quarantine(self, name: str, reason: str) -> str:
        """Move checkpoint ``name`` (its data and its marker, whichever exist) aside; return where it went.

        It goes to ``quarantine/NAME`` (``quarantine/NAME.1``, ... when that is taken) with
        :data:`REASON_FILE` saying why; nothing is deleted. The data moves first: a crash in between leaves
        a marker without data, which the next start removes (the data is safe in the quarantine).
        """
        self.real_folder(QUARANTINE)
        taken = set(self.listdir_of(QUARANTINE))
        folder_name, n = name, 0
        while folder_name in taken:
            n += 1
            folder_name = f"{name}.{n}"
        folder = f"{QUARANTINE}/{folder_name}"
        self.mkdir(folder)
        for entry in (name, name + COMMIT_SUFFIX):
            if self.exists(entry):
                self.rename(entry, f"{folder}/{entry}", sync_dir=False)
        self.write_small(f"{folder}/{REASON_FILE}", (reason.rstrip() + "\n").encode())
        self.fsync_tree(folder)  # the folder's entries (its files are synced already: cheap)
        self.fsync_dir()
        return self.path(folder)

    def real_folder(self, name: str) -> None:
        """Make sure entry ``name`` is a folder of this directory, not a link to one elsewhere (local storage
        replaces a link, or a file, by a new folder: what it pointed to is not touched); others do nothing."""
        return None

    def listdir_of(self, name: str) -> list[str]:
        """Entry names in the sub-directory ``name`` (empty when it does not exist)."""
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self._listdir_path(name))
        except (FileNotFoundError, NotADirectoryError):
            return []

    @abstractmethod
    def _listdir_path(self, name: str) -> list[str]:
        """Entries of sub-directory ``name`` (raises FileNotFoundError when missing)."""

    def clean_leftovers(self, names: re.Pattern[str] = NAME_RE) -> Cleanup:
        """Clean what a crash can leave behind, and move damaged committed checkpoints aside.

        Removes temporary entries, data that was never committed (only when its name matches ``names``,
        the pattern of the callback's :class:`NameTemplate`: anything else is left alone), and markers
        whose data is missing (an interrupted save or delete). A marker that cannot be read (or has a field
        of the wrong type), or whose data does not match it (size, archive directory), is a committed
        checkpoint gone bad: both are moved to the quarantine (:meth:`quarantine`), never deleted.
        The ``quarantine`` folder itself is never touched.
        """
        entries = self.listdir()
        done = Cleanup()
        committed: set[str] = set()
        for record, marker, problem in list(self.markers()):
            if record is not None:
                if not self.exists(record.name):
                    self.remove(marker)
                    done.orphans.append(marker)
                    continue
                problem = self.check(record)
                if problem is None:
                    committed.add(record.name)
                    continue
            name = marker[: -len(COMMIT_SUFFIX)]
            committed.add(name)  # moved with its marker, not removed as uncommitted data
            where = self.quarantine(name, f"{problem}\nfound when cleaning up the directory at the start of fit")
            done.quarantined.append((name, str(problem), where))
        for entry in entries:
            if entry.endswith(CONVERTED_SUFFIX) and entry[: -len(CONVERTED_SUFFIX)] not in committed:
                self.remove(entry)  # the conversions of a checkpoint that is gone
                done.uncommitted.append(entry)
            elif entry.startswith(TMP_PREFIX) or (names.match(entry) and entry not in committed):
                self.remove(entry)
                done.uncommitted.append(entry)
        if done.uncommitted or done.orphans:
            self.fsync_dir()
        return done


def _write_bytes(target: Any, data: bytes) -> None:
    """Write ``data`` to a path or an open binary file."""
    if isinstance(target, str):
        with open(target, "xb") as f:
            f.write(data)
    else:
        target.write(data)
