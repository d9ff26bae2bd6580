"""``FsspecStorage``: a checkpoint directory behind an fsspec URL (``s3://``, ``memory://``, ...), without ``fsync``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import IO, Any

from lplugins.callbacks._storage import Storage
from lplugins.callbacks._stream import StreamWriter

__all__ = ["FsspecStorage"]


class FsspecStorage(Storage):
    """A remote checkpoint directory: the same order of operations as local, durability as the store gives it.

    Args:
        dirpath: The fsspec URL of the checkpoint directory.
    """

    def __init__(self, dirpath: str) -> None:
        super().__init__(dirpath)
        import fsspec

        self._fs: Any = fsspec.core.url_to_fs(self.dirpath)[0]

    def path(self, name: str) -> str:
        return self.dirpath.rstrip("/") + "/" + name

    def makedirs(self) -> None:
        self._fs.makedirs(self.dirpath, exist_ok=True)

    def listdir(self) -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self._fs.ls(self.dirpath, detail=False)]
        except FileNotFoundError:
            return []

    def exists(self, name: str) -> bool:
        return bool(self._fs.exists(self.path(name)))

    def isdir(self, name: str) -> bool:
        return bool(self._fs.isdir(self.path(name)))

    def size(self, name: str) -> int:
        return int(self._fs.size(self.path(name)))

    def tree_sizes(self, name: str) -> dict[str, int]:
        top = self.path(name)
        found = self._fs.find(top, detail=True)
        return {p[len(top) :].lstrip("/"): int(info.get("size", 0)) for p, info in found.items()}

    def open_read(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return self._fs.open(self.path(name), "rb")

    def open_write(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return self._fs.open(self.path(name), "wb")

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        data = bytes(self._fs.cat_file(self.path(name), end=None if limit is None else limit + 1))
        if limit is not None and len(data) > limit:
            raise ValueError(f"{name} holds more than {limit} bytes: not a file lplugins wrote")
        return data

    def mkdir(self, name: str) -> None:
        self._fs.makedirs(self.path(name), exist_ok=True)

    def _listdir_path(self, name: str) -> list[str]:
        if not self._fs.isdir(self.path(name)):
            raise FileNotFoundError(self.path(name))
        return [str(p) for p in self._fs.ls(self.path(name), detail=False)]

    def rename(self, src: str, dst: str, sync_dir: bool = True) -> None:
        self._fs.mv(self.path(src), self.path(dst), recursive=True)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(self.path(name), recursive=True)

    # no fsync on a remote store: durability is whatever it gives a finished upload
    def fsync_dir(self) -> None:
        return

    def fsync_tree(self, name: str) -> None:
        return

    def sync_file(self, f: IO[bytes]) -> None:
        return

    def _write_tmp(self, tmp: str, write: Callable[[Any], None]) -> None:
        with self.open_write(tmp) as f:
            write(f)

    def _stream_tmp(
        self, tmp: str, write: Callable[[StreamWriter], None], checksum: bool, stable: dict[int, int] | None
    ) -> int | None:
        with self.open_write(tmp) as f, StreamWriter(f, checksum=checksum, stable=stable) as stream:
            write(stream)
            return stream.finish()
