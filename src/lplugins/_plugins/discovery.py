"""Finding plugins: the built-ins, then the ``lplugins`` entry points, filtered by the controls.

Discovery decides *which* plugins exist and whether each is to be loaded, blocked or skipped; it
imports a plugin only when asked (:meth:`Candidate.load`). Registering is the manager's job
(:mod:`lplugins._plugins.manager`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from lplugins._env import DISABLE, PLUGINS, Controls
from lplugins._errors import LPluginsError, PluginError
from lplugins._validate import did_you_mean

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
    ("ray", "lplugins._builtins.ray"),
)

#: Built-ins that cannot be blocked: without them, Lightning's own names would not resolve.
ESSENTIAL_PLUGINS: frozenset[str] = frozenset({"core"})

#: The distribution name of the built-ins; blocking it blocks every built-in but the essential ones.
OWN_DISTRIBUTION = "lplugins"


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
        contributes_callbacks: Whether it implements ``lplugins_trainer_callbacks``.
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

    def failure(self, message: str, stage: str) -> PluginError:
        """A :class:`~lplugins.PluginError` about this plugin (naming its distribution and entry point)."""
        return PluginError(
            message,
            plugin=self.name,
            distribution=self.distribution,
            version=self.version,
            entry_point=self.entry_point,
            stage=stage,
        )


@dataclass
class Candidate:
    """A plugin that discovery found, before it is imported.

    Attributes:
        info: Its :class:`PluginInfo` (status still ``"loaded"``: the manager sets the outcome).
        action: ``"load"``; ``"block"`` (blocked by the controls: listed, never imported); ``"skip"``
            (not in the allow-list: neither loaded nor listed).
        target: The module of a built-in, or the entry point's ``module:attr``.
        entry_point: The entry point, for plugins that come from one.
    """

    info: PluginInfo
    action: Literal["load", "block", "skip"]
    target: str
    entry_point: importlib.metadata.EntryPoint | None = None

    @property
    def names(self) -> set[str]:
        """The names that select it in the controls: its own, and its distribution's for entry points."""
        if self.info.builtin or self.info.distribution is None:
            return {self.info.name}
        return {self.info.name, self.info.distribution}

    def load(self) -> object:
        """Import the plugin object.

        Raises:
            PluginError: the import failed (``stage="import"``; the original error is chained).
        """
        try:
            if self.entry_point is None:
                return importlib.import_module(self.target)
            return self.entry_point.load()
        except Exception as exc:
            if self.info.builtin:  # a broken built-in is a bug, but still reported like any plugin
                reason = f"cannot import {self.target}: {exc!r}"
            else:
                reason = f"error importing plugin: {type(exc).__name__}: {exc}"
            raise self.info.failure(reason, "import") from exc


def candidates(controls: Controls) -> Iterator[Candidate]:
    """The built-ins, then (if the controls ask for them) the entry-point plugins, in a stable order.

    Entry points are looked up only after the built-ins have been consumed, so a built-in loads
    before any third-party module is imported.

    Raises:
        LPluginsError: the allow-list names a plugin that is not installed.
    """
    for name, module in BUILTIN_PLUGINS:
        blocked = name in controls.blocked or (OWN_DISTRIBUTION in controls.blocked and name not in ESSENTIAL_PLUGINS)
        info = PluginInfo(name=name, distribution=OWN_DISTRIBUTION, version=own_version(), builtin=True)
        yield Candidate(info, "block" if blocked else "load", module)
    if not controls.discovers_entry_points:
        return
    entry_points = discover_entry_points()
    allow = controls.allow
    if allow is not None:
        _check_allow_list(allow, entry_points)
    for ep, dist_name, dist_version in entry_points:
        info = PluginInfo(ep.name, dist_name, dist_version, entry_point=f"{ep.name} = {ep.value}")
        action: Literal["load", "block", "skip"] = "load"
        if allow is not None and ep.name not in allow and dist_name not in allow:
            action = "skip"
        elif ep.name in controls.blocked or dist_name in controls.blocked:
            action = "block"
        yield Candidate(info, action, ep.value, ep)


def check_blockable(blocked: frozenset[str]) -> None:
    """Refuse to block an essential plugin.

    Raises:
        LPluginsError: ``blocked`` names an essential plugin.
    """
    for name in sorted(blocked & ESSENTIAL_PLUGINS):
        raise LPluginsError(
            f"Plugin {name!r} is essential and cannot be blocked (essential plugins: "
            f"{', '.join(sorted(ESSENTIAL_PLUGINS))}). Remove it from {DISABLE} / disable=."
        )


def _check_allow_list(
    allow: list[str], entry_points: list[tuple[importlib.metadata.EntryPoint, str | None, str | None]]
) -> None:
    available = {ep.name for ep, _, _ in entry_points} | {d for _, d, _ in entry_points if d}
    for wanted in allow:
        if wanted not in available:
            raise LPluginsError(
                f"{PLUGINS} / allow= names {wanted!r}, but no installed plugin has that name. "
                f"Installed entry-point plugins: {', '.join(sorted(available)) or '(none)'}."
                + did_you_mean(wanted, available)
            )


def discover_entry_points() -> list[tuple[importlib.metadata.EntryPoint, str | None, str | None]]:
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


def own_version() -> str | None:
    """lplugins' installed version (``"unknown"`` when it is not installed as a distribution)."""
    global _VERSION
    if _VERSION is None:
        try:
            _VERSION = importlib.metadata.version(OWN_DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            _VERSION = "unknown"
    return _VERSION
