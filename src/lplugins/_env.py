"""The ``LPLUGINS_*`` environment variables that control plugin loading, read in one place.

===============================  =====================================================================
``LPLUGINS_DISABLE_AUTOLOAD``    ``1``: do not load entry-point plugins (an allow-list still does).
``LPLUGINS_PLUGINS``             ``a,b``: load only these entry-point plugins (plugin or distribution).
``LPLUGINS_DISABLE``             ``a,b``: block these plugins, built-ins included.
``LPLUGINS_STRICT``              ``0``: report a failing plugin with a warning instead of raising.
``LPLUGINS_AUTO_CALLBACKS``      ``1``: zero-code mode (see :mod:`lplugins._composition.factory`).
``LPLUGINS_AUTO_NAMES``          ``1``: registered names work in unchanged projects: plugins load when
                                 Lightning is first imported (see :mod:`lplugins._composition.autoload`).
``LPLUGINS_COLLECTIVE_TIMEOUT``  seconds (default ``auto``: 5, raised to 3x the longest step): the
                                 collective watchdog's floor; ``off``: no watchdog
                                 (see :mod:`lplugins._coord.settings`).
``LPLUGINS_HEARTBEAT_TIMEOUT``   seconds (default ``auto``: 5): how long a rank may hold the GIL
                                 before it is named unresponsive (see :mod:`lplugins._coord.settings`).
===============================  =====================================================================
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from lplugins._errors import LPluginsError

DISABLE_AUTOLOAD = "LPLUGINS_DISABLE_AUTOLOAD"
PLUGINS = "LPLUGINS_PLUGINS"
DISABLE = "LPLUGINS_DISABLE"
STRICT = "LPLUGINS_STRICT"
AUTO_CALLBACKS = "LPLUGINS_AUTO_CALLBACKS"
AUTO_NAMES = "LPLUGINS_AUTO_NAMES"
COLLECTIVE_TIMEOUT = "LPLUGINS_COLLECTIVE_TIMEOUT"

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


def env_seconds(name: str, default: float) -> float:
    """Read a duration in seconds (a number >= 0; ``0`` usually means off).

    Raises:
        LPluginsError: the value is not a finite number >= 0.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):
        raise LPluginsError(
            f"{name}={raw!r} is not a number of seconds; use a number >= 0 (0 turns it off), e.g. {name}={default:g}."
        )
    return value


def env_list(name: str) -> list[str] | None:
    """Read a comma-separated environment variable; ``None`` when unset."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    return [item.strip() for item in raw.split(",") if item.strip()]


@dataclass(frozen=True)
class Controls:
    """What to load: the arguments of :meth:`lplugins.PluginManager.load`, environment applied.

    Attributes:
        autoload: Load entry-point plugins.
        allow: Only these entry-point plugins (plugin or distribution names); ``None``: all.
        blocked: Plugins to block (plugin or distribution names), built-ins included.
        blocked_by: Where ``blocked`` came from, for messages (``"LPLUGINS_DISABLE=a,b"`` or
            ``"disable=['a']"``).
    """

    autoload: bool
    allow: list[str] | None
    blocked: frozenset[str]
    blocked_by: str = DISABLE

    @classmethod
    def resolve(
        cls, autoload: bool | None = None, allow: Iterable[str] | None = None, disable: Iterable[str] | None = None
    ) -> Controls:
        """Take each control from its argument, or from its environment variable when ``None``.

        Raises:
            LPluginsError: ``LPLUGINS_DISABLE_AUTOLOAD`` is not a boolean.
        """
        if disable is not None:
            blocked = list(disable)
            blocked_by = f"disable={blocked!r}"
        else:
            blocked = env_list(DISABLE) or []
            blocked_by = f"{DISABLE}={os.environ.get(DISABLE, '')}"
        return cls(
            autoload=not env_flag(DISABLE_AUTOLOAD) if autoload is None else autoload,
            allow=list(allow) if allow is not None else env_list(PLUGINS),
            blocked=frozenset(blocked),
            blocked_by=blocked_by,
        )

    @property
    def discovers_entry_points(self) -> bool:
        """Whether entry points are looked up at all (autoload, or an allow-list as pytest's ``-p``)."""
        return bool(self.autoload or self.allow)
