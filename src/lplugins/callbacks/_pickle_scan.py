"""Which pickles the fast load lets C ``pickle`` read: the opcodes run over kinds before any object is made.

:func:`scan` is the gate in front of :func:`~lplugins.callbacks._inert_pickle.read_inert`. It walks a
``data.pkl`` once, keeping for every stack slot and memo entry only its *kind* (plain value, tuple,
list, dict, empty set, global, call, ``OrderedDict()`` call, persistent id), and applies the rules of
torch's weights-only unpickler where C ``pickle`` has none:

* only protocol 2 and the opcodes torch's unpickler runs (no ``NEWOBJ``: the fast load builds no class);
* ``REDUCE`` only calls a global, with a tuple; ``BINPERSID`` only takes a tuple;
* ``SETITEM(S)`` only on a dict or an ``OrderedDict()`` call, ``APPEND(S)`` only on a list, ``BUILD``
  only on an ``OrderedDict()`` call with a dict (its ``__dict__``, as torch applies it);
* a memo index is read only once written and written only in order (at most one past the last), so
  C ``pickle``, which sizes its memo table by the largest index it is given, never allocates more
  than the pickle's own length;
* pops never cross a ``MARK``, and the pickle ends with ``STOP`` on exactly one object.

Anything else raises :class:`Refused`, whose message names an opcode or a kind, never the file's data.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["Refused", "scan"]


class Refused(Exception):
    """The pickle is outside what the fast load reads; the caller falls back to torch's own load."""


def _refuse(why: str) -> NoReturn:
    raise Refused(why)


# Kinds of what a stack slot or memo entry holds.
_PLAIN, _TUPLE, _LIST, _DICT, _SET, _GLOBAL, _ORDERED_GLOBAL, _CALL, _ORDERED, _PERSISTENT = (
    "a plain value",
    "a tuple",
    "a list",
    "a dict",
    "an empty set",
    "a global",
    "the global OrderedDict",
    "a call",
    "an OrderedDict() call",
    "a persistent id",
)
_PUSH = {
    **dict.fromkeys(b"N\x88\x89KMJGU\x8aX", _PLAIN),
    ord(")"): _TUPLE,
    ord("]"): _LIST,
    ord("}"): _DICT,
    0x8F: _SET,  # EMPTY_SET (no ADDITEMS: only ever empty)
}
_ARG_BYTES = {ord("K"): 1, ord("h"): 1, ord("q"): 1, ord("M"): 2, ord("J"): 4, ord("j"): 4, ord("r"): 4, ord("G"): 8}
_TUPLE_N = {0x85: 1, 0x86: 2, 0x87: 3}


def scan(data: bytes) -> None:
    """Check ``data``'s opcodes, and what each applies to, before C ``pickle`` reads them.

    Raises:
        Refused: not protocol 2, an opcode torch's weights-only unpickler would not run or would not
            apply to that kind of object, a memo index out of order, a pop across a ``MARK``, or no
            ``STOP`` on exactly one object.
    """
    if data[:2] != b"\x80\x02":
        _refuse("not a protocol 2 pickle")
    n = len(data)
    stack: list[str] = []
    marks: list[int] = []
    memo: list[str] = []

    def pop(count: int) -> list[str]:
        fence = marks[-1] if marks else 0
        if count < 0 or len(stack) - count < fence:
            _refuse("a pop across a MARK or from an empty stack")
        popped = stack[len(stack) - count :]
        del stack[len(stack) - count :]
        return popped

    def to_mark() -> list[str]:
        if not marks:
            _refuse("no MARK to pop to")
        popped = stack[marks[-1] :]
        del stack[marks.pop() :]
        return popped

    def top(*kinds: str) -> None:
        fence = marks[-1] if marks else 0
        if len(stack) <= fence or stack[-1] not in kinds:
            _refuse(f"{op_name} on {stack[-1] if len(stack) > fence else 'nothing'}")

    i = 2
    while i < n:
        op = data[i]
        op_name = f"opcode {chr(op)!r}" if 32 < op < 127 else f"opcode {op:#04x}"
        i += 1
        if op in _PUSH:
            stack.append(_PUSH[op])
            size = _ARG_BYTES.get(op, 0)
            if op == 0x55 or op == 0x8A:  # SHORT_BINSTRING, LONG1: a one-byte length
                size = 1 + (data[i] if i < n else 0)
            elif op == 0x58:  # BINUNICODE: a four-byte length
                size = 4 + int.from_bytes(data[i : i + 4], "little")
            i += size
        elif op in (0x68, 0x6A):  # BINGET, LONG_BINGET
            size = _ARG_BYTES[op]
            index = int.from_bytes(data[i : i + size], "little")
            i += size
            if index >= len(memo):
                _refuse("a memo index read before it is written")
            stack.append(memo[index])
        elif op in (0x71, 0x72):  # BINPUT, LONG_BINPUT
            size = _ARG_BYTES[op]
            index = int.from_bytes(data[i : i + size], "little")
            i += size
            if index > len(memo):
                _refuse("a memo index out of order")
            (kind,) = pop(1)
            stack.append(kind)
            if index == len(memo):
                memo.append(kind)
            else:
                memo[index] = kind
        elif op == 0x28:  # MARK
            marks.append(len(stack))
        elif op == 0x74:  # TUPLE
            to_mark()
            stack.append(_TUPLE)
        elif op in _TUPLE_N:
            pop(_TUPLE_N[op])
            stack.append(_TUPLE)
        elif op == 0x63:  # GLOBAL: module and name, each ended by a newline
            j = data.find(b"\n", i)
            k = data.find(b"\n", j + 1) if j >= 0 else -1
            if k < 0:
                _refuse("a GLOBAL without its two lines")
            ordered = data[i:j] == b"collections" and data[j + 1 : k] == b"OrderedDict"
            stack.append(_ORDERED_GLOBAL if ordered else _GLOBAL)
            i = k + 1
        elif op == 0x52:  # REDUCE
            func, args = pop(2)
            if func not in (_GLOBAL, _ORDERED_GLOBAL) or args != _TUPLE:
                _refuse(f"REDUCE of {func} with {args}")
            stack.append(_ORDERED if func == _ORDERED_GLOBAL else _CALL)
        elif op == 0x51:  # BINPERSID
            if pop(1) != [_TUPLE]:
                _refuse("a persistent id that is not a tuple")
            stack.append(_PERSISTENT)
        elif op == 0x73:  # SETITEM
            pop(2)
            top(_DICT, _ORDERED)
        elif op == 0x75:  # SETITEMS
            if len(to_mark()) % 2:
                _refuse("SETITEMS with a key and no value")
            top(_DICT, _ORDERED)
        elif op == 0x61:  # APPEND
            pop(1)
            top(_LIST)
        elif op == 0x65:  # APPENDS
            to_mark()
            top(_LIST)
        elif op == 0x62:  # BUILD
            (state,) = pop(1)
            top(_ORDERED)
            if state != _DICT:
                _refuse(f"BUILD on an OrderedDict() call with {state}")
        elif op == 0x2E:  # STOP
            if marks or len(stack) != 1:
                _refuse("STOP with other than one object on the stack")
            return
        else:
            _refuse(op_name)
    _refuse("no STOP")
