"""Lightning's two namespaces: ``lightning.pytorch`` and the standalone ``pytorch_lightning``.

The two are separate class hierarchies (``lightning.pytorch`` + ``lightning.fabric``,
``pytorch_lightning`` + ``lightning_fabric``): a Trainer of one refuses strategies and plugins of
the other. lplugins writes its Lightning-facing modules once, for ``lightning.pytorch``, and
materialises a *twin* of each for ``pytorch_lightning`` on demand, the way Lightning builds
``pytorch_lightning`` from ``lightning.pytorch``: ``lplugins._pl.X`` is the source of ``lplugins.X``
with ``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` -> ``lightning_fabric`` and
its imports of other twinned lplugins modules pointed at their twins. The machinery (manager,
registry, hookspecs, errors, ``_log``, ``_watchdog``, ``rankzero``) is not twinned: one plugin
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
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Sequence
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
#: lplugins modules and packages that face Lightning, and are therefore twinned.
TWINNED = (
    "_compose",
    "_pairs",
    "_lightning",
    "_factory",
    "_builtins",
    "callbacks",
    "accumulation",
    "precision",
    "strategies",
    "metrics",
    "lightning_cli",
)

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
    """Import ``module_name`` (an ``lplugins`` module) as written for ``namespace``."""
    return importlib.import_module(twin_name(module_name, namespace))


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


# --- the twins: lplugins.X rewritten for pytorch_lightning ----------------------------------------

_TWINNED_RE = "|".join(re.escape(m) for m in TWINNED)
_DOTTED = re.compile(rf"(?<![-\w.])lplugins\.({_TWINNED_RE})\b")  # not a CLI flag (--lplugins.precision)
_FROM_LPLUGINS = re.compile(r"^(\s*)from lplugins import ([\w, ]+)$", re.MULTILINE)


def rewrite(source: str, namespace: str = PYTORCH_LIGHTNING) -> str:
    """``source`` (an lplugins module written for ``lightning.pytorch``) rewritten for ``namespace``."""
    trainer_pkg, fabric_pkg = NAMESPACES[namespace]
    source = re.sub(r"\blightning\.pytorch\b", trainer_pkg, source)
    source = re.sub(r"\blightning\.fabric\b", fabric_pkg, source)
    if namespace != LIGHTNING:  # the bare package (``lightning.__version__``) imports lightning.pytorch
        source = re.sub(r"^(\s*)import lightning$", rf"\1import {trainer_pkg} as lightning", source, flags=re.M)
        source = re.sub(r"^(\s*)from lightning import ", rf"\1from {trainer_pkg} import ", source, flags=re.M)
    source = _DOTTED.sub(lambda m: f"{TWIN_PACKAGE}.{m.group(1)}", source)

    def from_import(match: re.Match[str]) -> str:
        names = [n.strip() for n in match.group(2).split(",") if n.strip()]
        twinned = [n for n in names if n in TWINNED]
        if not twinned:
            return match.group(0)
        shared = [n for n in names if n not in TWINNED]
        indent = match.group(1)
        line = f"{indent}from {TWIN_PACKAGE} import {', '.join(twinned)}"
        if shared:  # on the same line: tracebacks keep the original line numbers
            line += f"; from lplugins import {', '.join(shared)}"
        return line

    return _FROM_LPLUGINS.sub(from_import, source)


_IMPORTS = re.compile(r"^\s*from (\.+\w*|lplugins(?:\.[\w.]+)?) import ([\w, ()]+)", re.MULTILINE)
_FACES: dict[str, bool] = {}


def faces_lightning(base: str) -> bool:
    """Whether module ``lplugins.X`` names ``lightning`` or imports an lplugins module that does.

    Modules that do not (pure-Python parts: schedules, retention, storage...) are shared by both
    namespaces instead of twinned, so their classes stay one class (``isinstance`` works across).
    """
    if base in _FACES:
        return _FACES[base]
    _FACES[base] = False  # an import cycle does not make a module face Lightning
    spec = source_spec(base)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return False
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    result = "lightning" in source
    package = base if spec.submodule_search_locations is not None else base.rpartition(".")[0]
    for match in _IMPORTS.finditer(source):
        if result:
            break
        origin, names = match.group(1), [n.strip(" ()") for n in match.group(2).split(",")]
        if origin.startswith("."):
            dots = len(origin) - len(origin.lstrip("."))
            parent = package.rsplit(".", dots - 1)[0] if dots > 1 else package
            target = f"{parent}.{origin.lstrip('.')}" if origin.lstrip(".") else parent
        else:
            target = origin
        candidates = [target] + [f"{target}.{n}" for n in names if n]
        for candidate in candidates:
            parts = candidate.split(".")
            if len(parts) > 1 and parts[1] in TWINNED and candidate != base and _exists(candidate):
                if faces_lightning(candidate):
                    result = True
                    break
    _FACES[base] = result
    return result


def _exists(module_name: str) -> bool:
    return source_spec(module_name) is not None


def source_spec(module_name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of an lplugins module, found without importing its parent packages.

    ``importlib.util.find_spec("lplugins.callbacks._errors")`` would import ``lplugins.callbacks``,
    which imports ``lightning.pytorch``: a ``pytorch_lightning`` process must not.
    """
    module = sys.modules.get(module_name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        return module.__spec__
    parts = module_name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for i in range(1, len(parts)):
            locations = spec.submodule_search_locations if spec is not None else None
            if not locations:
                return None
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), list(locations))
    except (ImportError, AttributeError, ValueError):
        return None
    return spec


