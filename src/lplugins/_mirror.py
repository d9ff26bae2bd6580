"""The mirror of lplugins' strategy names into Lightning's ``StrategyRegistry``.

Mirroring is what makes ``lightning.pytorch.Trainer(strategy="deepspeed_stage_2_cpu")`` and
``LightningCLI --trainer.strategy ...`` work once plugins are loaded. Each manager owns a
:class:`StrategyMirror`; closing the manager removes its names again. Several managers may live in
one process (a test's fresh manager beside the process-wide one): a later one shadows an earlier
one's entry and restores it when it closes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from lplugins._registry import Component

#: Strategy names that some lplugins manager in this process mirrored into Lightning's registry,
#: with how many managers currently hold each (a test's fresh manager may shadow the default one's).
MIRRORED_BY_LPLUGINS: dict[str, int] = {}
#: Every StrategyMirror made in this process (weakly: a closed manager's holds no names).
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def lightning_strategy_registry() -> Any:
    """Lightning's ``StrategyRegistry`` (imported on first use: loading plugins imports no strategy)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return StrategyRegistry


def other_strategy_registries() -> list[tuple[str, Any]]:
    """``(namespace, StrategyRegistry)`` of ``pytorch_lightning``, once something imported it.

    The mirror never imports ``pytorch_lightning``; names are mirrored into its registry when it is
    already imported at ``load()``, or when it is imported later (:func:`_namespace.on_import`).
    """
    import sys

    from lplugins import _namespace

    module = sys.modules.get("pytorch_lightning.strategies")
    registry = getattr(module, "StrategyRegistry", None)
    return [] if registry is None else [(_namespace.PYTORCH_LIGHTNING, registry)]


def _bound(component: Component, namespace: str) -> Any:
    """A factory for ``namespace``'s ``StrategyRegistry`` that builds ``component`` for that namespace."""
    from lplugins import _namespace

    def factory(**kwargs: Any) -> Any:
        with _namespace.using(namespace):
            return component.create(**kwargs)

    factory.__name__ = factory.__qualname__ = component.name
    return factory


def foreign_strategy_names(names: Iterable[str]) -> set[str]:
    """Those of ``names`` that Lightning's registry has and no lplugins manager put there."""
    wanted = set(names)
    if not wanted:
        return set()
    return (wanted & set(lightning_strategy_registry().keys())) - set(MIRRORED_BY_LPLUGINS)


class StrategyMirror:
    """The strategy names one manager put into Lightning's ``StrategyRegistry``, and what they shadow."""

    def __init__(self) -> None:
        self._mirrored: set[str] = set()
        self._shadowed: dict[str, Any] = {}
        self._components: dict[str, Component] = {}
        self._other_shadowed: dict[tuple[int, str], Any] = {}
        _LIVE.add(self)
        from lplugins import _namespace

        _namespace.on_import("pytorch_lightning.strategies", _mirror_into_new)

    def _add_to(self, registry: Any, component: Component) -> None:
        """Register ``component`` in the ``pytorch_lightning`` registry (built for that namespace)."""
        from lplugins import _namespace

        if component.name in registry:
            self._other_shadowed[(id(registry), component.name)] = registry[component.name]
        registry.register(
            component.name,
            _bound(component, _namespace.PYTORCH_LIGHTNING),
            description=component.description or f"registered by lplugins plugin {component.plugin!r}",
            override=True,
        )

    def mirror_into(self, registry: Any) -> None:
        """Mirror every name this manager holds into ``registry`` (``pytorch_lightning``'s, just imported)."""
        for component in self._components.values():
            self._add_to(registry, component)

    def __contains__(self, name: object) -> bool:
        return name in self._mirrored

    def add(self, component: Component) -> None:
        """Register ``component`` (a strategy) in Lightning's registry, shadowing another manager's entry."""
        registry = lightning_strategy_registry()
        if component.name in registry:  # mirrored by another lplugins manager: shadow it until we close
            self._shadowed[component.name] = registry[component.name]
        registry.register(
            component.name,
            component.factory,
            description=component.description or f"registered by lplugins plugin {component.plugin!r}",
            override=True,
            **component.defaults,
        )
        for _namespace_name, other in other_strategy_registries():
            self._add_to(other, component)
        self._components[component.name] = component
        self._mirrored.add(component.name)
        MIRRORED_BY_LPLUGINS[component.name] = MIRRORED_BY_LPLUGINS.get(component.name, 0) + 1

    def remove(self, name: str) -> None:
        """Remove ``name`` from Lightning's registry, restoring the entry it shadowed, if any."""
        if name not in self._mirrored:
            return
        registry = lightning_strategy_registry()
        if name in self._shadowed:
            registry[name] = self._shadowed.pop(name)
        else:
            registry.pop(name, None)
        for _namespace_name, other in other_strategy_registries():
            shadowed = self._other_shadowed.pop((id(other), name), None)
            if shadowed is not None:
                other[name] = shadowed
            else:
                other.pop(name, None)
        self._components.pop(name, None)
        self._mirrored.discard(name)
        count = MIRRORED_BY_LPLUGINS.get(name, 0) - 1
        if count > 0:
            MIRRORED_BY_LPLUGINS[name] = count
        else:
            MIRRORED_BY_LPLUGINS.pop(name, None)


def mirror_into_all(registry: Any) -> None:
    """Mirror every live manager's strategy names into ``registry`` (``pytorch_lightning``'s, newly imported)."""
    for mirror in list(_LIVE):
        mirror.mirror_into(registry)


def _mirror_into_new(module: Any) -> None:
    mirror_into_all(module.StrategyRegistry)
