"""Mid-epoch resume of any checkpoint under lplugins' strategies, where no ``DurableCheckpoint`` does it.

A Trainer whose strategy lplugins provides gets :class:`ResumePosition` (from ``Trainer()``, through
lplugins' ``callbacks_factory`` entry point, or from ``compose``/``attach``). It does nothing unless a fit
resumes a checkpoint mid-epoch: then the epoch continues at its batch, the trained batches skipped as indices,
when the loaders' order is fixed by the epoch (:mod:`lplugins.callbacks._position_stock`), and one line on
rank zero says which it was, or why the rest of the epoch comes from a fresh iterator. With a
``DurableCheckpoint`` in the Trainer, that callback's own data position does this (and more), and this one
stands aside.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._position import DataPosition

__all__ = ["ResumePosition", "provided_by_lplugins"]


def provided_by_lplugins(strategy: Any) -> bool:
    """Whether ``strategy`` is one of lplugins' (either Lightning namespace)."""
    return type(strategy).__module__.startswith("lplugins.")


class ResumePosition(Callback):
    """Continues a resumed epoch at its batch (see the module docstring); no state of its own."""

    def __init__(self) -> None:
        self._position = DataPosition()
        self._active = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._active = not any(isinstance(cb, DurableCheckpoint) for cb in trainer.callbacks)
        if self._active:
            self._position.attach(trainer)  # before the fit loop builds its loaders and their first iterators

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._active:
            self._position.on_train_start(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._position.detach()  # the user's DataLoaders and the strategy as they were
        self._active = False

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning calls no teardown after an exception
