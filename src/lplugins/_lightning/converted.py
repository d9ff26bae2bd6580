"""Conversions of a checkpoint, made once and kept next to it: ``<checkpoint>.converted/<kind>``.

A checkpoint resumed in another layout (another world size under DeepSpeed, another strategy family) is
converted once; the result is kept in the directory ``<checkpoint>.converted`` beside it and reused by every
later resume of the same checkpoint. Each conversion is committed like a checkpoint: built under a temporary
name (``.tmp.<kind>.<random>``), every file ``fsync``-ed, renamed into place, then its manifest
(``<kind>.json``: the source's fingerprint, each file's size and CRC32) written last, durably. A conversion
without a manifest, of another source (the fingerprint differs), or whose bytes do not match the manifest is
not used: it is removed and made again. ``DurableCheckpoint``'s retention removes ``<checkpoint>.converted``
with its checkpoint, and its start-of-fit clean-up removes one whose checkpoint is gone.

A resume that made what it needed in memory commits it for the next one off its critical path
(:func:`commit_in_background`: a thread at a lower CPU priority, after the load).

May import: the standard library only (the build functions bring their own imports).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import sys
import threading
import uuid
import zlib
from collections.abc import Callable

__all__ = [
    "CONVERTED_SUFFIX",
    "FULL_CHECKPOINT",
    "cached_conversion",
    "commit_in_background",
    "committed",
    "converted_dir",
    "fingerprint",
]

log = logging.getLogger("lplugins")

#: The suffix of the directory that holds a checkpoint's conversions (``<checkpoint name><suffix>``).
CONVERTED_SUFFIX = ".converted"
#: The conversion every layout has: one full checkpoint file (``<checkpoint>.converted/full.ckpt``).
FULL_CHECKPOINT = "full.ckpt"
_CHUNK = 1 << 22


def converted_dir(source: str) -> str:
    """Where the conversions of the checkpoint ``source`` (a file or a directory) are kept."""
    return os.fspath(source).rstrip("/\\") + CONVERTED_SUFFIX


def _files(top: str) -> dict[str, int]:
    """Every file under ``top`` (or ``top`` itself when a file): relative path -> size."""
    if os.path.isfile(top):
        return {"": os.path.getsize(top)}
    found: dict[str, int] = {}
    for root, _dirs, names in os.walk(top):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, top)] = os.path.getsize(path)
    return found


#: A committed checkpoint's commit marker: ``<checkpoint><suffix>`` beside it (``callbacks._record.COMMIT_SUFFIX``).
MARKER_SUFFIX = ".commit"
_MARKER_LIMIT = 16 * 2**20


def _marker_bytes(source: str) -> bytes:
    """The commit marker of ``source`` (its CRC32s), or ``b""``: never through a link, FIFO or device."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(source.rstrip("/\\") + MARKER_SUFFIX, flags)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(_MARKER_LIMIT)
    finally:
        os.close(fd)


