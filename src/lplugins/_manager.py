"""Plugin discovery and registration.

Built-in plugins and entry-point plugins go through one path: :meth:`PluginManager.register`,
which validates the plugin's hooks, calls its registering hooks into a staging area, checks every
name against what is already registered (and against Lightning's ``StrategyRegistry``), and only
then commits. A plugin that fails at any step leaves nothing behind.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from lplugins import hookspecs
from lplugins._errors import LPluginsError, PluginError, closest
from lplugins._registry import KINDS, Component, Registry, validate_name

#: The entry-point group that third-party plugins are published under.
ENTRY_POINT_GROUP = "lplugins"

#: Built-in plugins, in load order: ``(name, module)``. They are registered through the same
#: path as entry-point plugins, so each can be listed and blocked by name.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("core", "lplugins._builtins.core"),
    ("strategies", "lplugins._builtins.strategies"),
    ("precision", "lplugins._builtins.precision"),
    ("accumulation", "lplugins._builtins.accumulation"),
    ("checkpoint", "lplugins._builtins.checkpoint"),
    ("logging", "lplugins._builtins.logging"),
)

#: Built-ins that cannot be blocked: without them, Lightning's own names would not resolve.
ESSENTIAL_PLUGINS: frozenset[str] = frozenset({"core"})

_REGISTER_HOOKS: Mapping[str, str] = {
    "lplugins_register_strategies": "strategy",
    "lplugins_register_precisions": "precision",
    "lplugins_register_schedules": "schedule",
    "lplugins_register_callbacks": "callback",
    "lplugins_register_cluster_environments": "cluster_environment",
}

_HOOK_PREFIX = "lplugins_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_flag(name: str, default: bool = False) -> bool:
    """Read a boolean environment variable (``1/true/yes/on`` or ``0/false/no/off``).

    Raises:
        LPluginsError: the value is neither.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise LPluginsError(f"{name}={raw!r} is not a boolean; use one of 1, true, yes, on, 0, false, no, off.")


