"""lplugins: pytest-style plugins for PyTorch Lightning.

Plugins implement the hooks in :mod:`lplugins.hookspecs` and are discovered through the
``lplugins`` entry-point group; built-in plugins go through the same hooks. Use :func:`compose` to
turn names into objects for a stock ``lightning.pytorch.Trainer`` and :func:`attach` to add
callbacks to a Trainer you already have.
"""

from __future__ import annotations

from lplugins import _log
from lplugins._composition.compose import attach, compose, compose_trainer
from lplugins._coord import exit as _exit
from lplugins._errors import (
    BlockedNameError,
    CompositionError,
    LPluginsError,
    ParameterError,
    PluginError,
    UnknownNameError,
)
from lplugins._lightning.namespace import current as current_namespace
from lplugins._plugins.manager import PluginInfo, PluginManager, PluginWarning, get_manager, load
from lplugins._plugins.registry import Component
from lplugins.hookspecs import hookimpl

__version__ = "0.1.0"
"""The package version (``lplugins --version`` prints the installed distribution's)."""

_exit.install()  # a gloo process group left initialized must not abort the process at exit
_log.configure()  # lplugins' decisions reach the terminal as Lightning's own messages do

__all__ = [
    "BlockedNameError",
    "Component",
    "CompositionError",
    "LPluginsError",
    "ParameterError",
    "PluginError",
    "PluginInfo",
    "PluginManager",
    "PluginWarning",
    "UnknownNameError",
    "__version__",
    "attach",
    "compose",
    "compose_trainer",
    "current_namespace",
    "get_manager",
    "hookimpl",
    "load",
]
