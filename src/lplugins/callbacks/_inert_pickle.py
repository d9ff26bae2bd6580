"""A checkpoint's ``data.pkl`` read by C ``pickle`` as inert records, nothing called and nothing looked up.

:func:`read_inert` is the first half of :mod:`~lplugins.callbacks._mapped_build`'s fast load: C
``pickle`` parses the bytes, but every global it asks for is a :class:`Global` record (no import, no
attribute lookup), calling one makes a :class:`Call` record, and a persistent id becomes a
:class:`Persistent` record. Nothing the file names is ever touched, so what the opcodes do to the
objects on the stack (``BUILD``, ``SETITEM``) lands either in fresh built-in containers (a ``dict`` or a
``list`` this parse made) or in these records, which only remember it; what a record may become is
decided afterwards, against an explicit allow-list, by the builder.

Before C ``pickle`` sees the bytes, :func:`scan` walks their opcodes: only protocol 2 and the opcodes
torch's own weights-only unpickler accepts pass, and no memo index may exceed the pickle's length
(C ``pickle`` sizes its memo table by the largest index it is given, so one forged index could make it
allocate gigabytes). Anything else is refused (:class:`Refused`), and the caller falls back to
``torch.load(weights_only=True)``, which decides for itself.
"""

from __future__ import annotations

import io
import pickle
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from typing import Any, NoReturn

__all__ = ["Call", "Global", "Persistent", "Refused", "read_inert", "scan"]


class Refused(Exception):
    """The pickle is outside what the fast load reads; the caller falls back to torch's own load."""


def _refuse(why: str) -> NoReturn:
    raise Refused(why)


class Global:
    """A global the pickle names (``module.name``): a record, never imported."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    def __call__(self, *args: Any) -> Call:
        return Call(self, args)

    def __setstate__(self, state: Any) -> None:
        _refuse(f"BUILD on the global {self.module}.{self.name}")


class Call:
    """A call the pickle asks for (``REDUCE``): the global, its arguments, and what it later set on the result."""

    __slots__ = ("args", "func", "items", "state")

    def __init__(self, func: Global, args: tuple[Any, ...]) -> None:
        self.func = func
        self.args = args
        self.items: list[tuple[Any, Any]] = []
        self.state: Any = None

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM(S)
        self.items.append((key, value))

    def __setstate__(self, state: Any) -> None:  # BUILD
        if self.state is not None:
            _refuse(f"a second BUILD on a call of {self.func.module}.{self.func.name}")
        self.state = state


class Persistent:
    """A persistent id (``BINPERSID``): in a torch checkpoint, a storage record."""

    __slots__ = ("pid",)

    def __init__(self, pid: Any) -> None:
        self.pid = pid


# Opcodes torch's weights-only unpickler accepts (protocol 2), by how their argument is laid out.
_NONE, _FIXED1, _FIXED2, _FIXED4, _FIXED8, _COUNT1, _COUNT4, _LINES, _BAD = range(9)
_KIND = [_BAD] * 256
for _ops, _kind in (
    (b"(t\x85\x86\x87N\x88\x89)]}\x8fRbaesuQ\x81", _NONE),
    (b"Khq", _FIXED1),
    (b"M", _FIXED2),
    (b"Jj", _FIXED4),
    (b"G", _FIXED8),
    (b"U\x8a", _COUNT1),
    (b"X", _COUNT4),
    (b"c", _LINES),
):
    for _op in _ops:
        _KIND[_op] = _kind
_LONG_BINPUT = ord("r")
_KIND[_LONG_BINPUT] = _FIXED4
_STOP = ord(".")
_KIND[_STOP] = _NONE


def scan(data: bytes) -> None:
    """Check ``data``'s opcodes before C ``pickle`` reads them.

    Raises:
        Refused: not protocol 2, an opcode torch's weights-only unpickler would not run, a memo index
            larger than the pickle, or no ``STOP``.
    """
    if data[:2] != b"\x80\x02":
        _refuse("not a protocol 2 pickle")
    n = len(data)
    kind = _KIND
    i = 2
    while i < n:
        op = data[i]
        i += 1
        k = kind[op]
        if k == _NONE:
            if op == _STOP:
                return
        elif k == _FIXED1:
            i += 1
        elif k == _FIXED4:
            if op == _LONG_BINPUT and int.from_bytes(data[i : i + 4], "little") >= n:
                _refuse("a memo index larger than the pickle")
            i += 4
        elif k == _FIXED2:
            i += 2
        elif k == _COUNT4:
            i += 4 + int.from_bytes(data[i : i + 4], "little")
        elif k == _COUNT1:
            i += 1 + data[i] if i < n else 1
        elif k == _FIXED8:
            i += 8
        elif k == _LINES:
            i = data.find(b"\n", data.find(b"\n", i) + 1) + 1
            if i == 0:
                break
        else:
            _refuse(f"opcode {op:#04x}")
    _refuse("no STOP")


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
                _refuse(f"the global {module}.{name}")
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