def env_list(name: str) -> list[str] | None:
    """Read a comma-separated environment variable; ``None`` when unset."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    return [item.strip() for item in raw.split(",") if item.strip()]


@dataclass
class PluginInfo:
    """What lplugins knows about one plugin.

    Attributes:
        name: The plugin's name: the entry-point name, or the built-in's name.
        distribution: The distribution that provides it (``"lplugins"`` for built-ins).
        version: The distribution's version.
        entry_point: ``"name = value"`` of the entry point, ``None`` for built-ins and in-process plugins.
        builtin: Whether lplugins ships it.
        status: ``"loaded"``, ``"blocked"`` or ``"failed"``.
        registered: The names it registered, by kind.
        error: Why it failed, when it failed.
    """

    name: str
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None
    builtin: bool = False
    status: str = "loaded"
    registered: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None
    contributes_callbacks: bool = False

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (used by ``lplugins list --json``)."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
            "builtin": self.builtin,
            "status": self.status,
            "registered": {k: list(v) for k, v in self.registered.items() if v},
            "contributes_callbacks": self.contributes_callbacks,
            "error": self.error,
        }


class _PluggyManager(pluggy.PluginManager):
    """pluggy's manager that, like pytest's, takes ``lplugins_*`` functions without a marker."""

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(_HOOK_PREFIX):
            method = getattr(plugin, name, None)
            if callable(method) and not isinstance(method, type):
                return {
                    "wrapper": False,
                    "hookwrapper": False,
                    "optionalhook": False,
                    "tryfirst": False,
                    "trylast": False,
                    "specname": None,
                }
        return opts


class _Registrar:
    """The ``register`` callable handed to a registering hook; collects into a staging list."""

    def __init__(self, kind: str, plugin: str, staged: list[Component]) -> None:
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
        validate_name(self.kind, name)
        if not callable(factory):
            raise TypeError(f"The factory for {self.kind} {name!r} must be callable, got {factory!r}.")
        unknown = set(metadata) - KINDS[self.kind]
        if unknown:
            allowed = sorted(KINDS[self.kind]) or ["(none)"]
            raise TypeError(
                f"register() for a {self.kind} got unexpected keyword(s) {sorted(unknown)}; "
                f"allowed extra keywords: {', '.join(allowed)}."
            )
        if defaults is not None and not isinstance(defaults, Mapping):
            raise TypeError(f"defaults for {self.kind} {name!r} must be a mapping, got {defaults!r}.")
        if any(c.name == name for c in self.staged):
            raise ValueError(f"{self.kind} {name!r} is registered twice by the same plugin.")
        self.staged.append(
            Component(
                kind=self.kind,
                name=name,
                factory=factory,
                description=str(description or ""),
                plugin=self.plugin,
                defaults=dict(defaults or {}),
                metadata=dict(metadata),
            )
        )


#: Strategy names that some lplugins manager in this process mirrored into Lightning's registry,
#: with how many managers currently hold each (a test's fresh manager may shadow the default one's).
_MIRRORED_BY_LPLUGINS: dict[str, int] = {}


def _lightning_strategy_registry() -> Any:
    from lightning.pytorch.strategies import StrategyRegistry

    return StrategyRegistry


class PluginManager:
    """Discovers, registers and lists lplugins plugins and the components they register.

    Most code uses the process-wide manager returned by :func:`lplugins.load`; tests and tools make
    their own (and :meth:`close` it, which removes everything it registered, including from
    Lightning's ``StrategyRegistry``).

    Args:
        strict: Raise :class:`~lplugins.PluginError` when a plugin fails (the default). When false,
            a failing plugin is reported with a warning, listed as failed, and the rest carry on.
            ``None`` reads ``LPLUGINS_STRICT`` (default true).
        mirror_lightning: Mirror registered strategies into Lightning's ``StrategyRegistry``.
    """

    def __init__(self, *, strict: bool | None = None, mirror_lightning: bool = True) -> None:
        self.strict = env_flag("LPLUGINS_STRICT", True) if strict is None else strict
        self.mirror_lightning = mirror_lightning
        self._pm = _PluggyManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._registries = {kind: Registry(kind) for kind in KINDS}
        self._plugins: dict[str, PluginInfo] = {}
        self._objects: dict[str, object] = {}
        self._mirrored: set[str] = set()
        self._shadowed: dict[str, Any] = {}
        self.loaded = False

    # ------------------------------------------------------------------ queries
    @property
    def hook(self) -> pluggy.HookRelay:
        """pluggy's hook relay (``manager.hook.lplugins_choose_precision(...)``)."""
        return self._pm.hook

    def registry(self, kind: str) -> Registry:
        """The registry of one kind of component (``"strategy"``, ``"precision"``, ...)."""
        try:
            return self._registries[kind]
        except KeyError:
            raise ValueError(f"Unknown component kind {kind!r}. Allowed kinds: {', '.join(KINDS)}.") from None

    def get(self, kind: str, name: str) -> Component:
        """Return the registered component ``name`` of ``kind``.

        Raises:
            UnknownNameError: no such name; the message lists the names and the closest match.
        """
        return self.registry(kind).get(name)

    def plugins(self) -> list[PluginInfo]:
        """Every plugin seen: loaded, blocked and failed, in load order."""
        return list(self._plugins.values())

    def plugin(self, name: str) -> PluginInfo:
        """The :class:`PluginInfo` of one plugin."""
        try:
            return self._plugins[name]
        except KeyError:
            raise LPluginsError(
                f"No plugin named {name!r}. Known plugins: {', '.join(self._plugins) or '(none)'}."
            ) from None

    def is_loaded(self, name: str) -> bool:
        """Whether a plugin of that name is registered."""
        info = self._plugins.get(name)
        return info is not None and info.status == "loaded"

    @property
    def failures(self) -> list[PluginInfo]:
        """Plugins that failed to load (only in lenient mode; strict mode raises)."""
        return [p for p in self._plugins.values() if p.status == "failed"]

    # ------------------------------------------------------------------ loading
    def load(
        self,
        *,
        autoload: bool | None = None,
        allow: Iterable[str] | None = None,
        disable: Iterable[str] | None = None,
    ) -> PluginManager:
        """Register the built-in plugins, then the entry-point plugins.

        Args:
            autoload: Load entry-point plugins. ``None`` reads ``LPLUGINS_DISABLE_AUTOLOAD``. With
                autoload off, an allow-list still loads the plugins it names (as pytest's ``-p``).
            allow: Only these entry-point plugins are loaded (by plugin or distribution name).
                ``None`` reads ``LPLUGINS_PLUGINS``. Built-ins are not affected.
            disable: Block these plugins, built-ins included (by plugin or distribution name).
                ``None`` reads ``LPLUGINS_DISABLE``.

        Returns:
            The manager itself.

        Raises:
            LPluginsError: an essential plugin is blocked, or an allowed name matches no plugin.
            PluginError: a plugin failed (strict mode).
        """
        if self.loaded:
            return self
        if autoload is None:
            autoload = not env_flag("LPLUGINS_DISABLE_AUTOLOAD")
        allow_list = list(allow) if allow is not None else env_list("LPLUGINS_PLUGINS")
        blocked = set(disable if disable is not None else env_list("LPLUGINS_DISABLE") or [])
        for name in sorted(blocked & ESSENTIAL_PLUGINS):
            raise LPluginsError(
                f"Plugin {name!r} is essential and cannot be blocked (essential plugins: "
                f"{', '.join(sorted(ESSENTIAL_PLUGINS))}). Remove it from LPLUGINS_DISABLE / disable=."
            )
        seen_names: set[str] = set()

        for name, module_name in BUILTIN_PLUGINS:
            seen_names.add(name)
            if name in blocked or ("lplugins" in blocked and name not in ESSENTIAL_PLUGINS):
                self._record_blocked(name, "lplugins", _own_version(), None, builtin=True)
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:  # a broken built-in is a bug, but still reported like any plugin
                self._fail(
                    PluginError(
                        f"cannot import {module_name}: {exc!r}", plugin=name, distribution="lplugins", stage="import"
                    ),
                    exc,
                    builtin=True,
                )
                continue
            self.register(module, name, distribution="lplugins", version=_own_version(), builtin=True)

        if autoload or allow_list:
            entry_points = _discover_entry_points()
            if allow_list is not None:
                available = {ep.name for ep, _, _ in entry_points} | {d for _, d, _ in entry_points if d}
                for wanted in allow_list:
                    if wanted not in available:
                        hint = closest(wanted, available)
                        raise LPluginsError(
                            f"LPLUGINS_PLUGINS / allow= names {wanted!r}, but no installed plugin has that name. "
                            f"Installed entry-point plugins: {', '.join(sorted(available)) or '(none)'}."
                            + (f" Did you mean {hint!r}?" if hint else "")
                        )
            for ep, dist_name, dist_version in entry_points:
                seen_names.add(ep.name)
                if dist_name is not None:
                    seen_names.add(dist_name)
                if allow_list is not None and ep.name not in allow_list and dist_name not in allow_list:
                    continue
                ep_text = f"{ep.name} = {ep.value}"
                if ep.name in blocked or dist_name in blocked:
                    self._record_blocked(ep.name, dist_name, dist_version, ep_text, builtin=False)
                    continue
                self._load_entry_point(ep, dist_name, dist_version, ep_text)

        for name in sorted(blocked - seen_names):
            warnings.warn(
                f"LPLUGINS_DISABLE / disable= names {name!r}, which matches no plugin; nothing was blocked for it.",
                stacklevel=2,
            )
        self.loaded = True
        return self

    def _load_entry_point(
        self, ep: importlib.metadata.EntryPoint, dist: str | None, version: str | None, ep_text: str
    ) -> None:
        if ep.name in self._plugins and self._plugins[ep.name].status == "loaded":
            other = self._plugins[ep.name]
            self._fail(
                PluginError(
                    f"another plugin of the same name is already registered (from {other.distribution}); "
                    f"block one of them with LPLUGINS_DISABLE",
                    plugin=ep.name,
                    distribution=dist,
                    version=version,
                    entry_point=ep_text,
                    stage="register",
                ),
                None,
            )
            return
        try:
            obj = ep.load()
        except Exception as exc:
            self._fail(
                PluginError(
                    f"error importing plugin: {type(exc).__name__}: {exc}",
                    plugin=ep.name,
                    distribution=dist,
                    version=version,
                    entry_point=ep_text,
                    stage="import",
                ),
                exc,
            )
            return
        self.register(obj, ep.name, distribution=dist, version=version, entry_point=ep_text)

    def register(
        self,
        plugin: object,
        name: str | None = None,
        *,
        distribution: str | None = None,
        version: str | None = None,
        entry_point: str | None = None,
        builtin: bool = False,
    ) -> PluginInfo:
        """Register one plugin object (a module, class or instance with ``lplugins_*`` hooks).

        The plugin's hooks are validated against the specifications, its registering hooks are
        called, and the names are committed only if all of that succeeds.

        Args:
            plugin: The plugin object.
            name: Its name; defaults to the module's or object's name.
            distribution: The distribution it came from, for messages and listing.
            version: That distribution's version.
            entry_point: The entry point text, for messages and listing.
            builtin: Whether lplugins ships it.

        Returns:
            The plugin's :class:`PluginInfo` (with ``status="failed"`` in lenient mode if it failed).

        Raises:
            PluginError: the plugin is invalid, a hook raised, or it registers a name that exists
                (strict mode).
        """
        if name is None:
            name = getattr(plugin, "__name__", None) or type(plugin).__name__
        info = PluginInfo(
            name=name, distribution=distribution, version=version, entry_point=entry_point, builtin=builtin
        )

        def error(message: str, stage: str) -> PluginError:
            return PluginError(
                message,
                plugin=name,
                distribution=distribution,
                version=version,
                entry_point=entry_point,
                stage=stage,
            )

        if name in self._plugins and self._plugins[name].status == "loaded":
            return self._fail(error("a plugin of that name is already registered", "register"), None, info=info)
        if self._pm.is_blocked(name):
            info.status = "blocked"
            self._plugins[name] = info
            return info
        try:
            self._pm.register(plugin, name)
        except pluggy.PluginValidationError as exc:
            return self._fail(error(f"invalid hook implementation: {exc}", "validate"), exc, info=info)
        except ValueError as exc:
            return self._fail(error(str(exc), "register"), exc, info=info)

        try:
            self._check_hook_names(plugin, name)
            staged = self._call_register_hooks(plugin, name)
            self._check_conflicts(staged, name)
        except _StageError as exc:
            self._pm.unregister(plugin, name)
            return self._fail(error(exc.message, exc.stage), exc.__cause__, info=info)

        for component in staged:
            self._commit(component)
            info.registered.setdefault(component.kind, []).append(component.name)
        info.contributes_callbacks = any(
            impl.plugin is plugin for impl in self._pm.hook.lplugins_trainer_callbacks.get_hookimpls()
        )
        self._plugins[name] = info
        self._objects[name] = plugin
        return info

    def unregister(self, name: str) -> None:
        """Remove a plugin and every name it registered (also from Lightning's ``StrategyRegistry``)."""
        info = self._plugins.pop(name, None)
        obj = self._objects.pop(name, None)
        if obj is not None and self._pm.is_registered(obj):
            self._pm.unregister(obj, name)
        if info is None:
            return
        for kind, names in info.registered.items():
            for component_name in names:
                self._registries[kind]._remove(component_name)
                if kind == "strategy" and component_name in self._mirrored:
                    self._unmirror(component_name)

    def close(self) -> None:
        """Unregister every plugin; the manager can then be loaded again."""
        for name in reversed(list(self._plugins)):
            self.unregister(name)
        self.loaded = False

    # ------------------------------------------------------------------ internals
    def _record_blocked(
        self, name: str, distribution: str | None, version: str | None, entry_point: str | None, *, builtin: bool
    ) -> None:
        self._pm.set_blocked(name)
        self._plugins[name] = PluginInfo(
            name=name,
            distribution=distribution,
            version=version,
            entry_point=entry_point,
            builtin=builtin,
            status="blocked",
        )

    def _fail(
        self, exc: PluginError, cause: BaseException | None, *, info: PluginInfo | None = None, builtin: bool = False
    ) -> PluginInfo:
        if self.strict:
            raise exc from cause
        if info is None:
            info = PluginInfo(
                name=exc.plugin,
                distribution=exc.distribution,
                version=exc.version,
                entry_point=exc.entry_point,
                builtin=builtin,
            )
        info.status = "failed"
        info.error = str(exc)
        info.registered = {}
        if exc.plugin not in self._plugins or self._plugins[exc.plugin].status != "loaded":
            self._plugins[exc.plugin] = info
        warnings.warn(f"{exc} (skipped; lenient mode)", PluginWarning, stacklevel=3)
        return info

    def _check_hook_names(self, plugin: object, name: str) -> None:
        for caller in self._pm.get_hookcallers(plugin) or []:
            if caller.spec is None:
                known = [n for n in dir(hookspecs) if n.startswith(_HOOK_PREFIX)]
                hint = closest(caller.name, known)
                raise _StageError(
                    f"unknown hook {caller.name!r}; lplugins hooks are: {', '.join(known)}"
                    + (f". Did you mean {hint!r}?" if hint else ""),
                    "validate",
                )

    def _call_register_hooks(self, plugin: object, name: str) -> list[Component]:
        staged: list[Component] = []
        for hook_name, kind in _REGISTER_HOOKS.items():
            caller = getattr(self._pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                registrar = _Registrar(kind, name, staged)
                kwargs = {arg: registrar for arg in impl.argnames}
                try:
                    impl.function(**kwargs)
                except Exception as exc:
                    raise _StageError(f"hook {hook_name} raised {type(exc).__name__}: {exc}", "hook") from exc
        return staged

    def _check_conflicts(self, staged: Sequence[Component], name: str) -> None:
        lightning_names: Iterable[str] = ()
        if self.mirror_lightning and any(c.kind == "strategy" for c in staged):
            lightning_names = _lightning_strategy_registry().keys()
        lightning_names = set(lightning_names)
        for component in staged:
            registry = self._registries[component.kind]
            if component.name in registry:
                other = registry.get(component.name).plugin
                raise _StageError(
                    f"{component.kind} {component.name!r} is already registered by plugin {other!r}; "
                    f"block one of the two plugins with LPLUGINS_DISABLE={other} or LPLUGINS_DISABLE={name}",
                    "register",
                )
            if component.kind == "strategy" and component.name in lightning_names - set(_MIRRORED_BY_LPLUGINS):
                raise _StageError(
                    f"strategy {component.name!r} is already in Lightning's StrategyRegistry "
                    f"(registered outside lplugins); choose another name",
                    "register",
                )

    def _commit(self, component: Component) -> None:
        self._registries[component.kind]._add(component)
        if component.kind == "strategy" and self.mirror_lightning:
            registry = _lightning_strategy_registry()
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
            _MIRRORED_BY_LPLUGINS[component.name] = _MIRRORED_BY_LPLUGINS.get(component.name, 0) + 1

    def _unmirror(self, name: str) -> None:
        registry = _lightning_strategy_registry()
        if name in self._shadowed:
            registry[name] = self._shadowed.pop(name)
        else:
            registry.pop(name, None)
        self._mirrored.discard(name)
        count = _MIRRORED_BY_LPLUGINS.get(name, 0) - 1
        if count > 0:
            _MIRRORED_BY_LPLUGINS[name] = count
        else:
            _MIRRORED_BY_LPLUGINS.pop(name, None)

    # ------------------------------------------------------------------ hooks with isolation
    def trainer_callbacks(self, trainer_kwargs: Mapping[str, Any]) -> list[Any]:
        """Call ``lplugins_trainer_callbacks`` on every plugin, in load order, one at a time.

        A plugin that raises or returns something that is not a callback is reported by name
        (raised in strict mode, warned and skipped in lenient mode); the others still contribute.
        """
        from lightning.pytorch.callbacks import Callback

        results: list[Any] = []
        for impl in self._pm.hook.lplugins_trainer_callbacks.get_hookimpls():
            info = self._plugins.get(impl.plugin_name)
            try:
                out: Any = impl.function(**{arg: trainer_kwargs for arg in impl.argnames})
                if out is None:
                    continue
                items = [out] if isinstance(out, Callback) else list(out)
                bad = [cb for cb in items if not isinstance(cb, Callback)]
                if bad:
                    raise TypeError(f"returned {bad[0]!r}, which is not a lightning.pytorch.Callback")
            except Exception as exc:
                error = PluginError(
                    f"hook lplugins_trainer_callbacks failed: {type(exc).__name__}: {exc}",
                    plugin=impl.plugin_name,
                    distribution=info.distribution if info else None,
                    version=info.version if info else None,
                    entry_point=info.entry_point if info else None,
                    stage="hook",
                )
                if self.strict:
                    raise error from exc
                warnings.warn(f"{error} (skipped; lenient mode)", PluginWarning, stacklevel=2)
                continue
            results.extend(items)
        return results


class PluginWarning(UserWarning):
    """A plugin failed in lenient mode and was skipped."""


class _StageError(Exception):
    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.message = message
        self.stage = stage


def _discover_entry_points() -> list[tuple[importlib.metadata.EntryPoint, str | None, str | None]]:
    """Entry points of the ``lplugins`` group with their distribution's name and version, one per
    (name, distribution), in a stable order."""
    found: dict[tuple[str, str], tuple[importlib.metadata.EntryPoint, str | None, str | None]] = {}
    for dist in importlib.metadata.distributions():
        eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        if not eps:
            continue  # parse METADATA only for distributions that have lplugins entry points
        meta = dist.metadata  # parsed once: each access re-reads the file
        dist_name = meta["Name"] if meta else None
        dist_version = meta["Version"] if meta else None
        for ep in eps:
            key = (ep.name, _normalize(dist_name or ""))
            found.setdefault(key, (ep, dist_name, dist_version))
    return [found[key] for key in sorted(found)]


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


_VERSION: str | None = None


def _own_version() -> str | None:
    global _VERSION
    if _VERSION is None:
        try:
            _VERSION = importlib.metadata.version("lplugins")
        except importlib.metadata.PackageNotFoundError:
            _VERSION = "unknown"
    return _VERSION


# ---------------------------------------------------------------------- the process-wide manager
_default: PluginManager | None = None


def load(
    *,
    autoload: bool | None = None,
    allow: Iterable[str] | None = None,
    disable: Iterable[str] | None = None,
    strict: bool | None = None,
    reload: bool = False,
) -> PluginManager:
    """Load lplugins' plugins into the process-wide manager and return it.

    The first call discovers and registers everything (built-ins, then entry points); later calls
    return the same manager unless ``reload=True``. After this, every registered strategy name
    also works in a plain ``lightning.pytorch.Trainer(strategy=...)`` and in ``LightningCLI``.

    Args:
        autoload: Load entry-point plugins (default: unless ``LPLUGINS_DISABLE_AUTOLOAD=1``).
        allow: Only load these entry-point plugins (default: ``LPLUGINS_PLUGINS``).
        disable: Block these plugins (default: ``LPLUGINS_DISABLE``).
        strict: Raise on a failing plugin (default: ``LPLUGINS_STRICT``, true).
        reload: Discard the current manager (unregistering its names) and load again.

    Returns:
        The process-wide :class:`PluginManager`.

    Raises:
        PluginError: a plugin failed to load (strict mode).
        LPluginsError: the controls are invalid (an essential plugin blocked, an unknown allowed name).
    """
    global _default
    if _default is not None and _default.loaded and not reload:
        return _default
    if _default is not None:
        _default.close()
    manager = PluginManager(strict=strict)
    try:
        manager.load(autoload=autoload, allow=allow, disable=disable)
    except BaseException:
        manager.close()
        raise
    _default = manager
    return manager


def get_manager() -> PluginManager:
    """The process-wide manager, loading it first if needed."""
    return load()


def set_manager(manager: PluginManager | None) -> PluginManager | None:
    """Replace the process-wide manager (used by ``lplugins.testing``); returns the previous one."""
    global _default
    previous, _default = _default, manager
    return previous
