"""Turning lplugins names into objects for a stock ``lightning.pytorch.Trainer``."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lplugins import _lightning
from lplugins._errors import CompositionError, UnknownNameError
from lplugins._manager import PluginManager, get_manager
from lplugins._validate import did_you_mean, is_int
from lplugins.precision._auto import LIGHTNING_PRECISIONS, choose_precision, probe_capabilities, resolve_accelerator

if TYPE_CHECKING:
    from lightning.pytorch import Callback, Trainer

log = logging.getLogger("lplugins")


def compose(*, manager: PluginManager | None = None, cpu_bf16: bool = False, **trainer_kwargs: Any) -> dict[str, Any]:
    """Turn Trainer keyword arguments that use lplugins names into ones the stock Trainer accepts.

    ``strategy``, ``precision``, ``accumulate_grad_batches``, ``callbacks`` and ``plugins`` may use
    names registered by plugins (built-ins included); everything else is passed through unchanged.
    Every name and argument is checked here, before any training starts. Callbacks contributed by
    plugins through ``lplugins_trainer_callbacks`` are added.

    Args:
        manager: The plugin manager (default: the process-wide one, loaded on first use).
        cpu_bf16: Let ``precision="auto"`` pick bf16 on CPU.
        **trainer_kwargs: Keyword arguments for ``lightning.pytorch.Trainer``. In addition to what
            Lightning accepts: ``strategy`` may be any registered strategy name; ``precision`` may
            be ``"auto"`` or a registered precision name; ``accumulate_grad_batches`` may be an
            epoch-keyed dict (``{0: 8, 5: 4}``), a schedule name, ``{"name": ..., **params}`` or a
            schedule object; ``callbacks`` and ``plugins`` may hold registered names.

    Returns:
        Keyword arguments for ``lightning.pytorch.Trainer``.

    Raises:
        UnknownNameError: an unknown strategy, precision, schedule or callback name (the message
            lists the names that exist and the closest match).
        CompositionError: an unknown Trainer argument, or parts that do not fit together.

    Example:
        >>> import lplugins
        >>> from lightning.pytorch import Trainer
        >>> kwargs = lplugins.compose(accelerator="cpu", precision="auto", max_steps=1, logger=False)
        >>> kwargs["precision"]
        '32-true'
        >>> trainer = Trainer(**kwargs, enable_progress_bar=False, enable_model_summary=False)
    """
    manager = manager or get_manager()
    _check_trainer_arguments(trainer_kwargs)
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
        resolved_plugins.append(_resolve_plugin(manager, item, accelerator, strategy, strategy_component))

    precision = out.get("precision")
    hook_view = dict(trainer_kwargs)
    if precision is not None:
        precision_obj = _resolve_precision(
            manager, precision, accelerator, out.get("strategy"), strategy_component, cpu_bf16
        )
        if isinstance(precision_obj, (str, int)):
            out["precision"] = hook_view["precision"] = precision_obj
        else:
            out.pop("precision")
            resolved_plugins.append(precision_obj)

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


def attach(trainer: Trainer, *callbacks: Callback | str, manager: PluginManager | None = None) -> list[Callback]:
    """Attach callbacks to an already-built Trainer, before ``fit``.

    Lightning's ordering rules are applied (tuner callbacks first, checkpoint callbacks last), a
    second instance of a stateful callback is refused, and the attached callbacks' state is saved
    into and restored from checkpoints like any other callback's.

    Args:
        trainer: A ``lightning.pytorch.Trainer``.
        *callbacks: ``Callback`` instances or registered callback names.
        manager: The plugin manager (default: the process-wide one).

    Returns:
        The attached callback objects.

    Raises:
        CompositionError: the Trainer is running, or a stateful callback would be duplicated.
        UnknownNameError: an unknown callback name.
    """
    from lightning.pytorch.trainer.states import TrainerStatus

    if trainer.state.status == TrainerStatus.RUNNING:
        raise CompositionError(
            "Cannot attach callbacks while the Trainer is running; call lplugins.attach() before trainer.fit()."
        )
    manager = manager or get_manager()
    new = [_resolve_callback(manager, cb) for cb in callbacks]
    existing: list[Callback] = list(getattr(trainer, "callbacks", []))
    _check_duplicates(existing + new)
    trainer.callbacks = _lightning.reorder_callbacks(existing + new)  # type: ignore[attr-defined]  # set in Trainer()
    return new


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


def _lightning_strategy_names() -> list[str]:
    from lightning.pytorch.strategies import StrategyRegistry

    return ["auto", *StrategyRegistry.available_strategies()]


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
            raise UnknownNameError("strategy", name, registry)
    else:
        name = spec
    if name in registry:
        component = registry.get(name)
        injected = component.injected({"trainer_kwargs": MappingProxyType(dict(trainer_kwargs))})
        return component, component.create(**{**injected, **params})
    lightning_names = _lightning_strategy_names()
    if name in lightning_names:
        return None, name
    raise UnknownNameError("strategy", name, set(lightning_names) | set(registry))


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
) -> Any:
    if not isinstance(precision, str):
        if isinstance(precision, int) and str(precision) in LIGHTNING_PRECISIONS:
            return precision
        raise CompositionError(
            f"precision={precision!r} is not a precision name; pass a string such as 'auto', "
            f"'bf16-mixed' or a registered name, or put a Precision instance in plugins=[...]."
        )
    if precision == "auto":
        caps = probe_capabilities(accelerator, cpu_bf16=cpu_bf16)
        chosen, reason = choose_precision(accelerator, caps, manager)
        log.info("lplugins: precision='auto' chose %r (%s)", chosen, reason)
        if chosen == "auto":
            raise CompositionError("lplugins_choose_precision returned 'auto'; a plugin must return a concrete name.")
        return _resolve_precision(manager, chosen, accelerator, strategy, strategy_component, cpu_bf16)
    registry = manager.registry("precision")
    if precision in registry:
        component = registry.get(precision)
        _check_supported(component, accelerator, strategy, strategy_component)
        return _create_precision(component, accelerator, strategy, strategy_component)
    if precision in LIGHTNING_PRECISIONS:
        _check_lightning_precision(precision, strategy, strategy_component)
        return precision
    raise UnknownNameError("precision", precision, {"auto", *LIGHTNING_PRECISIONS, *registry})


def _create_precision(component: Any, accelerator: str, strategy: Any, strategy_component: Any) -> Any:
    """Create a registered precision; a factory that declares ``accelerator``/``strategy`` gets them."""
    available = {"accelerator": accelerator, "strategy": _strategy_label(strategy, strategy_component)}
    return component.create(**component.injected(available))


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
    if not isinstance(item, str):
        return item
    envs = manager.registry("cluster_environment")
    if item in envs:
        return envs.get(item).create()
    precisions = manager.registry("precision")
    if item in precisions:
        component = precisions.get(item)
        _check_supported(component, accelerator, strategy, strategy_component)
        return component.create()
    available = set(envs) | set(precisions)
    raise UnknownNameError("plugin", item, available)


def _detect_cluster_environment(manager: PluginManager) -> Any:
    for component in manager.registry("cluster_environment").components():
        detect = component.metadata.get("detect")
        if detect is not None and detect():
            log.info("lplugins: detected cluster environment %r", component.name)
            return component.create()
    return None


def _resolve_accumulation(manager: PluginManager, value: Any) -> Callback:
    from lplugins.accumulation import AccumulationScheduler, Schedule

    schedules = manager.registry("schedule")
    if isinstance(value, Schedule):
        schedule = value
    elif isinstance(value, str):
        schedule = schedules.get(value).create()
    elif isinstance(value, Mapping) and "name" in value:
        params = {k: v for k, v in value.items() if k != "name"}
        schedule = schedules.get(value["name"]).create(**params)
    elif isinstance(value, Mapping):
        schedule = schedules.get("epoch").create(schedule=dict(value))
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
        return registry.get(item).create()
    if isinstance(item, Mapping) and "name" in item:
        params = {k: v for k, v in item.items() if k != "name"}
        return registry.get(item["name"]).create(**params)
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
