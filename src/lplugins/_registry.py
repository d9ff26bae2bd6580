"""Named components: strategies, precision plugins, accumulation schedules, callbacks and cluster
environments, each with a description and the plugin that registered it."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from lplugins._errors import UnknownNameError

#: The kinds of component a plugin can register, with the extra keyword arguments each accepts.
KINDS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "strategy": frozenset(),
        "precision": frozenset({"strategies", "accelerators"}),
        "schedule": frozenset(),
        "callback": frozenset(),
        "cluster_environment": frozenset({"detect"}),
    }
)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class Component:
    """One registered, named component.

    Attributes:
        kind: ``"strategy"``, ``"precision"``, ``"schedule"``, ``"callback"`` or ``"cluster_environment"``.
        name: The name users pass, e.g. ``"deepspeed_stage_2_cpu"``.
        factory: A class or callable that builds the component.
        description: One line shown by ``lplugins list``.
        plugin: The name of the plugin that registered it.
        defaults: Keyword arguments passed to ``factory`` unless overridden.
        metadata: Kind-specific facts (for precision: ``strategies`` and ``accelerators`` it supports).
    """

    kind: str
    name: str
    factory: Callable[..., Any]
    description: str
    plugin: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def create(self, **overrides: Any) -> Any:
        """Build the component: ``factory(**defaults, **overrides)``."""
        return self.factory(**{**self.defaults, **overrides})


def validate_name(kind: str, name: object) -> str:
    """Check a component name and return it."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"Invalid {kind} name {name!r}: a name is a non-empty string of letters, digits, '_', '.', '-'"
            " that starts with a letter or digit."
        )
    return name


class Registry:
    """The components of one kind, by name, in registration order."""

    def __init__(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"Unknown component kind {kind!r}. Allowed kinds: {', '.join(KINDS)}.")
        self.kind = kind
        self._items: dict[str, Component] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def components(self) -> list[Component]:
        """Registered components, in registration order."""
        return list(self._items.values())

    def get(self, name: str) -> Component:
        """Return the component called ``name``.

        Raises:
            UnknownNameError: no component has that name; the message lists those that exist
                and the closest match.
        """
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise UnknownNameError(self.kind, name, self._items) from None

    def _add(self, component: Component) -> None:
        self._items[component.name] = component

    def _remove(self, name: str) -> None:
        self._items.pop(name, None)
