"""The registry of private Lightning (and DeepSpeed, torch) names lplugins relies on: :data:`PRIVATES`.

Every module of :mod:`lplugins._lightning` declares each private name it touches with
:func:`_private`, next to the function that touches it. ``tests/test_lightning_internals.py``
resolves every entry against the installed Lightning (the oldest and the newest supported, in CI)
and fails naming the attribute when a release moves one.

Each namespace has its own registry (``scripts/mirror_pl.py`` twins this module on purpose): the
``pytorch_lightning`` twins declare their entries, with their package names, in theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CHECKED_VERSIONS", "PRIVATES", "Kind", "Private", "_private"]

#: How an entry is checked (see :attr:`Private.where`).
Kind = Literal["class", "trainer", "init", "field"]

#: The Lightning versions every entry of :data:`PRIVATES` was checked against (CI: oldest and newest).
CHECKED_VERSIONS = "2.6.0 - 2.6.6"


@dataclass(frozen=True)
class Private:
    """One private name lplugins relies on.

    Attributes:
        where: Where the name lives. For ``kind="class"``: the dotted import path of a class or
            module (``"lightning.pytorch.trainer.connectors.callback_connector._CallbackConnector"``);
            the name must be an attribute of it. For ``kind="trainer"``: a path from a freshly built
            ``Trainer`` (``"trainer.fit_loop.epoch_loop"``); the name must be an attribute of the
            object it leads to. For ``kind="init"``: the dotted path of a class whose ``__init__``
            sets the attribute (``deepspeed.runtime.engine.DeepSpeedEngine``); checked in its source. For
            ``kind="field"``: the dotted path of a dataclass; the name must be one of its fields.
        name: The private attribute, method or module-level name.
        kind: How the test checks it (see ``where``).
        why: What lplugins uses it for, in a few words.
    """

    where: str
    name: str
    kind: Kind = "class"
    why: str = ""


#: Every private name used below; the internals test checks each against the installed versions.
PRIVATES: list[Private] = []


def _private(where: str, name: str, kind: Kind = "class", why: str = "") -> Private:
    entry = Private(where, name, kind, why)
    PRIVATES.append(entry)
    return entry
