"""The plugin manager: registering plugins, all or nothing, and the process-wide manager.

Built-in plugins and entry-point plugins go through one path: :meth:`PluginManager.register`,
which validates the plugin's hooks, calls its registering hooks into a staging list, checks every
name against what is already registered (and against Lightning's ``StrategyRegistry``), and only
then commits. A plugin that fails at any step leaves nothing behind.

Around it: :mod:`lplugins._env` reads the ``LPLUGINS_*`` controls, :mod:`lplugins._plugins.discovery`
finds the plugins, :mod:`lplugins._plugins.mirror` keeps Lightning's ``StrategyRegistry`` in step, and
:mod:`lplugins.hookspecs` says which hooks register which kind.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pluggy

from lplugins import hookspecs
from lplugins._env import DISABLE, STRICT, Controls, env_flag
from lplugins._errors import BlockedNameError, LPluginsError, PluginError, UnknownNameError
from lplugins._log import announce
from lplugins._plugins.discovery import (
    BUILTIN_PLUGINS,
    ESSENTIAL_PLUGINS,
    Candidate,
    PluginInfo,
    candidates,
    check_blockable,
)
from lplugins._plugins.hooks import HookManager, StageError
from lplugins._plugins.mirror import MIRRORED_BY_LPLUGINS, StrategyMirror, foreign_strategy_names
from lplugins._plugins.registry import Component, Registrar, Registry, kind_named

__all__ = [
    "BUILTIN_PLUGINS",
    "ESSENTIAL_PLUGINS",
    "PluginInfo",
    "PluginManager",
    "PluginWarning",
    "get_manager",
    "load",
    "set_manager",
]

#: Kept under its old name for tests that look at the mirror's bookkeeping.
_MIRRORED_BY_LPLUGINS = MIRRORED_BY_LPLUGINS


class PluginWarning(UserWarning):
    """A plugin failed in lenient mode and was skipped."""


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
        self.strict = env_flag(STRICT, True) if strict is None else strict
        self.mirror_lightning = mirror_lightning
        self._pm = HookManager()
        self._registries = {kind.name: Registry(kind.name) for kind in hookspecs.KINDS}
        self._plugins: dict[str, PluginInfo] = {}
        self._objects: dict[str, object] = {}
        self._mirror = StrategyMirror()
        self._blocked_by = DISABLE
        self.loaded = False

    # ------------------------------------------------------------------ queries
    @property
    def hook(self) -> pluggy.HookRelay:
        """pluggy's hook relay (``manager.hook.lplugins_choose_precision(...)``)."""
        return self._pm.hook

    def registry(self, kind: str) -> Registry:
        """The registry of one kind of component (``"strategy"``, ``"precision"``, ...).

        Raises:
            UnknownNameError: no kind has that name.
        """
        return self._registries[kind_named(kind).name]

    def get(self, kind: str, name: str) -> Component:
        """Return the registered component ``name`` of ``kind``.

        Raises:
            BlockedNameError: the name belongs to a blocked plugin (the message says which, and what blocked it).
            UnknownNameError: no such name; the message lists the names and the closest match.
        """
        registry = self.registry(kind)
        if name in registry:
            return registry.get(name)
        raise self.name_error(kind, name, registry)

    def name_error(
        self, kind: str, name: object, available: Iterable[str], *, hint: str | None = None
    ) -> UnknownNameError:
        """The error for a name that is not registered: blocked (and by what) or unknown (with the closest match).

        Args:
            kind: The registry's kind (``"strategy"``...), as named in the message.
            name: The name asked for.
            available: The names that would have been accepted.
            hint: A suggestion that beats the closest spelling (``"16-mixed"`` for ``"fp16"``).
        """
        kinds = ("precision", "cluster_environment") if kind == "plugin" else (kind,)  # compose's plugins=[...]
        for kind_name in kinds:
            provider = self._blocked_provider(kind_name, name) if isinstance(name, str) else None
            if provider is not None:
                return BlockedNameError(kind, str(name), provider, self._blocked_by)
        return UnknownNameError(kind, name, available, hint=hint)  # type: ignore[arg-type]  # repr'd in the message

    def _blocked_provider(self, kind: str, name: str) -> str | None:
        """The blocked built-in plugin that registers ``name`` of ``kind``, if any.

        Built-ins import nothing heavy, so a blocked one is imported here (never registered) to see
        its names; a blocked entry-point plugin is never imported, so its names stay unknown.
        """
        modules = dict(BUILTIN_PLUGINS)
        for info in self._plugins.values():
            if info.status != "blocked" or not info.builtin or info.name not in modules:
                continue
            if name in self._builtin_names(info.name, modules[info.name]).get(kind, ()):
                return info.name
        return None

    @staticmethod
    def _builtin_names(plugin: str, module_name: str) -> dict[str, list[str]]:
        staged: list[Component] = []
        try:
            module = importlib.import_module(module_name)
            for kind in hookspecs.KINDS:
                hook = getattr(module, kind.hook, None)
                if callable(hook):
                    hook(register=Registrar(kind, plugin, staged))
        except Exception:  # a broken built-in is reported when it is loaded, not here
            return {}
        names: dict[str, list[str]] = {}
        for component in staged:
            names.setdefault(component.kind, []).append(component.name)
        return names

    def plugins(self) -> list[PluginInfo]:
        """Every plugin seen: loaded, blocked and failed, in load order."""
        return list(self._plugins.values())

    def plugin(self, name: str) -> PluginInfo:
        """The :class:`PluginInfo` of one plugin.

        Raises:
            LPluginsError: no plugin has that name.
        """
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
        controls = Controls.resolve(autoload, allow, disable)
        check_blockable(controls.blocked)
        self._blocked_by = controls.blocked_by
        seen: set[str] = set()
        for candidate in candidates(controls):
            seen |= candidate.names
            if candidate.action == "block":
                self._record_blocked(candidate.info)
            elif candidate.action == "load":
                self._load_candidate(candidate)
        for name in sorted(controls.blocked - seen):
            warnings.warn(
                f"{DISABLE} / disable= names {name!r}, which matches no plugin; nothing was blocked for it.",
                stacklevel=2,
            )
        self.loaded = True
        return self

    def _load_candidate(self, candidate: Candidate) -> None:
        info = candidate.info
        other = self._plugins.get(info.name)
        if not info.builtin and other is not None and other.status == "loaded":
            message = f"another plugin of the same name is already registered (from {other.distribution}); "
            self._fail(info.failure(message + f"block one of them with {DISABLE}", "register"), None, info)
            return
        try:
            plugin = candidate.load()
        except PluginError as exc:
            self._fail(exc, exc.__cause__, info)
            return
        self._register(plugin, info)

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
        return self._register(plugin, PluginInfo(name, distribution, version, entry_point, builtin))

    def _register(self, plugin: object, info: PluginInfo) -> PluginInfo:
        name = info.name
        if self.is_loaded(name):
            return self._fail(info.failure("a plugin of that name is already registered", "register"), None, info)
        if self._pm.is_blocked(name):
            info.status = "blocked"
            self._plugins[name] = info
            return info
        try:
            self._pm.register(plugin, name)
        except pluggy.PluginValidationError as exc:
            return self._fail(info.failure(f"invalid hook implementation: {exc}", "validate"), exc, info)
        except ValueError as exc:  # pluggy: the object or the name is already registered
            return self._fail(info.failure(str(exc), "register"), exc, info)

        try:
            self._pm.check_hook_names(plugin)
            staged = self._pm.stage_components(plugin, name)
            self._check_conflicts(staged, name)
        except StageError as exc:
            self._pm.unregister(plugin, name)
            return self._fail(info.failure(exc.message, exc.stage), exc.__cause__, info)

        for component in staged:
            self._commit(component)
            info.registered.setdefault(component.kind, []).append(component.name)
        info.contributes_callbacks = self._pm.contributes_callbacks(plugin)
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
                if kind == "strategy":
                    self._mirror.remove(component_name)

    def close(self) -> None:
        """Unregister every plugin; the manager can then be loaded again."""
        for name in reversed(list(self._plugins)):
            self.unregister(name)
        self.loaded = False

    # ------------------------------------------------------------------ staging and commit
    def _record_blocked(self, info: PluginInfo) -> None:
        self._pm.set_blocked(info.name)
        info.status = "blocked"
        self._plugins[info.name] = info

    def _fail(self, exc: PluginError, cause: BaseException | None, info: PluginInfo) -> PluginInfo:
        """Raise ``exc`` (strict mode, saying how to go on), or list the plugin as failed and warn."""
        if self.strict:
            raise _with_remedy(exc, info) from cause
        info.status = "failed"
        info.error = str(exc)
        info.registered = {}
        if not self.is_loaded(info.name):
            self._plugins[info.name] = info
        warnings.warn(f"{exc} (skipped; lenient mode)", PluginWarning, stacklevel=3)
        return info

    def _check_conflicts(self, staged: Sequence[Component], name: str) -> None:
        foreign: set[str] = set()
        if self.mirror_lightning:
            foreign = foreign_strategy_names(c.name for c in staged if c.kind == "strategy")
        for component in staged:
            registry = self._registries[component.kind]
            if component.name in registry:
                other = registry.get(component.name).plugin
                raise StageError(
                    f"{component.kind} {component.name!r} is already registered by plugin {other!r}; "
                    f"block one of the two plugins with {DISABLE}={other} or {DISABLE}={name}",
                    "register",
                )
            if component.kind == "strategy" and component.name in foreign:
                raise StageError(
                    f"strategy {component.name!r} is already in Lightning's StrategyRegistry "
                    f"(registered outside lplugins); choose another name",
                    "register",
                )

    def _commit(self, component: Component) -> None:
        self._registries[component.kind]._add(component)
        if component.kind == "strategy" and self.mirror_lightning:
            self._mirror.add(component)

    # ------------------------------------------------------------------ hooks with isolation
    def trainer_callbacks(self, trainer_kwargs: Mapping[str, Any]) -> list[Any]:
        """Call ``lplugins_trainer_callbacks`` on every plugin, in load order, one at a time.

        A plugin that raises or returns something that is not a callback is reported by name
        (raised in strict mode, warned and skipped in lenient mode); the others still contribute.

        Raises:
            PluginError: a plugin's hook failed (strict mode).
        """
        return self._pm.trainer_callbacks(trainer_kwargs, self._hook_failed)

    def _hook_failed(self, plugin_name: str, reason: str, cause: Exception | None) -> None:
        info = self._plugins.get(plugin_name) or PluginInfo(plugin_name)
        error = info.failure(f"hook lplugins_trainer_callbacks failed: {reason}", "hook")
        if self.strict:
            raise _with_remedy(error, info) from cause
        warnings.warn(f"{error} (skipped; lenient mode)", PluginWarning, stacklevel=4)


