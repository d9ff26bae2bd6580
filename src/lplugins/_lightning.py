"""Every access lplugins makes to Lightning's (and DeepSpeed's) private internals, in one place.

Lightning's public API does not offer everything lplugins needs (reordering callbacks the way
``Trainer()`` does, reading the path ``fit`` will restore from, deciding accumulation windows from
outside the loop...). Each such access lives in this module and nowhere else, as a small function
with a name that says what it does, and each private name it touches is declared in
:data:`PRIVATES` with the Lightning versions it was checked against.

``tests/test_lightning_internals.py`` resolves every entry of :data:`PRIVATES` against the
installed Lightning and fails, naming the attribute, when a release renames or removes one; a
second test greps the rest of ``src/lplugins`` for private Lightning names. CI runs those tests on
the oldest and the newest supported Lightning.

To add an access: write a function here, declare what it touches with :func:`_private`, and call
the function from the module that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CHECKED_VERSIONS", "PRIVATES", "Private"]

#: The Lightning versions every entry of :data:`PRIVATES` was checked against (CI: oldest and newest).
CHECKED_VERSIONS = "2.5.0 – 2.6.6"


@dataclass(frozen=True)
class Private:
    """One private name lplugins relies on.

    Attributes:
        where: Where the name lives. For ``kind="class"``: the dotted import path of a class or
            module (``"lightning.pytorch.trainer.connectors.callback_connector._CallbackConnector"``);
            the name must be an attribute of it. For ``kind="trainer"``: a path from a freshly built
            ``Trainer`` (``"trainer.fit_loop.epoch_loop"``); the name must be an attribute of the
            object it leads to. For ``kind="init"``: the dotted path of a class whose ``__init__``
            sets the attribute (``deepspeed.runtime.engine.DeepSpeedEngine``); checked in its source.
        name: The private attribute, method or module-level name.
        kind: How the test checks it (see ``where``).
        why: What lplugins uses it for, in a few words.
    """

    where: str
    name: str
    kind: Literal["class", "trainer", "init"] = "class"
    why: str = ""


#: Every private name used below; the internals test checks each against the installed versions.
PRIVATES: list[Private] = []


def _private(where: str, name: str, kind: Literal["class", "trainer", "init"] = "class", why: str = "") -> Private:
    entry = Private(where, name, kind, why)
    PRIVATES.append(entry)
    return entry


# ------------------------------------------------------------------ composition and the Trainer
# (owned by the compose / manager / LightningCLI code)


# ------------------------------------------------------------------ checkpointing
# (owned by lplugins.callbacks)


# ------------------------------------------------------------------ accumulation
# (owned by lplugins.accumulation)


# ------------------------------------------------------------------ strategies, precision, rank zero
# (owned by lplugins.strategies, lplugins.precision, lplugins.rankzero)
