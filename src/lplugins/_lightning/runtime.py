"""Lightning objects found at run time without importing a namespace: on a stack, in ``sys.modules``.

The collective watchdog reads a waiting rank's stack (:func:`logged_metric`: a ``self.log(...,
sync_dist=True)`` synced after its hook returned is a ``_ResultMetric`` whose ``meta`` names the
metric and the hook), and the rank-zero guard patches the collectives of the Lightning classes that
are imported (:func:`loaded_classes`: where ``Trainer``, ``LightningModule`` and ``Strategy`` live).
Both are duck-typed: one module serves both namespaces, and neither imports one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from lplugins._lightning.registry import _private

__all__ = ["collective_sequence", "default_store", "logged_metric", "loaded_classes"]

_RESULT = "lightning.pytorch.trainer.connectors.logger_connector.result"
_private(f"{_RESULT}._ResultMetric", "meta", "init", "the watchdog names the self.log call a rank waits in")
_private(f"{_RESULT}._Metadata", "name", "field", "the metric's name, from a _ResultMetric on the stack")
_private(f"{_RESULT}._Metadata", "fx", "field", "the hook that logged it")
_private(f"{_RESULT}._Metadata", "sync", "class", "set when the value is synced across ranks (sync_dist)")
_C10D = "torch.distributed.distributed_c10d"
_private(_C10D, "_get_default_store", "class", "the failure board's keys live in the job's store")
_private("torch.distributed.ProcessGroup", "_get_sequence_number_for_group", "class", "which collective a rank is in")


def default_store() -> Any:
    """The store of the default process group (the one the job's ranks met through)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def collective_sequence() -> int:
    """How many collectives this rank has started on the default group (its sequence number)."""
    import torch.distributed as dist

    return int(dist.group.WORLD._get_sequence_number_for_group())  # type: ignore[union-attr]


def logged_metric(frames: list[FrameType], is_library: Callable[[str], bool]) -> tuple[str, str] | None:
    """``self.log(name, ..., sync_dist=True)`` synced after the hook returned: the call and, if found, its line.

    Args:
        frames: A stack, innermost first.
        is_library: Whether a file is library code (not the user's).
    """
    for f in frames:
        meta = getattr(f.f_locals.get("self"), "meta", None)
        name, fx = getattr(meta, "name", None), getattr(meta, "fx", None)
        if isinstance(name, str) and isinstance(fx, str) and getattr(meta, "sync", None) is not None:
            call = f"the sync_dist of self.log({name!r}, ...) in {fx}"
            return call, _find_log_line(frames, name, fx)
    return None


def _find_log_line(frames: list[FrameType], name: str, fx: str) -> str:
    import inspect

    for f in frames:
        trainer = getattr(f.f_locals.get("self"), "trainer", None)
        module = getattr(trainer, "lightning_module", None)
        hook = getattr(type(module), fx, None) if module is not None else None
        if hook is None:
            continue
        try:
            lines, first = inspect.getsourcelines(hook)
            file = inspect.getsourcefile(hook) or "?"
        except (OSError, TypeError):
            return ""
        for offset, line in enumerate(lines):
            if "log" in line and (f'"{name}"' in line or f"'{name}'" in line):
                return f"{file}:{first + offset}"
        return f"{file}:{first}"
    return ""


#: Where each class lives, per package (Lightning's module layout, not its public import paths).
_HOMES = {
    "Trainer": ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"),
    "LightningModule": ("lightning.pytorch.core.module", "pytorch_lightning.core.module"),
    "Strategy": (
        "lightning.pytorch.strategies.strategy",
        "lightning.fabric.strategies.strategy",
        "pytorch_lightning.strategies.strategy",
        "lightning_fabric.strategies.strategy",
    ),
}
_WHY = "the rank-zero guard wraps its collectives once it is imported"
_private("lightning.pytorch.trainer.trainer", "Trainer", "class", _WHY)
_private("lightning.pytorch.core.module", "LightningModule", "class", _WHY)
_private("lightning.pytorch.strategies.strategy", "Strategy", "class", _WHY)
_private("lightning.fabric.strategies.strategy", "Strategy", "class", _WHY)


def loaded_classes(name: str) -> list[Any]:
    """Every imported ``Trainer``, ``LightningModule`` or ``Strategy`` class (``name``), of either namespace.

    Nothing is imported: a namespace not imported yet has none.
    """
    found = []
    for module_name in _HOMES[name]:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, name):
            found.append(getattr(module, name))
    return found
