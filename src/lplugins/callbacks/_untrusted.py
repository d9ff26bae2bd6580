"""Names in a checkpoint directory are untrusted input: opened beneath the directory, never through a link.

A checkpoint directory is written by this run, but read by the next one, after anything may have
happened to it: a user's ``ln -s``, a copy tool that kept links, a hostile file. Every entry is therefore
reached from the directory one component at a time (``openat`` with ``O_NOFOLLOW``): a name that is
absolute, holds ``..``, or passes through a symbolic link is refused, and so is an entry that is not a
regular file or directory (a FIFO would block ``open`` for ever; a device has no end). Refusals are
:class:`UntrustedEntryError`, an ``OSError``, so every caller's "unreadable" path handles them: the
checkpoint is skipped as damaged and the next newest is tried.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

__all__ = ["UntrustedEntryError", "check_name", "lstat_beneath", "open_beneath", "what"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UntrustedEntryError(OSError):
    """An entry of a checkpoint directory that is not opened: a link, a FIFO, a device, or a name outside it."""


def what(mode: int) -> str:
    """What a file of ``mode`` is, in words (``"a regular file"``, ``"a symbolic link"``, ``"a FIFO"``...)."""
    for test, text in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return text
    return "not a regular file"


def check_name(name: str) -> list[str]:
    """The components of ``name``, a relative path inside the directory.

    Raises:
        UntrustedEntryError: ``name`` is empty, absolute, or has an empty, ``.`` or ``..`` component or a NUL.
    """
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith("/") or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise UntrustedEntryError(errno.EINVAL, f"not a name inside the checkpoint directory: {name!r}")
    return parts


@contextlib.contextmanager
def _parent_fd(root: str, parts: list[str]) -> Iterator[int]:
    """A descriptor of the folder holding ``parts[-1]``, reached from ``root`` without following a link."""
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                inner = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
                    raise UntrustedEntryError(err.errno, f"{'/'.join(parts)}: {part} is {what(mode)}") from None
                raise
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def lstat_beneath(root: str, name: str) -> os.stat_result:
    """``name``'s own status (a link is not followed), reached from ``root`` without following a link."""
    parts = check_name(name)
    with _parent_fd(root, parts) as fd:
        return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)


def open_beneath(root: str, name: str) -> int:
    """A read-only descriptor of the regular file ``name`` beneath ``root`` (the caller closes it).

    Raises:
        UntrustedEntryError: ``name`` is not a plain relative name, passes through a link, or is not a
            regular file (it is opened non-blocking, so a FIFO is refused at once rather than waited on).
        OSError: it does not exist or cannot be read.
    """
    parts = check_name(name)
    with _parent_fd(root, parts) as parent:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=parent)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise UntrustedEntryError(err.errno, f"{name} is a symbolic link") from None
            raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UntrustedEntryError(errno.EINVAL, f"{name} is {what(mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
