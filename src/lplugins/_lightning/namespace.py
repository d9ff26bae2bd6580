"""Lightning's two namespaces: ``lightning.pytorch`` and the standalone ``pytorch_lightning``.

The two are separate class hierarchies (``lightning.pytorch`` + ``lightning.fabric``,
``pytorch_lightning`` + ``lightning_fabric``): a Trainer of one refuses strategies and plugins of
the other. lplugins writes its Lightning-facing modules once, for ``lightning.pytorch``; their
``pytorch_lightning`` twins ``lplugins._pl.X`` are generated from the same source at build time
(``scripts/mirror_pl.py``, committed; a test regenerates and compares). Modules that do not face
Lightning (the plugin system, the watchdog, schedules, storage, errors) have no twin: one plugin
manager, one registry and one ``LPluginsError`` serve both.

A registered component is built for the namespace :func:`current` names (set by ``compose``,
``attach`` and the strategy-registry mirror through :func:`using`): a built-in's factory is taken
from the twin of its ``_builtins`` module; a third-party factory is called as it is and what it
returns is checked (:func:`check_built`).

This module imports neither namespace (nor torch).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

LIGHTNING = "lightning"
PYTORCH_LIGHTNING = "pytorch_lightning"
#: namespace -> (its Trainer package, its Fabric package)
NAMESPACES: dict[str, tuple[str, str]] = {
    LIGHTNING: ("lightning.pytorch", "lightning.fabric"),
    PYTORCH_LIGHTNING: ("pytorch_lightning", "lightning_fabric"),
}
#: The package the ``pytorch_lightning`` twins live under.
TWIN_PACKAGE = "lplugins._pl"

_current: contextvars.ContextVar[str] = contextvars.ContextVar("lplugins_namespace", default=LIGHTNING)


def current() -> str:
    """The namespace components are being built for: ``"lightning"`` or ``"pytorch_lightning"``."""
    return _current.get()


@contextlib.contextmanager
def using(namespace: str) -> Iterator[None]:
    """Build components for ``namespace`` inside the block."""
    token = _current.set(namespace)
    try:
        yield
    finally:
        _current.reset(token)


def of_module(module_name: str) -> str:
    """The namespace an lplugins module (``lplugins.X`` or its twin ``lplugins._pl.X``) was written for."""
    return PYTORCH_LIGHTNING if module_name.startswith(TWIN_PACKAGE + ".") else LIGHTNING


def of_object(obj: Any) -> str | None:
    """The namespace ``obj`` (an instance or a class) belongs to, from its classes; ``None``: neither."""
    cls = obj if isinstance(obj, type) else type(obj)
    for klass in cls.__mro__:
        module = klass.__module__ or ""
        for namespace, packages in NAMESPACES.items():
            if any(module == p or module.startswith(p + ".") for p in packages):
                return namespace
    return None


def detect(values: Any) -> str | None:
    """The namespace of the first Lightning object among ``values`` (a mapping's values, lists
    searched too); ``None``: none is."""
    items = list(values.values()) if hasattr(values, "values") else list(values)
    while items:
        item = items.pop(0)
        if isinstance(item, (list, tuple)):
            items.extend(item)
        elif not isinstance(item, (str, int, float, dict)) and item is not None:
            found = of_object(item)
            if found is not None:
                return found
    return None


def choose(namespace: str | None, values: Any) -> tuple[str, str | None]:
    """The namespace for ``compose`` (given, else from ``values``, else imported) and, when lplugins
    chose ``pytorch_lightning`` itself, why (for the announcement)."""
    if namespace is not None:
        return check_namespace(namespace), None
    found = detect(values)
    if found is not None:
        return found, f"a {NAMESPACES[found][0]} object was passed" if found == PYTORCH_LIGHTNING else None
    chosen = check_namespace(None)
    return chosen, "pytorch_lightning is imported and lightning.pytorch is not" if chosen == PYTORCH_LIGHTNING else None


def check_namespace(namespace: str | None) -> str:
    """``namespace`` checked (``None``: the one already imported, ``lightning`` when both or neither are).

    Raises:
        ValueError: an unknown namespace.
    """
    if namespace is None:
        if PYTORCH_LIGHTNING in sys.modules and "lightning.pytorch" not in sys.modules:
            return PYTORCH_LIGHTNING
        return LIGHTNING
    if namespace not in NAMESPACES:
        from lplugins._errors import CompositionError

        raise CompositionError(
            f"namespace={namespace!r} is not a Lightning namespace; use one of {sorted(NAMESPACES)} "
            "('lightning' for lightning.pytorch.Trainer, 'pytorch_lightning' for pytorch_lightning.Trainer)"
        )
    return namespace


def twin_name(module_name: str, namespace: str) -> str:
    """The name of ``module_name`` (an ``lplugins`` module) written for ``namespace``."""
    base = module_name[len(TWIN_PACKAGE) + 1 :] if module_name.startswith(TWIN_PACKAGE + ".") else module_name[9:]
    if namespace == LIGHTNING:
        return f"lplugins.{base}"
    return f"{TWIN_PACKAGE}.{base}"


def module_for(module_name: str, namespace: str) -> ModuleType:
    """Import ``module_name`` (an ``lplugins`` module) as written for ``namespace``: its twin, or the
    module itself when it has none (it does not face Lightning and serves both)."""
    name = twin_name(module_name, namespace)
    if name != module_name and not has_twin(module_name):
        name = twin_name(module_name, LIGHTNING)
    return importlib.import_module(name)


def has_twin(module_name: str) -> bool:
    """Whether ``module_name`` (``lplugins.X``) has a ``pytorch_lightning`` twin (it faces Lightning)."""
    name = twin_name(module_name, PYTORCH_LIGHTNING)
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a package above it has no twin either
        return False


def lightning_class(namespace: str, module: str, name: str) -> Any:
    """``<namespace's trainer package>.<module>.<name>``, e.g. ``pytorch_lightning.callbacks.Callback``."""
    return getattr(importlib.import_module(f"{NAMESPACES[namespace][0]}.{module}"), name)


