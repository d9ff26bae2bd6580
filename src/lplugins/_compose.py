"""Turning lplugins names into objects for a stock ``lightning.pytorch.Trainer``."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lplugins import _lightning, _namespace, _pairs
from lplugins._errors import CompositionError
from lplugins._log import announce
from lplugins._manager import PluginManager, get_manager
from lplugins._registry import Component
from lplugins._validate import did_you_mean, is_int
from lplugins.precision._auto import LIGHTNING_PRECISIONS, choose_precision, probe_capabilities, resolve_accelerator

if TYPE_CHECKING:
    from lightning.pytorch import Callback, Trainer

#: The Lightning namespace this module is written for (its twin ``lplugins._pl._compose`` serves the other).
_OWN_NAMESPACE = _namespace.of_module(__name__)


def compose(
    *, manager: PluginManager | None = None, cpu_bf16: bool = False, namespace: str | None = None, **trainer_kwargs: Any
) -> dict[str, Any]:
    """Turn Trainer keyword arguments that use lplugins names into ones the stock Trainer accepts.

    ``strategy``, ``precision``, ``accumulate_grad_batches``, ``callbacks`` and ``plugins`` may use
    names registered by plugins (built-ins included); everything else is passed through unchanged.
    Every name and argument is checked here, before any training starts. Callbacks contributed by
    plugins through ``lplugins_trainer_callbacks`` are added.

    Args:
        manager: The plugin manager (default: the process-wide one, loaded on first use).
        cpu_bf16: Let ``precision="auto"`` pick bf16 on CPU.
        namespace: ``"lightning"`` (for ``lightning.pytorch.Trainer``) or ``"pytorch_lightning"``
            (for ``pytorch_lightning.Trainer``); default: the namespace of the Lightning objects
            passed, else the one already imported (``"lightning"`` when both or neither are).
        **trainer_kwargs: Keyword arguments for ``lightning.pytorch.Trainer``. In addition to what
            Lightning accepts: ``strategy`` may be any registered strategy name or
            ``{"name": ..., **params}`` (Lightning's names too); ``precision`` may be ``"auto"``, a
            registered precision name or ``{"name": ..., **params}`` for one;
            ``accumulate_grad_batches`` may be an epoch-keyed dict (``{0: 8, 5: 4}``), a schedule
            name, ``{"name": ..., **params}`` or a schedule object; ``callbacks`` and ``plugins``
            may hold registered names or ``{"name": ..., **params}``.

    Returns:
        Keyword arguments for ``lightning.pytorch.Trainer``.

    Raises:
        UnknownNameError: an unknown strategy, precision, schedule or callback name (the message
            lists the names that exist and the closest match; ``BlockedNameError`` when a blocked
            plugin provides it).
        ParameterError: a parameter a named component does not take, or a required one missing.
        CompositionError: an unknown Trainer argument, or parts that do not fit together (a
            Lightning DeepSpeed name or ``16-mixed`` on CPU, a precision its strategy cannot use,
            ``accumulate_grad_batches`` below 1).

    Examples:
        >>> import lplugins
        >>> from lightning.pytorch import Trainer
        >>> kwargs = lplugins.compose(accelerator="cpu", precision="auto", max_steps=1, logger=False)
        >>> kwargs["precision"]
        '32-true'
        >>> trainer = Trainer(**kwargs, enable_progress_bar=False, enable_model_summary=False)
    """
    namespace, why = _namespace.choose(namespace, trainer_kwargs)
    if why is not None:
        announce(
            "lplugins: compose() builds for a %s.Trainer (%s); pass namespace='lightning' or 'pytorch_lightning' "
            "to choose.",
            _namespace.NAMESPACES[namespace][0],
            why,
        )
    if namespace != _OWN_NAMESPACE:
        twin = _namespace.module_for(__name__, namespace)
        return twin.compose(manager=manager, cpu_bf16=cpu_bf16, namespace=namespace, **trainer_kwargs)
    with _namespace.using(namespace):
        return _compose(manager, cpu_bf16, trainer_kwargs)


def _compose(manager: PluginManager | None, cpu_bf16: bool, trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
    manager = manager or get_manager()
    _check_trainer_arguments(trainer_kwargs)
    _pairs.check_accumulation_int(trainer_kwargs.get("accumulate_grad_batches"))
    out = dict(trainer_kwargs)
    plugins = _as_list(out.pop("plugins", None))
    callbacks = _as_list(out.pop("callbacks", None))

    accelerator = resolve_accelerator(out.get("accelerator"))
    strategy_component = None
    strategy = out.get("strategy")
    if isinstance(strategy, (str, Mapping)):
        strategy_component, out["strategy"] = _resolve_strategy(manager, strategy, trainer_kwargs)

    resolved_plugins: list[Any] = []
    for item in plugins:
        resolved_plugins.append(_resolve_plugin(manager, item, accelerator, out.get("strategy"), strategy_component))

    precision = out.get("precision")
    hook_view = dict(trainer_kwargs)
    if precision is not None:
        precision_obj = _resolve_precision(
            manager, precision, accelerator, out.get("strategy"), strategy_component, cpu_bf16, out.get("accelerator")
        )
        if isinstance(precision_obj, (str, int)):
            out["precision"] = hook_view["precision"] = precision_obj
        else:
            out.pop("precision")
            resolved_plugins.append(precision_obj)

    name = strategy.get("name") if isinstance(strategy, Mapping) else strategy
    if strategy_component is None and isinstance(name, str):
        registered = manager.registry("strategy")
        _pairs.check_strategy_on_accelerator(
            name, _strategy_class(name), accelerator, trainer_kwargs.get("accelerator"), list(registered)
        )

    if not any(_is_cluster_environment(p) for p in resolved_plugins):
        detected = _detect_cluster_environment(manager)
        if detected is not None:
            resolved_plugins.append(detected)

    accumulation: Any = out.get("accumulate_grad_batches")
    if accumulation is not None and not is_int(accumulation):
        out.pop("accumulate_grad_batches")
        callbacks.append(_resolve_accumulation(manager, accumulation))

    resolved_callbacks = [_resolve_callback(manager, cb) for cb in callbacks]
    if is_int(accumulation) and accumulation > 1:
        from lplugins.accumulation import AccumulationScheduler

        if any(isinstance(cb, AccumulationScheduler) for cb in resolved_callbacks):
            raise CompositionError(
                f"accumulate_grad_batches={accumulation} and an AccumulationScheduler in callbacks both set the "
                f"accumulation factor; keep one (give the schedule as accumulate_grad_batches=...)."
            )
    resolved_callbacks.extend(manager.trainer_callbacks(MappingProxyType(hook_view)))
    _check_duplicates(resolved_callbacks)

    if resolved_callbacks:
        out["callbacks"] = resolved_callbacks
    if resolved_plugins:
        out["plugins"] = resolved_plugins
    return out


def compose_trainer(
    *, manager: PluginManager | None = None, cpu_bf16: bool = False, namespace: str | None = None, **trainer_kwargs: Any
) -> Trainer:
    """``Trainer(**compose(**trainer_kwargs))`` in one call: the ``_target_`` for a config system.

    With Hydra, set ``_target_: lplugins.compose_trainer`` where a config says
    ``_target_: lightning.pytorch.Trainer``; ``hydra.utils.instantiate(cfg.trainer, callbacks=...)``
    then accepts lplugins names (strategies, precisions, schedules, ``{"name": ..., **params}``
    callbacks). OmegaConf containers (what Hydra passes without ``_convert_``) are turned into plain
    dicts and lists first.

    Args:
        manager: As for :func:`compose`.
        cpu_bf16: As for :func:`compose`.
        namespace: As for :func:`compose`: which ``Trainer`` is built.
        **trainer_kwargs: ``Trainer`` keyword arguments; names as :func:`compose` accepts them.

    Returns:
        A stock ``lightning.pytorch.Trainer`` (``pytorch_lightning.Trainer`` for that namespace).

    Raises:
        LPluginsError: as :func:`compose` (an unknown name, a bad parameter, a pair that does not fit).

    Examples:
        >>> import lplugins
        >>> trainer = lplugins.compose_trainer(
        ...     accelerator="cpu", precision="auto", max_steps=1, logger=False, enable_progress_bar=False,
        ...     enable_model_summary=False,
        ... )
        >>> type(trainer).__name__, trainer.precision
        ('Trainer', '32-true')
    """
    plain = {key: _plain_container(value) for key, value in trainer_kwargs.items()}
    chosen, _ = _namespace.choose(namespace, plain)
    if chosen != _OWN_NAMESPACE:
        twin = _namespace.module_for(__name__, chosen)
        return twin.compose_trainer(manager=manager, cpu_bf16=cpu_bf16, namespace=namespace, **plain)
    from lightning.pytorch import Trainer

    return Trainer(**compose(manager=manager, cpu_bf16=cpu_bf16, namespace=namespace, **plain))


def _plain_container(value: Any) -> Any:
    """An OmegaConf ``DictConfig``/``ListConfig`` as plain dicts and lists (resolved); anything else unchanged."""
    if type(value).__module__.split(".")[0] != "omegaconf":
        return value
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True)


def attach(
    trainer: Trainer, *callbacks: Callback | str | Mapping[str, Any], manager: PluginManager | None = None
) -> list[Callback]:
    """Attach callbacks to an already-built Trainer, before ``fit``.

    Lightning's ordering rules are applied (tuner callbacks first, checkpoint callbacks last), a
    second instance of a stateful callback is refused, and the attached callbacks' state is saved
    into and restored from checkpoints like any other callback's.

    Attaching a checkpoint callback (a ``lightning.pytorch.callbacks.Checkpoint``, such as
    ``durable_checkpoint``) removes Lightning's *default* ``ModelCheckpoint`` -- the one ``Trainer``
    adds when ``enable_checkpointing=True`` and no checkpoint callback was given, recognised by
    every argument and all its state still at their defaults -- and says so, so that checkpoints
    are written by one system in one place. A ``ModelCheckpoint`` configured in any way is kept.

    Args:
        trainer: A ``lightning.pytorch.Trainer`` or a ``pytorch_lightning.Trainer``.
        *callbacks: ``Callback`` instances, registered callback names or ``{"name": ..., **params}``.
        manager: The plugin manager (default: the process-wide one).

    Returns:
        The attached callback objects.

    Raises:
        CompositionError: the Trainer is running, or a stateful callback would be duplicated.
        UnknownNameError: an unknown callback name (``BlockedNameError``: one a blocked plugin provides).
        ParameterError: a parameter the callback does not take, or a required one missing.
    """
    namespace = _namespace.of_object(trainer) or _OWN_NAMESPACE
    if namespace != _OWN_NAMESPACE:
        return _namespace.module_for(__name__, namespace).attach(trainer, *callbacks, manager=manager)
    with _namespace.using(namespace):
        return _attach(trainer, callbacks, manager)


def _attach(trainer: Trainer, callbacks: Sequence[Any], manager: PluginManager | None) -> list[Callback]:
    from lightning.pytorch.trainer.states import TrainerStatus

    _arm_watchdog(trainer)  # also where lplugins' callbacks_factory entry point is not installed
    if trainer.state.status == TrainerStatus.RUNNING:
        raise CompositionError(
            "Cannot attach callbacks while the Trainer is running; call lplugins.attach() before trainer.fit()."
        )
    from lightning.pytorch.callbacks import Checkpoint

    manager = manager or get_manager()
    new = [_resolve_callback(manager, cb) for cb in callbacks]
    existing: list[Callback] = list(getattr(trainer, "callbacks", []))
    checkpoints = [cb for cb in new if isinstance(cb, Checkpoint)]
    if checkpoints:
        defaults = [cb for cb in existing if _pairs.is_default_model_checkpoint(cb)]
        if defaults:
            existing = [cb for cb in existing if not any(cb is d for d in defaults)]
            announce(
                "lplugins: attach() removed Lightning's default ModelCheckpoint (added by Trainer because "
                "enable_checkpointing=True and no checkpoint callback was given): %s writes the checkpoints now. "
                "Pass a configured ModelCheckpoint to the Trainer to keep both.",
                type(checkpoints[0]).__name__,
            )
    _check_duplicates(existing + new)
    trainer.callbacks = _lightning.reorder_callbacks(existing + new)  # type: ignore[attr-defined]  # set in Trainer()
    _understand_ckpt_path(trainer)
    return new


def _arm_watchdog(trainer: Any) -> None:
    """Arm the collective watchdog for a Trainer of more than one process (``LPLUGINS_COLLECTIVE_TIMEOUT``).

    Raises:
        LPluginsError: ``LPLUGINS_COLLECTIVE_TIMEOUT`` is not a number of seconds >= 0.
    """
    from lplugins import _watchdog
    from lplugins._env import COLLECTIVE_TIMEOUT, env_seconds

    timeout = env_seconds(COLLECTIVE_TIMEOUT, _watchdog.DEFAULT_TIMEOUT)
    if getattr(trainer, "world_size", 1) > 1 or timeout == 0:
        _watchdog.arm(timeout)


def _understand_ckpt_path(trainer: Any) -> None:
    """``fit(ckpt_path="last")`` means an attached DurableCheckpoint's newest; ``"latest"`` without one is explained."""
    from lplugins.callbacks import DurableCheckpoint
    from lplugins.callbacks._resume import understand_ckpt_path

    understand_ckpt_path(trainer, DurableCheckpoint)


# ---------------------------------------------------------------------- pieces
def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


_TRAINER_PARAMS: frozenset[str] | None = None


def _check_trainer_arguments(kwargs: Mapping[str, Any]) -> None:
    global _TRAINER_PARAMS
    if _TRAINER_PARAMS is None:
        from lightning.pytorch import Trainer

        _TRAINER_PARAMS = frozenset(inspect.signature(Trainer.__init__).parameters) - {"self"}
    for key in kwargs:
        if key not in _TRAINER_PARAMS:
            raise CompositionError(
                f"Unknown Trainer argument {key!r}."
                + did_you_mean(key, _TRAINER_PARAMS)
                + " See lightning.pytorch.Trainer for the accepted arguments."
            )


def _lightning_strategy_names(registered: Any) -> list[str]:
    """Lightning's strategy names, less those another lplugins manager mirrored there (not ``registered`` here)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lplugins._mirror import MIRRORED_BY_LPLUGINS

    names = StrategyRegistry.available_strategies()
    return ["auto", *(n for n in names if n not in MIRRORED_BY_LPLUGINS or n in registered)]


def _resolve_strategy(manager: PluginManager, spec: Any, trainer_kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
    """A name or ``{"name": ..., **params}``; a factory with a ``trainer_kwargs`` parameter gets them
    (unless ``params`` has them)."""
    registry = manager.registry("strategy")
    params: dict[str, Any] = {}
    if isinstance(spec, Mapping):
        if "name" not in spec:
            raise CompositionError(f"strategy={dict(spec)!r} needs a 'name' key: {{'name': ..., **params}}.")
        params = {k: v for k, v in spec.items() if k != "name"}
        name = spec["name"]
        if name not in registry:
            return None, _lightning_strategy_with_params(manager, name, params)
    else:
        name = spec
    if name in registry:
        component = registry.get(name)
        injected = component.injected({"trainer_kwargs": MappingProxyType(dict(trainer_kwargs))})
        return component, component.create(**{**injected, **params})
    lightning_names = _lightning_strategy_names(registry)
    if name in lightning_names:
        return None, name
    raise manager.name_error("strategy", name, set(lightning_names) | set(registry))


def _lightning_strategy_with_params(manager: PluginManager, name: Any, params: Mapping[str, Any]) -> Any:
    """``{"name": "ddp", **params}`` for a name of Lightning's ``StrategyRegistry``: checked, then built."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lplugins._params import check_call

    registry = manager.registry("strategy")
    entry = dict.get(StrategyRegistry, name) if name in _lightning_strategy_names(registry) else None
    if entry is None:
        raise manager.name_error("strategy", name, set(_lightning_strategy_names(registry)) | set(registry))
    check_call("strategy", name, entry["strategy"], entry["init_params"], params, plugin="lightning")
    return entry["strategy"](**{**entry["init_params"], **params})


def _strategy_label(strategy: Any, component: Any) -> str:
    if component is not None:
        return str(component.name)
    if isinstance(strategy, str):
        return strategy
    return type(strategy).__name__ if strategy is not None else "auto"


def _check_supported(component: Any, accelerator: str, strategy: Any, strategy_component: Any) -> None:
    accelerators = component.metadata.get("accelerators")
    if accelerators is not None and accelerator not in accelerators:
        raise CompositionError(
            f"Precision {component.name!r} does not support accelerator {accelerator!r}; "
            f"it supports: {', '.join(accelerators)}."
        )
    strategies = component.metadata.get("strategies")
    label = _strategy_label(strategy, strategy_component)
    if strategies is not None and strategy is not None and label != "auto" and label not in strategies:
        raise CompositionError(
            f"Precision {component.name!r} cannot be used with strategy {label!r}; "
            f"it works with: {', '.join(strategies)}."
        )


def _resolve_precision(
    manager: PluginManager,
    precision: Any,
    accelerator: str,
    strategy: Any,
    strategy_component: Any,
    cpu_bf16: bool,
    given_accelerator: object = None,
) -> Any:
    params: dict[str, Any] = {}
    if isinstance(precision, Mapping) and isinstance(precision.get("name"), str):
        params = {k: v for k, v in precision.items() if k != "name"}
        precision = precision["name"]
        if precision not in manager.registry("precision"):
            raise CompositionError(
                f"precision={{'name': {precision!r}, ...}}: parameters can be given only to a registered precision "
                f"({', '.join(manager.registry('precision').names()) or 'none registered'})."
            )
    if not isinstance(precision, str):
        if is_int(precision) and str(precision) in LIGHTNING_PRECISIONS:
            _pairs.check_precision_on_accelerator(
                _lightning.unified_precision(precision), accelerator, given_accelerator
            )
            _check_lightning_precision(str(precision), strategy, strategy_component)
            return precision
        raise CompositionError(
            f"precision={precision!r} is not a precision name; pass a string such as 'auto', "
            f"'bf16-mixed' or a registered name, or put a Precision instance in plugins=[...]."
        )
    if precision == "auto":
        caps = probe_capabilities(accelerator, cpu_bf16=cpu_bf16)
        chosen, reason = choose_precision(accelerator, caps, manager)
        if chosen == "auto":
            raise CompositionError("lplugins_choose_precision returned 'auto'; a plugin must return a concrete name.")
        announce("lplugins: precision='auto' chose %r (%s)", chosen, reason)
        return _resolve_precision(
            manager, chosen, accelerator, strategy, strategy_component, cpu_bf16, given_accelerator
        )
    registry = manager.registry("precision")
    if precision in registry:
        component = registry.get(precision)
        _check_supported(component, accelerator, strategy, strategy_component)
        return _create_precision(component, accelerator, strategy, strategy_component, params)
    if precision in LIGHTNING_PRECISIONS:
        _pairs.check_precision_on_accelerator(_lightning.unified_precision(precision), accelerator, given_accelerator)
        _check_lightning_precision(precision, strategy, strategy_component)
        return precision
    available = {"auto", *LIGHTNING_PRECISIONS, *registry}
    raise manager.name_error("precision", precision, available, hint=_pairs.precision_hint(precision, available))


def _create_precision(
    component: Component, accelerator: str, strategy: Any, strategy_component: Any, params: Mapping[str, Any]
) -> Any:
    """Create a registered precision; a factory that declares ``accelerator``/``strategy`` gets them.

    The object is then checked against a DeepSpeed or FSDP strategy, which need their own precision plugins.
    """
    label = _strategy_label(strategy, strategy_component)
    available = {"accelerator": accelerator, "strategy": label}
    plugin = component.create(**{**component.injected(available), **params})
    declared = component.metadata.get("strategies")
    _pairs.check_precision_plugin_for_strategy(component.name, plugin, declared, _strategy_class(strategy), label)
    return plugin


def _strategy_class(strategy: Any) -> type | None:
    if strategy is None:
        return None
    if not isinstance(strategy, str):
        return type(strategy)
    from lightning.pytorch.strategies import StrategyRegistry

    entry = dict.get(StrategyRegistry, strategy)  # the registry's own .get() would build the strategy
    factory = entry["strategy"] if entry else None
    return factory if isinstance(factory, type) else None


def _check_lightning_precision(precision: str, strategy: Any, strategy_component: Any) -> None:
    """Refuse, before training, a Lightning precision string that the strategy's own precision plugin rejects."""
    cls = _strategy_class(strategy)
    if cls is None:
        return
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if issubclass(cls, DeepSpeedStrategy):
        allowed, family = _lightning.strategy_precisions("deepspeed"), "DeepSpeed"
    elif issubclass(cls, FSDPStrategy):
        allowed, family = _lightning.strategy_precisions("fsdp"), "FSDP"
    else:
        return
    if _lightning.unified_precision(precision) not in allowed:
        label = _strategy_label(strategy, strategy_component)
        raise CompositionError(
            f"Precision {precision!r} cannot be used with strategy {label!r} ({family} uses its own precision "
            f"plugin); it supports: {', '.join(allowed)}."
        )


def _is_cluster_environment(obj: Any) -> bool:
    from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

    return isinstance(obj, ClusterEnvironment)


def _resolve_plugin(manager: PluginManager, item: Any, accelerator: str, strategy: Any, strategy_component: Any) -> Any:
    """A plugin object as is; a cluster environment or precision name, or ``{"name": ..., **params}``."""
    params: dict[str, Any] = {}
    if isinstance(item, Mapping) and "name" in item:
        params = {k: v for k, v in item.items() if k != "name"}
        item = item["name"]
    if not isinstance(item, str):
        return item
    envs = manager.registry("cluster_environment")
    if item in envs:
        return envs.get(item).create(**params)
    precisions = manager.registry("precision")
    if item in precisions:
        component = precisions.get(item)
        _check_supported(component, accelerator, strategy, strategy_component)
        return _create_precision(component, accelerator, strategy, strategy_component, params)
    available = set(envs) | set(precisions)
    raise manager.name_error("plugin", item, available)


def _detect_cluster_environment(manager: PluginManager) -> Any:
    for component in manager.registry("cluster_environment").components():
        detect = component.metadata.get("detect")
        if detect is not None and detect():
            announce("lplugins: detected cluster environment %r (its detect() is true here)", component.name)
            return component.create()
    return None


def _resolve_accumulation(manager: PluginManager, value: Any) -> Callback:
    from lplugins.accumulation import AccumulationScheduler, Schedule

    schedules = manager.registry("schedule")
    if isinstance(value, Schedule):
        schedule = value
    elif isinstance(value, str):
        schedule = manager.get("schedule", value).create()
    elif isinstance(value, Mapping) and "name" in value:
        params = {k: v for k, v in value.items() if k != "name"}
        schedule = manager.get("schedule", value["name"]).create(**params)
    elif isinstance(value, Mapping):
        schedule = manager.get("schedule", "epoch").create(schedule=dict(value))
    else:
        raise CompositionError(
            f"accumulate_grad_batches={value!r} is not understood; pass an int, an epoch-keyed dict such as "
            f"{{0: 8, 5: 4}}, a schedule name ({', '.join(schedules.names())}), {{'name': ..., **params}} "
            f"or a lplugins.accumulation.Schedule."
        )
    return AccumulationScheduler(schedule)


def _resolve_callback(manager: PluginManager, item: Any) -> Callback:
    from lightning.pytorch.callbacks import Callback

    if isinstance(item, Callback):
        return item
    registry = manager.registry("callback")
    if isinstance(item, str):
        return manager.get("callback", item).create()
    if isinstance(item, Mapping) and "name" in item:
        params = {k: v for k, v in item.items() if k != "name"}
        return manager.get("callback", item["name"]).create(**params)
    raise CompositionError(
        f"Callback {item!r} is neither a lightning.pytorch.Callback, a registered callback name "
        f"({', '.join(registry.names()) or 'none registered'}) nor {{'name': ..., **params}}."
    )


def _check_duplicates(callbacks: Sequence[Callback]) -> None:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.model_helpers import is_overridden

    seen: dict[str, Callback] = {}
    for cb in callbacks:
        if not is_overridden("state_dict", instance=cb, parent=Callback):
            continue
        key = cb.state_key
        if key in seen:
            raise CompositionError(
                f"Two stateful callbacks share the state key {key!r} ({type(seen[key]).__name__} and "
                f"{type(cb).__name__}); their checkpoint state would collide. Keep one, or give them "
                f"different arguments so that their state keys differ."
            )
        seen[key] = cb
