"""Serialization: ``torch.save`` without the archive's per-record CRC32s (the file's CRC32 replaces them)."""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["can_skip_zip_crc", "cpu_storages", "torch_save"]

_CRC_LOCK = threading.Lock()
_crc_off_count = 0
_crc_previous = True


def can_skip_zip_crc() -> bool:
    """Whether this torch can leave out the archive's per-record CRC32s (``set_crc32_options``)."""
    return hasattr(torch.serialization, "set_crc32_options") and hasattr(torch.serialization, "get_crc32_options")


def torch_save(obj: Any, target: Any, skip_zip_crc: bool = True) -> None:
    """``torch.save`` without the archive's per-record CRC32s (the stream's whole-file CRC32 replaces them).

    torch's switch is process-wide (``torch.serialization.set_crc32_options``): it is off while any of
    these saves runs (saves on several threads share one "off" period) and restored after the last.
    Older torch versions without the switch compute them (slower, same result). With ``skip_zip_crc=False``
    (no whole-file CRC32) this is a plain ``torch.save``, which writes them.
    """
    global _crc_off_count, _crc_previous
    if not skip_zip_crc or not can_skip_zip_crc():
        torch.save(obj, target)
        return
    with _CRC_LOCK:
        if _crc_off_count == 0:
            _crc_previous = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_off_count += 1
    try:
        torch.save(obj, target)
    finally:
        with _CRC_LOCK:
            _crc_off_count -= 1
            if _crc_off_count == 0:
                torch.serialization.set_crc32_options(_crc_previous)


def cpu_storages(obj: Any) -> dict[int, int]:
    """``{address: size}`` of the storages of the CPU tensors in ``obj`` (``torch.save`` writes each in one piece)."""
    out: dict[int, int] = {}

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.device.type == "cpu" and o.layout == torch.strided:
                storage = o.untyped_storage()
                out[storage.data_ptr()] = storage.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    out.pop(0, None)
    return out
