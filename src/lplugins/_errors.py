"""Exceptions raised by lplugins.

Every error names the offending value and says what is allowed, in the style of pytest's
``Error importing plugin "x"`` and Lightning's registry messages.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class LPluginsError(Exception):
    """Base class of every error lplugins raises on purpose."""


class PluginError(LPluginsError):
    """A plugin could not be loaded, validated or run.

    The message names the plugin, its distribution and version and its entry point; the
    original exception is chained as ``__cause__``.

    Attributes:
        plugin: The plugin's name (its entry-point name, or the built-in name).
        distribution: The distribution that provides it (``"lplugins"`` for built-ins), if known.
        version: The distribution's version, if known.
        entry_point: ``"name = module:attr"`` of the entry point, if it came from one.
        stage: What failed: ``"import"``, ``"validate"``, ``"hook"`` or ``"register"``.
    """

    def __init__(
        self,
        message: str,
        *,
        plugin: str,
        distribution: str | None = None,
        version: str | None = None,
        entry_point: str | None = None,
        stage: str = "register",
    ) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.version = version
        self.entry_point = entry_point
        self.stage = stage
        self.reason = message
        super().__init__(f"{describe_plugin(plugin, distribution, version, entry_point)}: {message}")


def describe_plugin(plugin: str, distribution: str | None, version: str | None, entry_point: str | None) -> str:
    """Return ``plugin "name" (dist 1.0, entry point "x = y")`` for error messages."""
    parts = []
    if distribution:
        parts.append(f"{distribution} {version}" if version else distribution)
    if entry_point:
        parts.append(f'entry point "{entry_point}"')
    where = f" ({', '.join(parts)})" if parts else ""
    return f'plugin "{plugin}"{where}'


class UnknownNameError(LPluginsError, ValueError):
    """A name was not found in a registry.

    Attributes:
        kind: The registry, e.g. ``"strategy"``.
        name: The unknown name.
        available: The names that exist.
    """

    def __init__(self, kind: str, name: str, available: Iterable[str], *, hint: str | None = None) -> None:
        self.kind = kind
        self.name = name
        self.available = sorted(available)
        super().__init__(unknown_name_message(kind, name, self.available, hint=hint))


class BlockedNameError(UnknownNameError):
    """A name that a blocked plugin provides (``LPLUGINS_DISABLE`` / ``disable=``).

    Attributes:
        plugin: The blocked plugin that provides the name.
        blocked_by: What blocked it, e.g. ``"LPLUGINS_DISABLE=strategies"``.
    """

    def __init__(self, kind: str, name: str, plugin: str, blocked_by: str) -> None:
        self.kind = kind
        self.name = name
        self.available = []
        self.plugin = plugin
        self.blocked_by = blocked_by
        LPluginsError.__init__(
            self,
            f"{kind.capitalize()} {name!r} is provided by plugin {plugin!r}, which is blocked by {blocked_by}. "
            f"Unblock the plugin to use it, or choose another {kind}.",
        )


def unknown_name_message(kind: str, name: object, available: Iterable[str], *, hint: str | None = None) -> str:
    """Build the message for an unknown name, with the closest match (or ``hint``) if there is one."""
    names = sorted(available)
    msg = f"Unknown {kind} {name!r}. Available {kind} names: {', '.join(names) if names else '(none)'}."
    return msg + (f" Did you mean {hint!r}?" if hint else did_you_mean(name, names))


def closest(name: str, choices: Iterable[str]) -> str | None:
    """Return the closest of ``choices`` to ``name`` or ``None`` (:func:`suggest`)."""
    return suggest(name, choices)


class RegistrationError(LPluginsError, TypeError, ValueError):
    """A plugin called ``register(...)`` with a bad argument.

    An invalid name, a factory that is not callable, ``defaults`` that are not a mapping, a keyword
    its kind does not accept, or a name registered twice. (It is a ``TypeError`` and a ``ValueError``
    as the checks were before it existed.) The manager reports it as a :class:`PluginError`.
    """


class CompositionError(LPluginsError, ValueError):
    """Trainer arguments that cannot be composed (an incompatible pair, a duplicate callback...)."""


class ParameterError(CompositionError, TypeError):
    """A named component was given a parameter its factory does not take, or not one it needs.

    (A ``TypeError`` too, as calling the factory with it would have raised.)
    """


class UnsafeCheckpointError(LPluginsError, RuntimeError):
    """A checkpoint holds objects that a weights-only load refuses; nothing in it was run.

    The message names the file and the disallowed type. Raised by ``DurableCheckpoint``'s loads and by
    the built-in strategies that load their own files (DeepSpeed, FSDP2); exported as
    ``lplugins.callbacks.UnsafeCheckpointError``.
    """


def suggest(name: object, choices: Iterable[str]) -> str | None:
    """Return the closest of ``choices`` to ``name``, or ``None``.

    >>> suggest("dpp", ["ddp", "fsdp"])
    'ddp'
    """
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(name: object, choices: Iterable[str]) -> str:
    """The ``" Did you mean 'x'?"`` suffix for an error message, or ``""`` when nothing is close.

    >>> "Unknown strategy 'dpp'." + did_you_mean("dpp", ["ddp", "fsdp"])
    "Unknown strategy 'dpp'. Did you mean 'ddp'?"
    """
    hint = suggest(name, choices)
    return f" Did you mean {hint!r}?" if hint else ""


def shown_from(module: str, *classes: type) -> None:
    """Give ``classes`` the public ``module`` users import them from as their home.

    Tracebacks and reprs then say ``lplugins.callbacks.CheckpointResumeError``, not the private module
    that defines it, and pickling finds the class by that name. Called where the classes are defined.
    """
    for cls in classes:
        cls.__module__ = module


shown_from("lplugins", LPluginsError, PluginError, UnknownNameError, BlockedNameError, CompositionError, ParameterError)
shown_from("lplugins.callbacks", UnsafeCheckpointError)