def fingerprint(source: str) -> str:
    """The identity of a checkpoint's bytes: its commit marker (which holds their CRC32s, checked at every resume
    before a conversion is used), and each file's path, size and modification time."""
    entries = [f"marker:{zlib.crc32(_marker_bytes(source)):08x}"]
    for rel, size in sorted(_files(source).items()):
        stat_ = os.stat(os.path.join(source, rel) if rel else source)
        entries.append(f"{rel}:{size}:{stat_.st_mtime_ns}")
    return f"{zlib.crc32(chr(10).join(entries).encode()):08x}-{len(entries)}"


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _strange(path: str) -> bool:
    """Whether ``path`` exists and is neither a regular file nor a directory (a link, a FIFO, a device...)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _links(top: str) -> list[str]:
    """The links, FIFOs and devices at or under ``top``: a conversion holds none, and none is ever opened."""
    if _strange(top):
        return [top]
    found = []
    for root, dirs, names in os.walk(top):
        found += [os.path.join(root, n) for n in (*dirs, *names) if _strange(os.path.join(root, n))]
    return found


def _remove(path: str) -> None:
    """Remove ``path``: a link itself (never what it points to), a directory with its files, or a file."""
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _problem(target: str, manifest: str, source_print: str) -> str | None:
    """Why the conversion at ``target`` cannot be used, or ``None``: every byte checked against its manifest."""
    if links := _links(manifest) + _links(target):
        return f"it holds a link, FIFO or device ({os.path.basename(links[0])}), which is never opened"
    try:
        with open(manifest) as f:
            committed = json.load(f)
    except (OSError, ValueError) as err:
        return f"no readable manifest ({err})"
    if committed.get("source") != source_print:
        return "made from other bytes than the checkpoint has now"
    files = committed.get("files")
    if not isinstance(files, dict) or not os.path.exists(target):
        return "its files are missing"
    if set(_files(target)) != set(files):
        return "its files are not those of its manifest"
    for rel, (size, crc) in files.items():
        path = os.path.join(target, rel) if rel else target
        if os.path.getsize(path) != size or _crc32(path) != crc:
            return f"{rel or os.path.basename(target)} does not match its manifest"
    return None


def cached_conversion(source: str, kind: str, build: Callable[[str], object]) -> tuple[str, str]:
    """The conversion ``kind`` of ``source``: reused when committed and intact, else made by ``build`` and committed.

    Call on one process at a time for a given ``source`` (the global rank zero); the others wait for it.

    Args:
        source: The checkpoint (file or directory).
        kind: The conversion's name (``"universal"``, ``"full.ckpt"``): a directory or a file.
        build: Writes the conversion at the path it is given (which does not exist yet).

    Returns:
        ``(path, how)``: where the conversion is, and ``"reused"`` or ``"made"`` (with why it was not reused
        when one was there).

    Raises:
        Exception: whatever ``build`` raises (nothing is left behind).
    """
    root = converted_dir(source)
    target, manifest = os.path.join(root, kind), os.path.join(root, f"{kind}.json")
    source_print = fingerprint(source)
    problem = None
    if os.path.islink(root) or (os.path.lexists(root) and not os.path.isdir(root)):
        problem = "its folder is a symbolic link or a file, which is never followed"
        _remove(root)  # the link itself, inside the checkpoint directory: never what it points to
    elif os.path.lexists(manifest):
        problem = _problem(target, manifest, source_print)
        if problem is None:
            return target, "reused"
    for stale in (manifest, target):  # the manifest first: a conversion without one is never used
        _remove(stale)
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # a build cut short (the process ended): never used, removed now
        if name.startswith((f".tmp.{kind}.", f".tmp.{kind}.json.")):
            _remove(os.path.join(root, name))
    tmp = os.path.join(root, f".tmp.{kind}.{uuid.uuid4().hex[:12]}")
    try:
        build(tmp)
        files = {}
        for rel, size in _files(tmp).items():
            path = os.path.join(tmp, rel) if rel else tmp
            _fsync(path)
            files[rel] = [size, _crc32(path)]
        os.rename(tmp, target)
        _fsync(root)
        data = json.dumps({"source": source_print, "kind": kind, "files": files}, sort_keys=True)
        tmp_manifest = os.path.join(root, f".tmp.{kind}.json.{uuid.uuid4().hex[:12]}")
        with open(tmp_manifest, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp_manifest, manifest)
        _fsync(root)
    except BaseException:
        for leftover in (tmp, target):
            _remove(leftover)
        raise
    return target, "made" + (f" (the one there was not used: {problem})" if problem else "")


def committed(source: str, kind: str) -> bool:
    """Whether a conversion ``kind`` of ``source``'s present bytes is committed (its manifest names them; the bytes
    of the conversion itself are checked when it is used)."""
    root = converted_dir(source)
    if _links(root):
        return False
    try:
        with open(os.path.join(root, f"{kind}.json")) as f:
            return bool(json.load(f).get("source") == fingerprint(source))
    except (OSError, ValueError):
        return False


_BUILDING: set[tuple[str, str]] = set()
_BUILDING_LOCK = threading.Lock()


def _lower_priority(nice: int = 10) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not allowed here: the thread runs at the caller's priority
        pass


def commit_in_background(source: str, kind: str, build: Callable[[str], object]) -> threading.Thread | None:
    """Commit the conversion ``kind`` of ``source`` (made by ``build``, as :func:`cached_conversion`) on a thread
    of lower CPU priority, unless it is committed already or being made; returns the thread (``None``: nothing to do).

    The caller goes on at once. The thread is not a daemon, so a process that ends waits for it; one killed
    meanwhile leaves a temporary name, never used and removed by the next build. A failure (the checkpoint removed
    by retention meanwhile, a full disk) is logged, not raised: the conversion is made again when next needed.
    """
    key = (os.path.abspath(source), kind)
    with _BUILDING_LOCK:
        if key in _BUILDING or committed(source, kind):
            return None
        _BUILDING.add(key)

    def run() -> None:
        _lower_priority()
        try:
            target, how = cached_conversion(source, kind, build)
            if not os.path.exists(source):  # removed (retention) while it was written: no orphan left
                _remove(converted_dir(source))
            else:
                log.debug("lplugins: %s: conversion %s %s (in the background): %s", source, kind, how, target)
        except Exception as err:  # the conversion is an optimisation: made again when next needed
            log.warning(
                "lplugins: %s: keeping its %s conversion failed (%s: %s)", source, kind, type(err).__name__, err
            )
        finally:
            with _BUILDING_LOCK:
                _BUILDING.discard(key)

    thread = threading.Thread(target=run, name=f"lplugins-convert-{kind}", daemon=False)
    thread.start()
    return thread
