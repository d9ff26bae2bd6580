"""Zero-code mode: Lightning's ``lightning.pytorch.callbacks_factory`` entry point.

Its twin ``lplugins._pl._composition.factory`` is the ``pytorch_lightning.callbacks_factory`` entry point
(see :mod:`lplugins._lightning.namespace`): the same mode for a ``pytorch_lightning.Trainer``.

lplugins declares this entry point so that, when ``LPLUGINS_AUTO_CALLBACKS=1``, every plain
``lightning.pytorch.Trainer`` receives the callbacks that plugins contribute through
``lplugins_trainer_callbacks`` -- with lplugins' blocking (``LPLUGINS_DISABLE``...) and error
reporting (a failing plugin is named; in lenient mode it is skipped with a warning) instead of
Lightning's (one raising factory aborts ``Trainer()`` with a bare traceback). Without the variable,
the factory returns nothing and costs nothing.

In every ``Trainer()`` for more than one process it also gives the Trainer the collective watchdog
(:mod:`lplugins._coord.watchdog`; ``LPLUGINS_COLLECTIVE_TIMEOUT=off`` turns it off), whatever the variable:
its settings are checked in ``Trainer()``, its thread runs only while a run does
(:mod:`lplugins._composition.watch`). Nothing else happens to a Trainer of a process that did not ask for
lplugins (no ``lplugins.load()``, ``compose``, ``attach`` or zero-code mode): no thread, no patch, no output. A Trainer
whose strategy is one of lplugins' also gets :class:`~lplugins.callbacks._resume_position.ResumePosition`
(any checkpoint resumed mid-epoch continues at its batch, or one line says why it cannot).

Strategy names cannot be added from here (Lightning checks them before this entry point runs):
call :func:`lplugins.load` before building the Trainer for those.
"""

from __future__ import annotations

from typing import Any

from lplugins import _lightning
from lplugins._env import AUTO_CALLBACKS, env_flag
from lplugins._lightning import namespace as _namespace
from lplugins._plugins.manager import get_manager, loaded_manager

#: Set to 1 to enable zero-code mode.
ENV_VAR = AUTO_CALLBACKS


def callbacks_factory() -> list[Any]:
    """Return the callbacks that plugins contribute, or ``[]`` unless zero-code mode is on.

    In a process that loaded lplugins (or in zero-code mode) it also teaches the Trainer lplugins' reading
    of ``fit(ckpt_path=...)``: ``"latest"`` without a ``DurableCheckpoint`` is a clear error naming the
    fix instead of Lightning's ``FileNotFoundError`` (see :func:`lplugins.callbacks.latest_checkpoint`).
    """
    with _namespace.using(_namespace.of_module(__name__)):
        trainer = _lightning.trainer_being_built()
        asked = env_flag(ENV_VAR) or loaded_manager() is not None
        if trainer is not None:
            from lplugins._composition.compose import _arm_watchdog, _give_resume_position, _understand_ckpt_path

            if asked:
                _understand_ckpt_path(trainer)
            _arm_watchdog(trainer)
            _give_resume_position(trainer)
        if not env_flag(ENV_VAR):
            return []
        return get_manager().trainer_callbacks({})
