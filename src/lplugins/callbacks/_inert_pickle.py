"""A checkpoint's ``data.pkl`` read by C ``pickle`` as inert records, nothing called and nothing looked up.

:func:`read_inert` is the first half of :mod:`~lplugins.callbacks._mapped_build`'s fast load: C
``pickle`` parses the bytes, but every global it asks for is a :class:`Global` record (no import, no
attribute lookup), calling one makes a :class:`Call` record, and a persistent id becomes a
:class:`Persistent` record. Nothing the file names is ever touched, so what the opcodes do to the
objects on the stack (``BUILD``, ``SETITEM``) lands either in fresh built-in containers (a ``dict`` or a
``list`` this parse made) or in these records, which only remember it; what a record may become is
decided afterwards, against an explicit allow-list, by the builder.

Before C ``pickle`` sees the bytes, :func:`~lplugins.callbacks._pickle_scan.scan` runs their opcodes
over kinds and applies torch's weights-only rules (which opcodes, on which kinds of object, memo
indices in order). Records keep what an opcode gave them as it was at that opcode (a ``BUILD`` state,
a list argument), as torch's unpickler would have consumed it. Anything else is refused
(:class:`Refused`), and the caller falls back to ``torch.load(weights_only=True)``, which decides for
itself.
"""

from __future__ import annotations

import io
import pickle
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from typing import Any

from lplugins.callbacks._pickle_scan import Refused, scan

__all__ = ["NO_STATE", "Call", "Global", "ListPrefix", "Persistent", "Refused", "read_inert", "scan"]

NO_STATE: Any = object()
"""What :attr:`Call.state` holds when no ``BUILD`` applied to the call."""


class Global:
    """A global the pickle names (``module.name``): a record, never imported."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    def __call__(self, *args: Any) -> Call:
        # a list argument as it is now: ``set(list)`` reads it at the call, a later APPEND must not show
        return Call(self, tuple(ListPrefix(a, len(a)) if type(a) is list else a for a in args))

    def __setstate__(self, state: Any) -> None:
        raise Refused(f"BUILD on the global {self.module}.{self.name}")


class ListPrefix:
    """A list given to a call: the list and how many items it held then (a list only grows while it is parsed).

    Not a copy: one list given to many calls would cost the product of their sizes.
    """

    __slots__ = ("items", "length")

    def __init__(self, items: list[Any], length: int) -> None:
        self.items = items
        self.length = length


class Call:
    """A call the pickle asks for (``REDUCE``): the global, its arguments, and what it later set on the result."""

    __slots__ = ("args", "func", "items", "state")

    def __init__(self, func: Global, args: tuple[Any, ...]) -> None:
        self.func = func
        self.args = args
        self.items: list[tuple[Any, Any]] = []
        self.state: Any = NO_STATE

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM(S)
        self.items.append((key, value))

    def __setstate__(self, state: Any) -> None:  # BUILD
        if self.state is not NO_STATE or type(state) is not dict:
            raise Refused(f"a second BUILD, or one without a dict, on a call of {self.func.module}.{self.func.name}")
        self.state = dict(state)  # as it is now: torch copies it into ``__dict__`` here; later SETITEMs must not show


class Persistent:
    """A persistent id (``BINPERSID``): in a torch checkpoint, a storage record."""

    __slots__ = ("pid",)

    def __init__(self, pid: Any) -> None:
        self.pid = pid

    def __setstate__(self, state: Any) -> None:
        raise Refused("BUILD on a persistent id")


class _Reader(pickle.Unpickler):
    """C ``pickle`` with every global a :class:`Global` and every persistent id a :class:`Persistent`."""

    def __init__(self, data: bytes, allowed: frozenset[tuple[str, str]]) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._allowed = allowed
        self._globals: dict[tuple[str, str], Global] = {}

    def find_class(self, module: str, name: str) -> Global:
        # Python 2 names, as protocol 2 writes them (``__builtin__.set``), read as torch's unpickler reads them
        module, name = NAME_MAPPING.get((module, name), (IMPORT_MAPPING.get(module, module), name))
        key = (module, name)
        found = self._globals.get(key)
        if found is None:
            if key not in self._allowed:
                raise Refused(f"the global {module[:64]}.{name[:64]}")  # the file's text: bounded
            found = self._globals[key] = Global(module, name)
        return found

    def persistent_load(self, pid: Any) -> Persistent:
        return Persistent(pid)


def read_inert(data: bytes, allowed: frozenset[tuple[str, str]]) -> Any:
    """``data`` (a protocol 2 pickle) as plain data and records; only the globals in ``allowed`` may appear.

    Raises:
        Refused: :func:`scan` refused it, it names a global outside ``allowed``, or C ``pickle`` could
            not apply an opcode to what was on its stack (``APPEND`` to a record, ``BUILD`` on a ``dict``).
    """
    scan(data)
    try:
        return _Reader(data, allowed).load()
    except Refused:
        raise
    except Exception as err:  # C pickle's own complaint: a malformed or hostile pickle
        raise Refused(f"{type(err).__name__}: {err}") from err