def _with_remedy(error: PluginError, info: PluginInfo) -> PluginError:
    """``error`` with how to go on: strict mode raises it at every load until one of these is done."""
    if info.builtin:
        fix = "report it: a built-in plugin should never fail"
    elif info.distribution:
        fix = f"fix the plugin, or uninstall it (pip uninstall {info.distribution})"
    else:
        fix = "fix the plugin"
    remedy = (
        f"To go on without it: block it with {DISABLE}={info.name} (or lplugins.load(disable=[{info.name!r}])), "
        f"or set {STRICT}=0 to skip failing plugins with a warning (lenient mode); or {fix}. "
        f"Until then every lplugins.load()/compose() (and, with LPLUGINS_AUTO_CALLBACKS=1, every Trainer()) "
        f"raises this error again."
    )
    return PluginError(
        f"{error.reason.rstrip('.')}. {remedy}",
        plugin=error.plugin,
        distribution=error.distribution,
        version=error.version,
        entry_point=error.entry_point,
        stage=error.stage,
    )


def _announce_loaded(manager: PluginManager) -> None:
    """Say once, on rank zero, which plugins loaded (and which were blocked or failed)."""
    by_status: dict[str, list[str]] = {}
    for info in manager.plugins():
        by_status.setdefault(info.status, []).append(info.name)
    loaded = by_status.get("loaded", [])
    extra = "; ".join(
        f"{status}: {', '.join(by_status[status])}" for status in ("blocked", "failed") if by_status.get(status)
    )
    announce(
        "lplugins: loaded %d plugin%s: %s%s",
        len(loaded),
        "" if len(loaded) == 1 else "s",
        ", ".join(loaded) or "(none)",
        f" ({extra})" if extra else "",
    )


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
    _announce_loaded(manager)
    return manager


def loaded_manager() -> PluginManager | None:
    """The process-wide manager if this process has loaded it (``lplugins.load()``, ``compose``...), else ``None``."""
    return _default if _default is not None and _default.loaded else None


def get_manager() -> PluginManager:
    """The process-wide manager, loading it first if needed."""
    return load()


def set_manager(manager: PluginManager | None) -> PluginManager | None:
    """Replace the process-wide manager (used by ``lplugins.testing``); returns the previous one."""
    global _default
    previous, _default = _default, manager
    return previous
