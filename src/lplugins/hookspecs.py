"""The contract between lplugins and its plugins: every hook, the ``register`` callables, the kinds.

A plugin is a module (or any object) with functions named ``lplugins_<...>``; decorate them with
:data:`lplugins.hookimpl` (or rely on the ``lplugins_`` prefix, as pytest does for ``pytest_``).
Publish it under the ``lplugins`` entry-point group::

    [project.entry-points.lplugins]
    acme = "acme_lplugins.plugin"

Everything a plugin author relies on is in this module:

* the hook specifications (``lplugins_register_*`` and the others below), each with an example;
* :class:`Register` and its per-kind variants, the typed ``register`` callable that registering
  hooks receive;
* :data:`KINDS`, the table of component kinds: which hook registers each kind, the extra keywords
  its ``register`` accepts, and the arguments :func:`lplugins.compose` injects into its factories.
  The plugin manager and the registries are built from this table: adding a kind means adding a
  row here and its hook specification below (and a section in ``docs/hooks.md``).

Registering hooks receive a ``register`` callable and return ``None``; they are called once, when
the plugin is loaded. Every hook is documented, with an example, in ``docs/hooks.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pluggy

#: The pluggy project name.
PROJECT_NAME = "lplugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a plugin's function as a hook implementation: ``@lplugins.hookimpl`` (optional for ``lplugins_*`` names)."""


# ---------------------------------------------------------------------------- register callables
class Register(Protocol):
    """The ``register`` callable a registering hook receives (strategies, schedules, callbacks).

    Call it once per name. Nothing is registered until the whole plugin has loaded: if any of its
    hooks raises, none of its names remain. Its arguments are those of ``__call__`` below.
    """

    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        description: str = "",
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        """Register ``factory`` under ``name``.

        Args:
            name: The name users pass (letters, digits, ``_``, ``.``, ``-``), unique within its kind.
            factory: A class or callable building the component: ``factory(**defaults, **overrides)``.
                A factory that declares one of the kind's injected arguments (see :data:`KINDS`)
                receives it from :func:`lplugins.compose`.
            description: One line, shown by ``lplugins list``.
            defaults: Keyword arguments passed to ``factory`` unless the user overrides them.

        Raises:
            RegistrationError: an invalid name, a factory that is not callable, ``defaults`` that are
                not a mapping, a keyword the kind does not accept, or a name given twice by one plugin.
                (The plugin then fails to load with a :class:`~lplugins.PluginError` naming it.)
        """


class RegisterPrecision(Register, Protocol):
    """:class:`Register` for precision plugins, with what the precision supports."""

    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        description: str = "",
        defaults: Mapping[str, Any] | None = None,
        strategies: Sequence[str] | None = None,
        accelerators: Sequence[str] | None = None,
    ) -> None:
        """Register a precision plugin; ``name``, ``factory``, ``description`` and ``defaults`` as for
        :meth:`Register.__call__`.

        Args:
            strategies: Strategy names it works with; ``None`` (the default) means any.
            accelerators: Accelerator names it works with (``"cpu"``, ``"cuda"``...); ``None`` means any.
        """


class RegisterClusterEnvironment(Register, Protocol):
    """:class:`Register` for cluster environments, with automatic detection."""

    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        description: str = "",
        defaults: Mapping[str, Any] | None = None,
        detect: Callable[[], object] | None = None,
    ) -> None:
        """Register a cluster environment; ``name``, ``factory``, ``description`` and ``defaults`` as
        for :meth:`Register.__call__`.

        Args:
            detect: A callable without arguments returning true when the process runs under that
                scheduler; :func:`lplugins.compose` then adds the environment when the user gave none.
        """


# ---------------------------------------------------------------------------- the kinds
@dataclass(frozen=True)
class Kind:
    """One kind of named component: how plugins register it and how lplugins builds it.

    Attributes:
        name: The kind, as in ``manager.registry("precision")`` and ``lplugins list``.
        hook: The registering hook that plugins implement for it.
        register: The type of the ``register`` callable that hook receives.
        keywords: The extra keywords ``register`` accepts for this kind (beyond ``description``
            and ``defaults``); they end up in :attr:`lplugins.Component.metadata`.
        injected: Arguments :func:`lplugins.compose` passes to a factory that declares a parameter
            of that name (``trainer_kwargs``: a read-only view of the Trainer's keyword arguments;
            ``accelerator``: the resolved accelerator name; ``strategy``: the strategy's name).
    """

    name: str
    hook: str
    register: type = Register
    keywords: frozenset[str] = frozenset()
    injected: tuple[str, ...] = ()


