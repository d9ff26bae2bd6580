"""The mirror of lplugins' strategy names into Lightning's ``StrategyRegistry``.

Mirroring is what makes ``lightning.pytorch.Trainer(strategy="deepspeed_stage_2_cpu")`` and
``LightningCLI --trainer.strategy ...`` work once plugins are loaded. Each manager owns a
:class:`StrategyMirror`; closing the manager removes its names again. Several managers may live in
one process (a test's fresh manager beside the process-wide one): a later one shadows an earlier
one's entry and restores it when it closes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lplugins._registry import Component

#: Strategy names that some lplugins manager in this process mirrored into Lightning's registry,
#: with how many managers currently hold each (a test's fresh manager may shadow the default one's).
MIRRORED_BY_LPLUGINS: dict[str, int] = {}


def lightning_strategy_registry() -> Any:
    """Lightning's ``StrategyRegistry`` (imported on first use: loading plugins imports no strategy)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return StrategyRegistry


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
        self._mirrored.discard(name)
        count = MIRRORED_BY_LPLUGINS.get(name, 0) - 1
        if count > 0:
            MIRRORED_BY_LPLUGINS[name] = count
        else:
            MIRRORED_BY_LPLUGINS.pop(name, None)
