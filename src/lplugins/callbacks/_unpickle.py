"""``fast_weights_only_load``: ``torch.load(weights_only=True)``'s allow-list at the speed of C ``pickle``.

torch's weights-only unpickler is written in Python and costs ~65 us per tensor: on a checkpoint of many
small tensors (a 120 MB file of 304) it, not the read, sets the load's pace. The standard library's C
``pickle.Unpickler`` with ``find_class`` restricted to an allow-list (the Python documentation's
"Restricting Globals") runs no code a file names outside it: every callable and class a pickle can use
comes from ``find_class``. Here the list is a subset of torch's own (plain tensors and parameters, their
storages, ``OrderedDict``, ``torch.Size``, dtypes, devices, the builtins torch allows); a file that names
anything else (a tensor subclass, a type the user allowed with ``torch.serialization.add_safe_globals``, a
payload), and any file the fast path fails on, is loaded again by torch's own weights-only unpickler, which
decides. So the fast path accepts only what torch accepts, and never refuses what torch loads.
"""

from __future__ import annotations

import _compat_pickle
import pickle
from functools import cache
from typing import Any

__all__ = ["Refused", "fast_weights_only_load"]


class Refused(pickle.UnpicklingError):
    """A global outside the fast path's allow-list (torch's own unpickler decides)."""


@cache
def _allowed() -> dict[tuple[str, str], Any]:
    import codecs
    import collections

    import torch
    import torch._utils as rebuild

    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("_codecs", "encode"): codecs.encode,  # bytes, as protocol 2 writes them
        ("builtins", "set"): set,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): bytearray,
    }
    for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter"):
        allowed[("torch._utils", name)] = getattr(rebuild, name)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names (torch.save writes protocol 2), mapped as torch's weights-only unpickler maps them
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        found = _allowed().get((module, name))
        if found is None:
            raise Refused(f"{module}.{name}")
        return found


class _Module:
    """What ``torch.load(pickle_module=...)`` uses of a pickle module."""

    __name__ = "lplugins-weights-only"
    Unpickler = _Unpickler
    load = staticmethod(pickle.load)
    UnpicklingError = pickle.UnpicklingError


def fast_weights_only_load(path: str, map_location: Any, mmap: bool) -> dict[str, Any]:
    """``torch.load(path, map_location=..., mmap=..., weights_only=True)``, the same result, faster.

    Raises:
        pickle.UnpicklingError: torch's weights-only unpickler refuses the file (as ``torch.load`` raises it).
    """
    import torch

    try:
        loaded: dict[str, Any] = torch.load(
            path, map_location=map_location, mmap=mmap, weights_only=False, pickle_module=_Module
        )
        return loaded
    except Exception:  # a global outside the list, a damaged file, TORCH_FORCE_WEIGHTS_ONLY_LOAD: torch decides
        fallback: dict[str, Any] = torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
        return fallback
