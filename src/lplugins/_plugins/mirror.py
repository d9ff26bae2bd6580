"""The mirror of lplugins' strategy names into Lightning's ``StrategyRegistry`` (of each namespace).

Mirroring is what makes ``lightning.pytorch.Trainer(strategy="deepspeed_stage_2_cpu")`` and
``LightningCLI --trainer.strategy ...`` work once plugins are loaded. Each manager owns a
:class:`StrategyMirror`; closing the manager removes its names again. Several managers may live in
one process (a test's fresh manager beside the process-wide one): a later one shadows an earlier
one's entry and restores it when it closes.

``lightning.pytorch`` and ``pytorch_lightning`` each have a ``StrategyRegistry``. The mirror writes
into the registries of the namespaces the process has imported and into the others when they are
imported later (:func:`lplugins._lightning.imports.on_import`): it never imports a namespace the process
has not imported, except when neither is (then the installed one, ``lightning`` when both are).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
import weakref
from collections.abc import Iterable
from typing import Any

from lplugins._lightning import namespace as _namespace
from lplugins._lightning.imports import on_import
from lplugins._plugins.registry import Component

#: Strategy names that some lplugins manager in this process mirrored into Lightning's registry,
#: with how many managers currently hold each (a test's fresh manager may shadow the default one's).
MIRRORED_BY_LPLUGINS: dict[str, int] = {}
#: Every StrategyMirror made in this process (weakly: a closed manager's holds no names).
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_ORDER = itertools.count()
#: namespace -> the module that holds its ``StrategyRegistry``.
REGISTRY_MODULES = {namespace: f"{packages[0]}.strategies" for namespace, packages in _namespace.NAMESPACES.items()}


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _imported_registries() -> list[tuple[str, Any]]:
    found = []
    for namespace, module_name in REGISTRY_MODULES.items():
        registry = getattr(sys.modules.get(module_name), "StrategyRegistry", None)
        if registry is not None:
            found.append((namespace, registry))
    return found


def strategy_registries() -> list[tuple[str, Any]]:
    """``(namespace, StrategyRegistry)`` of every Lightning namespace this process has imported.

    When neither is imported, that of the installed one is imported (``lightning`` when both are):
    names are checked against Lightning's own when plugins load.
    """
    found = _imported_registries()
    if found:
        return found
    for namespace, module_name in REGISTRY_MODULES.items():
        if _installed(_namespace.NAMESPACES[namespace][0].partition(".")[0]):
            return [(namespace, importlib.import_module(module_name).StrategyRegistry)]
    return []  # pragma: no cover - lplugins requires lightning


def _bound(component: Component, namespace: str) -> Any:
    """A factory for ``namespace``'s ``StrategyRegistry`` that builds ``component`` for that namespace."""

    def factory(**kwargs: Any) -> Any:
        with _namespace.using(namespace):
            return component.create(**kwargs)

    factory.__name__ = factory.__qualname__ = component.name
    return factory


def foreign_strategy_names(names: Iterable[str]) -> set[str]:
    """Those of ``names`` that a Lightning registry has and no lplugins manager put there."""
    wanted = set(names)
    if not wanted:
        return set()
    present: set[str] = set()
    for _, registry in strategy_registries():
        present |= wanted & set(registry.keys())
    return present - set(MIRRORED_BY_LPLUGINS)


class StrategyMirror:
    """The strategy names one manager put into Lightning's ``StrategyRegistry``, and what they shadow."""

    def __init__(self) -> None:
        self._mirrored: set[str] = set()
        self._components: dict[str, Component] = {}
        #: (namespace, name) -> the entry this manager's shadows in that namespace's registry
        self._shadowed: dict[tuple[str, str], Any] = {}
        #: namespaces whose registry holds this manager's names
        self._into: set[str] = set()
        self._order = next(_ORDER)
        _LIVE.add(self)
        for module_name in REGISTRY_MODULES.values():
            if module_name not in sys.modules:
                on_import(module_name, _mirror_into_new)

    def _add_to(self, namespace: str, registry: Any, component: Component) -> None:
        """Register ``component`` in ``namespace``'s ``registry``, shadowing what is there."""
        key = (namespace, component.name)
        if component.name in registry and key not in self._shadowed:  # another lplugins manager's entry
            self._shadowed[key] = registry[component.name]
        description = component.description or f"registered by lplugins plugin {component.plugin!r}"
        if namespace == _namespace.LIGHTNING:
            registry.register(
                component.name, component.factory, description=description, override=True, **component.defaults
            )
        else:  # built for that namespace (a built-in: from its twin)
            registry.register(component.name, _bound(component, namespace), description=description, override=True)
        self._into.add(namespace)

    def mirror_into(self, namespace: str, registry: Any) -> None:
        """Mirror every name this manager holds into ``registry`` (``namespace``'s, just imported)."""
        for component in self._components.values():
            self._add_to(namespace, registry, component)

    def __contains__(self, name: object) -> bool:
        return name in self._mirrored

    def add(self, component: Component) -> None:
        """Register ``component`` (a strategy) in Lightning's registries, shadowing another manager's entry."""
        for namespace, registry in strategy_registries():
            self._add_to(namespace, registry, component)
        self._components[component.name] = component
        self._mirrored.add(component.name)
        MIRRORED_BY_LPLUGINS[component.name] = MIRRORED_BY_LPLUGINS.get(component.name, 0) + 1

    def remove(self, name: str) -> None:
        """Remove ``name`` from Lightning's registries, restoring the entry it shadowed, if any."""
        if name not in self._mirrored:
            return
        for namespace, registry in _imported_registries():
            if namespace not in self._into:
                continue
            shadowed = self._shadowed.pop((namespace, name), None)
            if shadowed is not None:
                registry[name] = shadowed
            else:
                registry.pop(name, None)
        self._components.pop(name, None)
        self._mirrored.discard(name)
        count = MIRRORED_BY_LPLUGINS.get(name, 0) - 1
        if count > 0:
            MIRRORED_BY_LPLUGINS[name] = count
        else:
            MIRRORED_BY_LPLUGINS.pop(name, None)


def mirror_into_all(namespace: str, registry: Any) -> None:
    """Mirror every live manager's strategy names into ``registry`` (``namespace``'s, newly imported)."""
    for mirror in sorted(_LIVE, key=lambda m: m._order):  # a later manager shadows an earlier one
        mirror.mirror_into(namespace, registry)


def _mirror_into_new(module: Any) -> None:
    namespace = next(ns for ns, name in REGISTRY_MODULES.items() if name == module.__name__)
    mirror_into_all(namespace, module.StrategyRegistry)