#: Every kind of component, in the order the manager calls the registering hooks. The registries
#: (:mod:`lplugins._plugins.registry`) and the manager (:mod:`lplugins._plugins.manager`) derive from this table.
KINDS: tuple[Kind, ...] = (
    Kind("strategy", "lplugins_register_strategies", injected=("trainer_kwargs",)),
    Kind(
        "precision",
        "lplugins_register_precisions",
        RegisterPrecision,
        keywords=frozenset({"strategies", "accelerators"}),
        injected=("accelerator", "strategy"),
    ),
    Kind("schedule", "lplugins_register_schedules"),
    Kind("callback", "lplugins_register_callbacks"),
    Kind(
        "cluster_environment",
        "lplugins_register_cluster_environments",
        RegisterClusterEnvironment,
        keywords=frozenset({"detect"}),
    ),
)


# ---------------------------------------------------------------------------- registering hooks
@hookspec
def lplugins_register_strategies(register: Register) -> None:
    """Register named training strategies.

    Call ``register(name, factory, description=..., defaults={...})`` once per strategy; ``factory``
    is a ``Strategy`` subclass or a callable returning a ``Strategy`` instance and is called with
    ``defaults`` (plus any overrides) when the name is selected. Registered names are mirrored into
    Lightning's ``StrategyRegistry``, so ``lightning.pytorch.Trainer(strategy="name")`` works once
    lplugins has loaded its plugins.

    Injected argument: a factory with a parameter named ``trainer_kwargs`` receives a read-only
    view of the Trainer's keyword arguments when :func:`lplugins.compose` resolves the name.

    Args:
        register: a :class:`Register`; call it once per strategy.

    Example::

        @hookimpl
        def lplugins_register_strategies(register):
            from lightning.pytorch.strategies import DDPStrategy

            register("acme_ddp", DDPStrategy, description="DDP, acme defaults",
                     defaults={"process_group_backend": "gloo"})
    """


@hookspec
def lplugins_register_precisions(register: RegisterPrecision) -> None:
    """Register named precision plugins.

    Call ``register(name, factory, description=..., strategies=None, accelerators=None)``;
    ``factory`` returns a ``lightning.pytorch.plugins.precision.Precision`` instance.
    ``strategies`` and ``accelerators`` (tuples of names) say what it supports; ``None`` means any.

    Injected arguments: a factory with a parameter named ``accelerator`` receives the resolved
    accelerator name (``"cpu"``, ``"cuda"``...), one named ``strategy`` the strategy's name, when
    the name is given as ``precision=`` to :func:`lplugins.compose`.

    Args:
        register: a :class:`RegisterPrecision`; call it once per precision.

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
        register: a :class:`Register`; call it once per schedule.

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
        register: a :class:`Register`; call it once per callback.

    Example::

        @hookimpl
        def lplugins_register_callbacks(register):
            from lightning.pytorch.callbacks import LearningRateMonitor

            register("acme_lr", LearningRateMonitor, description="log the LR every step",
                     defaults={"logging_interval": "step"})
    """


@hookspec
def lplugins_register_cluster_environments(register: RegisterClusterEnvironment) -> None:
    """Register named cluster environments (schedulers Lightning does not know).

    Call ``register(name, factory, description=..., detect=callable)``; ``factory`` returns a
    ``lightning.fabric.plugins.environments.ClusterEnvironment``. If ``detect`` is given and returns
    true, the environment is used automatically when a Trainer is composed without one.

    Args:
        register: a :class:`RegisterClusterEnvironment`; call it once per environment.

    Example::

        @hookimpl
        def lplugins_register_cluster_environments(register):
            from acme.cluster import AcmeEnvironment

            register("acme", AcmeEnvironment, description="Acme scheduler",
                     detect=AcmeEnvironment.detect)
    """


# ---------------------------------------------------------------------------- other hooks
@hookspec
def lplugins_trainer_callbacks(trainer_kwargs: Mapping[str, Any]) -> Sequence[Any] | None:
    """Contribute callbacks to every Trainer that lplugins composes.

    Called by :func:`lplugins.compose` (and, in zero-code mode, for every plain ``Trainer``) with
    the Trainer keyword arguments known at that point (empty in zero-code mode). Return a list of
    ``Callback`` instances, or ``None``. Results of all plugins are concatenated in plugin order;
    a plugin that raises is named in a ``PluginError`` (or skipped with a ``PluginWarning`` in
    lenient mode) and the others still contribute.

    Args:
        trainer_kwargs: the Trainer's keyword arguments (read only); ``precision`` is the resolved
            name when ``compose()`` resolved ``"auto"``.

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
    ``"cuda_capability"`` as a ``(major, minor)`` tuple, ``"bf16_supported"``, ``"device_name"``;
    ``"cpu_bf16"`` when the user opted into bf16 on CPU). Return a precision name or ``None`` to
    let the next plugin (finally lplugins' own rule) decide. Plugins loaded later are asked first.

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