def function_for(function: Callable[..., Any], namespace: str | None = None) -> Callable[..., Any]:
    """A built-in plugin's hook implementation as written for ``namespace``; any other unchanged."""
    namespace = namespace or current()
    module = getattr(function, "__module__", "") or ""
    if namespace == LIGHTNING or not module.startswith("lplugins._builtins."):
        return function
    return getattr(module_for(module, namespace), function.__name__, function)


def other_namespace_hint(obj: Any, namespace: str) -> str:
    """``""``, or a sentence saying ``obj`` belongs to the other Lightning namespace."""
    found = of_object(obj)
    if found is None or found == namespace:
        return ""
    return (
        f" (it is a {NAMESPACES[found][0]} object and the Trainer a {NAMESPACES[namespace][0]}.Trainer: "
        "build it for the namespace lplugins.current_namespace() names to serve both)"
    )


# --- building a registered component for a namespace ---------------------------------------------

_TWIN_FACTORIES: dict[tuple[str, str, str], Callable[..., Any]] = {}


def factory_for(hook: str, name: str, factory: Callable[..., Any], namespace: str | None = None) -> Callable[..., Any]:
    """The factory that builds component ``name`` for ``namespace`` (default: :func:`current`).

    A built-in's factory comes from the twin of its ``_builtins`` module: its registering ``hook``
    (e.g. ``lplugins_register_strategies``) is called there and the factory registered under
    ``name`` taken. Any other factory is returned unchanged (see :func:`check_built`).
    """
    namespace = namespace or current()
    module = getattr(factory, "__module__", "") or ""
    if namespace == LIGHTNING or not module.startswith("lplugins._builtins."):
        return factory
    key = (namespace, hook, name)
    if key not in _TWIN_FACTORIES:
        twin = module_for(module, namespace)
        registering = getattr(twin, hook, None)
        if registering is not None:

            def register(reg_name: str, reg_factory: Callable[..., Any], *_: Any, **__: Any) -> None:
                _TWIN_FACTORIES[(namespace, hook, reg_name)] = reg_factory

            registering(register)
    return _TWIN_FACTORIES.get(key, factory)


def served_by(factory: Callable[..., Any]) -> tuple[str, ...] | None:
    """The namespaces a registered factory builds for (``lplugins list``); ``None``: known when built.

    A built-in serves both; a class serves the namespace of its Lightning bases; a function may build
    for either (by :func:`current`): its result is checked when it is built.
    """
    if (getattr(factory, "__module__", "") or "").startswith("lplugins._builtins."):
        return tuple(NAMESPACES)
    if isinstance(factory, type):
        found = of_object(factory)
        return None if found is None else (found,)
    return None


def check_built(obj: Any, *, kind: str, name: str, plugin: str, namespace: str | None = None) -> Any:
    """``obj`` if it fits a Trainer of ``namespace``; a clear error if it belongs to the other one.

    Raises:
        CompositionError: ``obj`` subclasses the other namespace's Lightning classes.
    """
    namespace = namespace or current()
    found = of_object(obj)
    if found is None or found == namespace:
        return obj
    from lplugins._errors import CompositionError

    theirs, ours = NAMESPACES[found][0], NAMESPACES[namespace][0]
    raise CompositionError(
        f"{kind} {name!r} (plugin {plugin!r}) built a {type(obj).__module__}.{type(obj).__qualname__}, "
        f"a {theirs} class, but the Trainer is a {ours}.Trainer: the two namespaces are separate class "
        f"hierarchies. The plugin must build its {kind} for the namespace lplugins.current_namespace() "
        f"names ('lightning' -> {NAMESPACES[LIGHTNING][0]}, 'pytorch_lightning' -> "
        f"{NAMESPACES[PYTORCH_LIGHTNING][0]}) to serve both (see docs/hooks.md, 'Both namespaces')."
    )
