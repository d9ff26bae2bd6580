"""The hook specifications that lplugins plugins implement.

A plugin is a module (or any object) with functions named ``lplugins_<...>``; decorate them with
:data:`lplugins.hookimpl` (or rely on the ``lplugins_`` prefix, as pytest does for ``pytest_``).
Publish it under the ``lplugins`` entry-point group::

    [project.entry-points.lplugins]
    acme = "acme_lplugins.plugin"

Registering hooks receive a ``register`` callable and return ``None``; they are called once, when
the plugin is loaded. Every hook is documented, with an example, in ``docs/hooks.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pluggy

#: The pluggy project name.
PROJECT_NAME = "lplugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: ``register(name, factory, *, description="", defaults=None, **metadata) -> None``
Register = Callable[..., None]


@hookspec
def lplugins_register_strategies(register: Register) -> None:
    """Register named training strategies.

    Call ``register(name, factory, description=..., defaults={...})`` once per strategy; ``factory``
    is a ``Strategy`` subclass or a callable returning a ``Strategy`` instance and is called with
    ``defaults`` (plus any overrides) when the name is selected. Registered names are mirrored into
    Lightning's ``StrategyRegistry``, so ``lightning.pytorch.Trainer(strategy="name")`` works once
    lplugins has loaded its plugins.

    Args:
        register: the registering callable.

    Example::

        @hookimpl
        def lplugins_register_strategies(register):
            from lightning.pytorch.strategies import DDPStrategy

            register("acme_ddp", DDPStrategy, description="DDP, acme defaults",
                     defaults={"process_group_backend": "gloo"})
    """


@hookspec
def lplugins_register_precisions(register: Register) -> None:
    """Register named precision plugins.

    Call ``register(name, factory, description=..., strategies=None, accelerators=None)``;
    ``factory`` returns a ``lightning.pytorch.plugins.precision.Precision`` instance.
    ``strategies`` and ``accelerators`` (tuples of names) say what it supports; ``None`` means any.

    Args:
        register: the registering callable.

    Example::

        @hookimpl
        def lplugins_register_precisions(register):
            from lightning.pytorch.plugins.precision import DoublePrecision

            register("acme-double", DoublePrecision, description="float64 everywhere",
                     accelerators=("cpu",))
    """


@hookspec
def lplugins_register_schedules(register: Register) -> None:
    """Register named gradient-accumulation schedules.

    Call ``register(name, factory, description=...)``; ``factory(**params)`` returns a schedule
    (see ``lplugins.accumulation``), and the name can be given as ``accumulate_grad_batches`` to
    :func:`lplugins.compose`.

    Args:
        register: the registering callable.

    Example::

        @hookimpl
        def lplugins_register_schedules(register):
            from lplugins.accumulation import StepSchedule

            register("acme_warmup", StepSchedule, description="8 then 2",
                     defaults={"schedule": {0: 8, 1000: 2}})
    """


@hookspec
def lplugins_register_callbacks(register: Register) -> None:
    """Register named callbacks.

    Call ``register(name, factory, description=..., defaults={...})``; ``factory`` returns a
    ``lightning.pytorch.Callback``. The name can then be used in ``callbacks=[...]`` of
    :func:`lplugins.compose` and :func:`lplugins.attach`.

    Args:
        register: the registering callable.

    Example::

        @hookimpl
        def lplugins_register_callbacks(register):
            from lightning.pytorch.callbacks import LearningRateMonitor

            register("acme_lr", LearningRateMonitor, description="log the LR every step",
                     defaults={"logging_interval": "step"})
    """


@hookspec
def lplugins_register_cluster_environments(register: Register) -> None:
    """Register named cluster environments (schedulers Lightning does not know).

    Call ``register(name, factory, description=..., detect=callable)``; ``factory`` returns a
    ``lightning.fabric.plugins.environments.ClusterEnvironment``. If ``detect`` is given and returns
    true, the environment is used automatically when a Trainer is composed without one.

    Args:
        register: the registering callable.

    Example::

        @hookimpl
        def lplugins_register_cluster_environments(register):
            from acme.cluster import AcmeEnvironment

            register("acme", AcmeEnvironment, description="Acme scheduler",
                     detect=AcmeEnvironment.detect)
    """


@hookspec
def lplugins_trainer_callbacks(trainer_kwargs: Mapping[str, Any]) -> Sequence[Any] | None:
    """Contribute callbacks to every Trainer that lplugins composes.

    Called by :func:`lplugins.compose` (and, in zero-code mode, for every plain ``Trainer``) with
    the Trainer keyword arguments known at that point (empty in zero-code mode). Return a list of
    ``Callback`` instances, or ``None``. Results of all plugins are concatenated in plugin order.

    Args:
        trainer_kwargs: the Trainer's keyword arguments (read only).

    Example::

        @hookimpl
        def lplugins_trainer_callbacks(trainer_kwargs):
            from acme_lplugins.callbacks import AuditLog

            return [AuditLog()]
    """


@hookspec(firstresult=True)
def lplugins_choose_precision(accelerator: str, capabilities: Mapping[str, Any]) -> str | None:
    """Choose the precision that ``precision="auto"`` resolves to.

    Stops at first non-None result. ``capabilities`` holds facts about the hardware (for CUDA:
    ``"cuda_capability"`` as a ``(major, minor)`` tuple, ``"bf16_supported"``; ``"cpu_bf16"`` when
    the user opted into bf16 on CPU). Return a precision name or ``None`` to let the next plugin
    (finally lplugins' own rule) decide.

    Args:
        accelerator: ``"cpu"``, ``"cuda"``, ``"mps"``, ...
        capabilities: hardware facts.

    Example::

        @hookimpl
        def lplugins_choose_precision(accelerator, capabilities):
            if accelerator == "cuda" and capabilities.get("cuda_capability", (0, 0)) >= (9, 0):
                return "fp8"
            return None
    """
