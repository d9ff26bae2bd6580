"""``LocalStorage``: a checkpoint directory on a local (or mounted) filesystem, with ``fsync`` at every step."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import zipfile
from collections.abc import Callable
from typing import IO, Any

from lplugins.callbacks._record import Record
from lplugins.callbacks._storage import Storage
from lplugins.callbacks._stream import StreamWriter
from lplugins.callbacks._untrusted import UntrustedEntryError, lstat_beneath, open_beneath, what

__all__ = ["LocalStorage"]


class LocalStorage(Storage):
    """A local checkpoint directory (a path, or a ``file://`` URL): renames are atomic, data is ``fsync``-ed.

    Args:
        dirpath: The checkpoint directory.
    """

    parallel_reads = True

    def __init__(self, dirpath: str) -> None:
        super().__init__(dirpath)
        self._dir = self.dirpath[len("file://") :] if self.dirpath.startswith("file://") else self.dirpath

    def path(self, name: str) -> str:
        return os.path.join(self._dir, name)

    def makedirs(self) -> None:
        os.makedirs(self._dir, exist_ok=True)

    def listdir(self) -> list[str]:
        try:
            return os.listdir(self._dir)
        except FileNotFoundError:
            return []

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.path(name))

    def isdir(self, name: str) -> bool:  # a link to a directory is not one (_untrusted)
        try:
            return stat.S_ISDIR(lstat_beneath(self._dir, name).st_mode)
        except OSError:
            return False

    def size(self, name: str) -> int:
        mode = lstat_beneath(self._dir, name)
        if not stat.S_ISREG(mode.st_mode):
            raise UntrustedEntryError(errno.EINVAL, f"{name} is {what(mode.st_mode)}, not a regular file")
        return mode.st_size

    def tree_sizes(self, name: str) -> dict[str, int]:
        """Every regular file under directory ``name``; a link, FIFO or device in it is refused (``OSError``)."""
        top = self.path(name)
        out: dict[str, int] = {}
        for root, dirs, files in os.walk(top):
            for entry in (*dirs, *files):
                full = os.path.join(root, entry)
                mode = os.lstat(full).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    raise UntrustedEntryError(errno.EINVAL, f"{os.path.relpath(full, top)} is {what(mode)}")
            for f in files:
                full = os.path.join(root, f)
                out[os.path.relpath(full, top)] = os.lstat(full).st_size
        return out

    def open_read(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return os.fdopen(open_beneath(self._dir, name), "rb")

    def open_write(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return open(self.path(name), "xb")  # "x": never overwrite anything in place

    def real_folder(self, name: str) -> None:
        path = self.path(name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode):
            return
        if stat.S_ISLNK(mode):
            os.unlink(path)  # the link itself, inside the checkpoint directory
        else:  # a file, a FIFO, a device: kept, out of the way
            os.rename(path, self.path(f"{name}.not-a-folder.{os.urandom(4).hex()}"))

    def mkdir(self, name: str) -> None:
        os.makedirs(self.path(name), exist_ok=True)

    def _listdir_path(self, name: str) -> list[str]:
        return os.listdir(self.path(name))

    def rename(self, src: str, dst: str, sync_dir: bool = True) -> None:
        if os.path.lexists(self.path(dst)):
            raise FileExistsError(f"{self.path(dst)} exists already; a committed checkpoint is never overwritten")
        os.rename(self.path(src), self.path(dst))
        if sync_dir:
            self.fsync_dir()

    def remove(self, name: str) -> None:
        path = self.path(name)
        with contextlib.suppress(FileNotFoundError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)

    def _write_tmp(self, tmp: str, write: Callable[[Any], None]) -> None:
        write(self.path(tmp))
        _fsync_path(self.path(tmp))

    def _stream_tmp(
        self, tmp: str, write: Callable[[StreamWriter], None], checksum: bool, stable: dict[int, int] | None
    ) -> int | None:
        fd = os.open(self.path(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            with StreamWriter(fd, checksum=checksum, stable=stable) as stream:
                write(stream)
                return stream.finish()
        finally:
            os.close(fd)

    def fsync_dir(self) -> None:
        fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_tree(self, name: str) -> None:
        top = self.path(name)
        if os.path.isdir(top):
            for root, _dirs, files in os.walk(top):
                for f in files:
                    _fsync_path(os.path.join(root, f))
                _fsync_path(root)
        else:
            _fsync_path(top)

    def sync_file(self, f: IO[bytes]) -> None:
        os.fsync(f.fileno())

    def archive_problem(self, record: Record, deep: bool) -> str | None:
        try:
            with zipfile.ZipFile(self.path(record.name)) as zf:
                if deep and record.zip_crc and (bad := zf.testzip()) is not None:
                    return f"CRC mismatch in {bad}"
        except Exception as err:  # a damaged zip directory raises BadZipFile, UnicodeDecodeError (a
            # file name), NotImplementedError (a version byte), EOFError, ValueError, ...: each is "damaged"
            return f"not a readable checkpoint archive: {type(err).__name__}: {err}"
        return None


def _fsync_path(path: str) -> None:
    """``fsync`` a regular file or a directory; a link, FIFO or device is left alone (never opened through)."""
    mode = os.lstat(path).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
