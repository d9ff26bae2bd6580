"""Named components: strategies, precision plugins, accumulation schedules, callbacks and cluster
environments, each with a description and the plugin that registered it.

The kinds come from :data:`lplugins.hookspecs.KINDS`. A :class:`Registrar` is the ``register``
callable a registering hook receives: it checks each call and stages a :class:`Component`; the
manager adds the staged components to the :class:`Registry` of their kind only once the whole
plugin has loaded.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from lplugins._errors import RegistrationError, UnknownNameError
from lplugins.hookspecs import KINDS, Kind

#: The kinds of component, by name (``"strategy"``, ``"precision"``...), from :data:`lplugins.hookspecs.KINDS`.
KIND_BY_NAME: Mapping[str, Kind] = MappingProxyType({kind.name: kind for kind in KINDS})

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def kind_named(name: str) -> Kind:
    """The :class:`~lplugins.hookspecs.Kind` called ``name``.

    Raises:
        UnknownNameError: no kind has that name; the message lists the kinds.
    """
    try:
        return KIND_BY_NAME[name]
    except (KeyError, TypeError):
        raise UnknownNameError("component kind", name, KIND_BY_NAME) from None


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
        """Build the component: ``factory(**defaults, **overrides)``.

        The parameters are checked against the factory's signature first (following ``**kwargs``
        where they are handed on, see :mod:`lplugins._plugins.params`).

        Raises:
            ParameterError: a parameter the factory does not take (the message suggests the close
                one and lists them), or a required one missing.
        """
        self.check(overrides)
        from lplugins._lightning import namespace as _namespace

        namespace = _namespace.current()
        factory = _namespace.factory_for(kind_named(self.kind).hook, self.name, self.factory, namespace)
        built = factory(**{**self.defaults, **overrides})
        return _namespace.check_built(built, kind=self.kind, name=self.name, plugin=self.plugin, namespace=namespace)

    def check(self, overrides: Mapping[str, Any]) -> None:
        """Check ``overrides`` (and the registered defaults) against the factory's parameters.

        Raises:
            ParameterError: see :meth:`create`.
        """
        from lplugins._plugins.params import check_call

        hidden = frozenset(KIND_BY_NAME[self.kind].injected)
        label = self.kind.replace("_", " ")
        check_call(label, self.name, self.factory, self.defaults, overrides, plugin=self.plugin, hidden=hidden)

    def injected(self, available: Mapping[str, Any]) -> dict[str, Any]:
        """The injected arguments of this kind (:attr:`Kind.injected`) that the factory declares.

        Args:
            available: The values ``compose()`` can inject, by argument name.

        Returns:
            The entries of ``available`` the factory has a parameter for.
        """
        try:
            params = inspect.signature(self.factory).parameters
        except (TypeError, ValueError):  # a builtin or C callable without a signature
            return {}
        return {arg: available[arg] for arg in KIND_BY_NAME[self.kind].injected if arg in params and arg in available}


def validate_name(kind: str, name: object) -> str:
    """Check a component name and return it.

    Raises:
        RegistrationError: the name is not a non-empty string of letters, digits, ``_``, ``.``, ``-``.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise RegistrationError(
            f"Invalid {kind} name {name!r}: a name is a non-empty string of letters, digits, '_', '.', '-'"
            " that starts with a letter or digit."
        )
    return name


class Registry:
    """The components of one kind, by name, in registration order."""

    def __init__(self, kind: str) -> None:
        self.kind = kind_named(kind).name
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


class Registrar:
    """The ``register`` callable (:class:`lplugins.hookspecs.Register`) handed to one registering hook.

    Each call is checked and appended to ``staged``; nothing reaches a :class:`Registry` here.

    Args:
        kind: The kind the hook registers.
        plugin: The name of the plugin whose hook is called.
        staged: The list the components are appended to (shared by all hooks of one plugin).
    """

    def __init__(self, kind: Kind, plugin: str, staged: list[Component]) -> None:
        self.kind = kind
        self.plugin = plugin
        self.staged = staged

    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        description: str = "",
        defaults: Mapping[str, Any] | None = None,
        **metadata: Any,
    ) -> None:
        """Stage one component; see :class:`lplugins.hookspecs.Register` for the arguments.

        Raises:
            RegistrationError: a bad name, factory, ``defaults`` or keyword, or a name given twice.
        """
        kind = self.kind.name
        validate_name(kind, name)
        if not callable(factory):
            raise RegistrationError(f"The factory for {kind} {name!r} must be callable, got {factory!r}.")
        unknown = set(metadata) - self.kind.keywords
        if unknown:
            allowed = sorted(self.kind.keywords) or ["(none)"]
            raise RegistrationError(
                f"register() for a {kind} got unexpected keyword(s) {sorted(unknown)}; "
                f"allowed extra keywords: {', '.join(allowed)}."
            )
        if defaults is not None and not isinstance(defaults, Mapping):
            raise RegistrationError(f"defaults for {kind} {name!r} must be a mapping, got {defaults!r}.")
        if any(c.kind == kind and c.name == name for c in self.staged):
            raise RegistrationError(f"{kind} {name!r} is registered twice by the same plugin.")
        self.staged.append(
            Component(
                kind=kind,
                name=name,
                factory=factory,
                description=str(description or ""),
                plugin=self.plugin,
                defaults=dict(defaults or {}),
                metadata=dict(metadata),
            )
        )