def load_shared(base: str) -> ModuleType:
    """Import ``base``, an lplugins module that does not face Lightning, without running its parent
    package's ``__init__`` when that is not imported yet (a twinned package's ``__init__`` imports
    its namespace: ``lightning.pytorch`` in a ``pytorch_lightning`` process).

    The parent's place in ``sys.modules`` is taken by a :class:`_StandIn` with the package's spec
    and ``__path__``: its submodules import as usual, and the real package is imported (and
    replaces it) when any other attribute of it is asked for.
    """
    if base in sys.modules:
        return sys.modules[base]
    parent = base.rpartition(".")[0]
    if "." in parent and parent not in sys.modules:
        spec = source_spec(parent)
        if spec is not None and spec.submodule_search_locations:
            standin = importlib.util.module_from_spec(spec)
            standin.__class__ = _StandIn
            sys.modules[parent] = standin
            if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
                sys.meta_path.insert(0, _StandInFinder())
            grandparent, _, child = parent.rpartition(".")
            setattr(sys.modules[grandparent], child, standin)
    return importlib.import_module(base)


class _StandIn(ModuleType):
    """An lplugins package imported in name only (see :func:`load_shared`)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_realise(self), name)


class _ExistingLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return sys.modules[spec.name]

    def exec_module(self, module: ModuleType) -> None:
        return None


class _StandInFinder(importlib.abc.MetaPathFinder):
    """A submodule of a :class:`_StandIn` that faces Lightning needs the real package first."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        parent = fullname.rpartition(".")[0]
        standin = sys.modules.get(parent)
        if not isinstance(standin, _StandIn) or not faces_lightning(fullname):
            return None
        _realise(standin)  # the real __init__ may import fullname itself
        if fullname in sys.modules:
            return importlib.machinery.ModuleSpec(fullname, _ExistingLoader())
        return None


def _realise(standin: ModuleType) -> ModuleType:
    """Import the package ``standin`` stands in for, keeping the submodules imported under it."""
    name = standin.__name__
    if sys.modules.get(name) is standin:
        del sys.modules[name]
    package = importlib.import_module(name)
    for attr, value in vars(standin).items():
        if isinstance(value, ModuleType) and value.__name__ == f"{name}.{attr}" and attr not in vars(package):
            setattr(package, attr, value)
    return package


class _SharedLoader(importlib.abc.Loader):
    """Gives the twin name the original module (one that does not face Lightning)."""

    def __init__(self, base: str) -> None:
        self.base = base

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return load_shared(self.base)

    def exec_module(self, module: ModuleType) -> None:
        return None


class _TwinLoader(importlib.abc.Loader):
    def __init__(self, origin: str) -> None:
        self.origin = origin

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        with open(self.origin, encoding="utf-8") as f:
            source = rewrite(f.read())
        exec(compile(source, self.origin, "exec", dont_inherit=True), module.__dict__)


class TwinFinder(importlib.abc.MetaPathFinder):
    """Finds ``lplugins._pl.X``: the source of ``lplugins.X``, rewritten for ``pytorch_lightning``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(TWIN_PACKAGE + "."):
            return None
        base = "lplugins." + fullname[len(TWIN_PACKAGE) + 1 :]
        if base.split(".")[1] not in TWINNED:
            return None
        original = source_spec(base)
        if original is None or original.origin is None:
            return None
        is_package = original.submodule_search_locations is not None
        if not is_package and not faces_lightning(base):
            return importlib.machinery.ModuleSpec(fullname, _SharedLoader(base), origin=original.origin)
        spec = importlib.machinery.ModuleSpec(
            fullname, _TwinLoader(original.origin), origin=original.origin, is_package=is_package
        )
        spec.has_location = True
        return spec


def install() -> None:
    """Put the twin finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, TwinFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TwinFinder())


# --- running code when a module is first imported ------------------------------------------------

_WATCHED: dict[str, list[Callable[[ModuleType], None]]] = {}


class _WatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for callback in _WATCHED.pop(module.__name__, []):
            callback(module)


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a watched module is imported (and costs a dict lookup per import)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _ImportWatcher):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None and spec.loader is not None:
                spec.loader = _WatchingLoader(spec.loader)
                return spec
        return None


def on_import(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` when ``module_name`` is imported (at once when it already is)."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    callbacks = _WATCHED.setdefault(module_name, [])
    if callback not in callbacks:
        callbacks.append(callback)
    if not any(isinstance(f, _ImportWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportWatcher())
