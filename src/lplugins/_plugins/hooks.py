"""Calling plugins' hooks: pluggy's manager taught lplugins' conventions.

* Functions named ``lplugins_*`` are hooks without a marker (as pytest does for ``pytest_``), and
  one that matches no specification is refused with the closest hook name.
* Registering hooks are called for one plugin at a time, into a staging list (see
  :class:`lplugins._plugins.registry.Registrar`), in the order of :data:`lplugins.hookspecs.KINDS`.
* ``lplugins_trainer_callbacks`` is called one plugin at a time, so one failing plugin is named
  and the others still contribute.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pluggy

from lplugins import hookspecs
from lplugins._errors import LPluginsError
from lplugins._plugins.registry import Component, Registrar
from lplugins._validate import did_you_mean

#: Every hook's name starts with it; the manager takes any such function as a hook.
HOOK_PREFIX = "lplugins_"


class StageError(LPluginsError):
    """A step of registering a plugin failed; the manager turns it into a :class:`~lplugins.PluginError`.

    Attributes:
        message: What failed.
        stage: ``"validate"``, ``"hook"`` or ``"register"``.
    """

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.message = message
        self.stage = stage


class HookManager(pluggy.PluginManager):
    """pluggy's manager for the ``lplugins`` hooks (:mod:`lplugins.hookspecs`)."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        """Like pluggy's, and take an unmarked ``lplugins_*`` function as a hook implementation."""
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(HOOK_PREFIX):
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

    def check_hook_names(self, plugin: object) -> None:
        """Refuse a registered plugin's ``lplugins_*`` function that matches no hook.

        Raises:
            StageError: an unknown hook (``stage="validate"``), with the closest hook name.
        """
        for caller in self.get_hookcallers(plugin) or []:
            if caller.spec is None:
                known = [n for n in dir(hookspecs) if n.startswith(HOOK_PREFIX)]
                raise StageError(
                    f"unknown hook {caller.name!r}; lplugins hooks are: {', '.join(known)}."
                    + did_you_mean(caller.name, known),
                    "validate",
                )

    def stage_components(self, plugin: object, name: str) -> list[Component]:
        """Call the registering hooks of one registered plugin; return what they registered.

        Raises:
            StageError: a hook raised (``stage="hook"``; the error is chained).
        """
        staged: list[Component] = []
        for kind in hookspecs.KINDS:
            for impl in getattr(self.hook, kind.hook).get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                registrar = Registrar(kind, name, staged)
                try:
                    impl.function(**{arg: registrar for arg in impl.argnames})
                except Exception as exc:
                    raise StageError(f"hook {kind.hook} raised {type(exc).__name__}: {exc}", "hook") from exc
        return staged

    def contributes_callbacks(self, plugin: object) -> bool:
        """Whether ``plugin`` implements ``lplugins_trainer_callbacks``."""
        return any(impl.plugin is plugin for impl in self.hook.lplugins_trainer_callbacks.get_hookimpls())

    def trainer_callbacks(
        self, trainer_kwargs: Mapping[str, Any], on_error: Callable[[str, str, Exception | None], None]
    ) -> list[Any]:
        """Call ``lplugins_trainer_callbacks`` on every plugin, in load order, one at a time.

        Args:
            trainer_kwargs: What the hook receives.
            on_error: Called with the plugin's name, what went wrong and the exception (if it
                raised) when a plugin raises or returns something that is not a callback; it
                raises, or returns to skip that plugin.
        """
        from lplugins._lightning import namespace as _namespace

        namespace = _namespace.current()
        Callback = _namespace.lightning_class(namespace, "callbacks", "Callback")

        results: list[Any] = []
        for impl in self.hook.lplugins_trainer_callbacks.get_hookimpls():
            try:
                function = _namespace.function_for(impl.function, namespace)
                out: Any = function(**{arg: trainer_kwargs for arg in impl.argnames})
                items = [] if out is None else [out] if isinstance(out, Callback) else list(out)
            except Exception as exc:
                on_error(impl.plugin_name, f"{type(exc).__name__}: {exc}", exc)
                continue
            bad = [cb for cb in items if not isinstance(cb, Callback)]
            if bad:
                on_error(
                    impl.plugin_name,
                    f"TypeError: returned {bad[0]!r}, which is not a {_namespace.NAMESPACES[namespace][0]}.Callback"
                    + _namespace.other_namespace_hint(bad[0], namespace),
                    None,
                )
                continue
            results.extend(items)
        return results
