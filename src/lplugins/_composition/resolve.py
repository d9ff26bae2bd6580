"""One Trainer argument at a time, names turned into objects: the strategy, precision, plugins, accumulation, callbacks.

What :func:`lplugins.compose` (``compose.py``) calls for each argument it is given, with every check
that belongs to that argument (a name of the wrong namespace, a precision the strategy does not
take, a duplicate stateful callback) raised before any Trainer exists.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lplugins import _lightning
from lplugins._composition import pairs as _pairs
from lplugins._errors import CompositionError
from lplugins._log import announce
from lplugins._plugins.manager import PluginManager
from lplugins._plugins.registry import Component
from lplugins._validate import did_you_mean, is_int
from lplugins.precision._auto import LIGHTNING_PRECISIONS, choose_precision, probe_capabilities

if TYPE_CHECKING:
    from lightning.pytorch import Callback


def as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


_TRAINER_PARAMS: frozenset[str] | None = None


def check_trainer_arguments(kwargs: Mapping[str, Any]) -> None:
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

    from lplugins._plugins.mirror import MIRRORED_BY_LPLUGINS

    names = StrategyRegistry.available_strategies()
    return ["auto", *(n for n in names if n not in MIRRORED_BY_LPLUGINS or n in registered)]


def resolve_strategy(manager: PluginManager, spec: Any, trainer_kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
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

    from lplugins._plugins.params import check_call

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


def resolve_precision(
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
        return resolve_precision(
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
    _pairs.check_precision_plugin_for_strategy(component.name, plugin, declared, strategy_class(strategy), label)
    return plugin


def strategy_class(strategy: Any) -> type | None:
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
    cls = strategy_class(strategy)
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


def is_cluster_environment(obj: Any) -> bool:
    from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

    return isinstance(obj, ClusterEnvironment)


def resolve_plugin(manager: PluginManager, item: Any, accelerator: str, strategy: Any, strategy_component: Any) -> Any:
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


def detect_cluster_environment(manager: PluginManager) -> Any:
    for component in manager.registry("cluster_environment").components():
        detect = component.metadata.get("detect")
        if detect is not None and detect():
            announce("lplugins: detected cluster environment %r (its detect() is true here)", component.name)
            return component.create()
    return None


def resolve_accumulation(manager: PluginManager, value: Any) -> Callback:
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


def resolve_callback(manager: PluginManager, item: Any) -> Callback:
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


def check_duplicates(callbacks: Sequence[Callback]) -> None:
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
