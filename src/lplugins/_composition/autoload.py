"""Opt-in zero-code names: ``LPLUGINS_AUTO_NAMES=1`` makes registered names work in unchanged projects.

lplugins installs ``lplugins_names.pth`` into site-packages. At interpreter start it reads one
environment variable and, only when ``LPLUGINS_AUTO_NAMES`` is on, imports this module, which
arranges for :func:`lplugins.load` to run right after ``lightning.pytorch`` or ``pytorch_lightning``
is first imported -- before any code can build a Trainer. Registered strategy names then work in
``Trainer(strategy="deepspeed_stage_2_cpu")``, a Hydra ``trainer.strategy=...`` override or a
LightningCLI YAML, in either namespace, without any code calling ``lplugins.load()``. A broken
plugin raises the same named ``PluginError`` as ``lplugins.load()`` would, from that import.

Precision-plugin and cluster-environment names are registered too, but a plain Trainer cannot take
them: Lightning 2.6 has a registry for strategies only (``plugins=`` takes instances, ``precision=``
its own fixed strings). They work where lplugins composes the Trainer (``compose``,
``compose_trainer`` as a Hydra ``_target_``, the ``lplugins:`` section of its ``LightningCLI``).

With the variable unset the ``.pth`` line costs one ``os.environ`` lookup; nothing is imported.
"""

from __future__ import annotations

from types import ModuleType

from lplugins._env import AUTO_NAMES, env_flag
from lplugins._lightning.imports import on_import

#: The packages whose first import loads the plugins.
WATCHED = ("lightning.pytorch", "pytorch_lightning")

_loading = False


def _load(module: ModuleType) -> None:
    global _loading
    if _loading:  # load() imports lightning.pytorch itself: once is enough
        return
    _loading = True
    try:
        from lplugins._plugins.manager import load

        load()
    finally:
        _loading = False


def install() -> None:
    """Load the plugins when a Lightning namespace is first imported (at once if one already is)."""
    for name in WATCHED:
        on_import(name, _load)


if env_flag(AUTO_NAMES):
    install()
