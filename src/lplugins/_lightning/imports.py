"""Running code right after a module is first imported (:func:`on_import`), without importing it.

lplugins' one import hook: a finder that wraps the loader of a watched module only, so the strategy
mirror (``_mirror``) and ``LPLUGINS_AUTO_NAMES`` (``_autoload``) can act the moment a Lightning
namespace is imported, never importing one a process does not use. Any other import costs a dict
lookup. Nothing is rewritten: the watched module runs as its own loader would run it.

Imports nothing from lplugins.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["on_import"]

_WATCHED: dict[str, list[Callable[[ModuleType], None]]] = {}


class _WatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for callback in _WATCHED.pop(module.__name__, []):
            callback(module)


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a watched module is imported (and costs a dict lookup per import)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _ImportWatcher):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None and spec.loader is not None:
                spec.loader = _WatchingLoader(spec.loader)
                return spec
        return None


def on_import(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` when ``module_name`` is imported (at once when it already is)."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    callbacks = _WATCHED.setdefault(module_name, [])
    if callback not in callbacks:
        callbacks.append(callback)
    if not any(isinstance(f, _ImportWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportWatcher())
