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
_PUSH: list[str | None] = [None] * 256
for _op in b"N\x88\x89KMJGU\x8aX":
    _PUSH[_op] = _PLAIN
_PUSH[ord(")")], _PUSH[ord("]")], _PUSH[ord("}")] = _TUPLE, _LIST, _DICT
_PUSH[0x8F] = _SET  # EMPTY_SET (no ADDITEMS: only ever empty)
_SIZE = [0] * 256  # the bytes of a fixed-size argument
for _code, _size in ((b"K", 1), (b"h", 1), (b"q", 1), (b"M", 2), (b"J", 4), (b"j", 4), (b"r", 4), (b"G", 8)):
    _SIZE[_code[0]] = _size
_TUPLE_N = {0x85: 1, 0x86: 2, 0x87: 3}


def _name(op: int) -> str:
    return f"opcode {chr(op)!r}" if 32 < op < 127 else f"opcode {op:#04x}"


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
    fence = 0  # where the newest MARK is: nothing pops below it
    push, size_of, push_of = stack.append, _SIZE, _PUSH
    i = 2
    while i < n:
        op = data[i]
        i += 1
        kind = push_of[op]
        if kind is not None:  # a value: skip its argument
            push(kind)
            if op == 0x58:  # BINUNICODE: a four-byte length
                i += 4 + int.from_bytes(data[i : i + 4], "little")
            elif op == 0x55 or op == 0x8A:  # SHORT_BINSTRING, LONG1: a one-byte length
                i += 1 + (data[i] if i < n else 0)
            else:
                i += size_of[op]
            continue
        if op == 0x71 or op == 0x72 or op == 0x68 or op == 0x6A:  # BINPUT, LONG_BINPUT, BINGET, LONG_BINGET
            size = size_of[op]
            index = int.from_bytes(data[i : i + size], "little")
            i += size
            if op >= 0x71:
                if index > len(memo):
                    _refuse("a memo index out of order")
                if len(stack) <= fence:
                    _refuse(f"{_name(op)} on nothing")
                if index == len(memo):
                    memo.append(stack[-1])
                else:
                    memo[index] = stack[-1]
            elif index < len(memo):
                push(memo[index])
            else:
                _refuse("a memo index read before it is written")
            continue
        if op == 0x28:  # MARK
            marks.append(len(stack))
            fence = len(stack)
            continue
        if op == 0x74 or op == 0x75 or op == 0x65:  # TUPLE, SETITEMS, APPENDS: pop to the MARK
            if not marks:
                _refuse(f"{_name(op)} without a MARK")
            start = marks.pop()
            count = len(stack) - start
            del stack[start:]
            fence = marks[-1] if marks else 0
            if op == 0x74:
                push(_TUPLE)
                continue
            if op == 0x75 and count % 2:
                _refuse("SETITEMS with a key and no value")
            target: tuple[str, ...] = (_DICT, _ORDERED) if op == 0x75 else (_LIST,)
        elif op == 0x63:  # GLOBAL: module and name, each ended by a newline
            j = data.find(b"\n", i)
            k = data.find(b"\n", j + 1) if j >= 0 else -1
            if k < 0:
                _refuse("a GLOBAL without its two lines")
            ordered = data[i:j] == b"collections" and data[j + 1 : k] == b"OrderedDict"
            push(_ORDERED_GLOBAL if ordered else _GLOBAL)
            i = k + 1
            continue
        elif op == 0x2E:  # STOP
            if marks or len(stack) != 1:
                _refuse("STOP with other than one object on the stack")
            return
        else:  # pops a fixed number, then pushes, or applies to what is below
            count = _POPS.get(op, -1)
            if count < 0:
                _refuse(_name(op))
            if len(stack) - count < fence:
                _refuse(f"{_name(op)}: a pop across a MARK or from an empty stack")
            popped = stack[len(stack) - count :]
            del stack[len(stack) - count :]
            if op in _TUPLE_N:
                push(_TUPLE)
                continue
            if op == 0x52:  # REDUCE
                func, args = popped
                if func not in (_GLOBAL, _ORDERED_GLOBAL) or args != _TUPLE:
                    _refuse(f"REDUCE of {func} with {args}")
                push(_ORDERED if func == _ORDERED_GLOBAL else _CALL)
                continue
            if op == 0x51:  # BINPERSID
                if popped != [_TUPLE]:
                    _refuse("a persistent id that is not a tuple")
                push(_PERSISTENT)
                continue
            target = {0x73: (_DICT, _ORDERED), 0x61: (_LIST,), 0x62: (_ORDERED,)}[op]  # SETITEM, APPEND, BUILD
        if len(stack) <= fence or stack[-1] not in target:
            _refuse(f"{_name(op)} on {stack[-1] if len(stack) > fence else 'nothing'}")
        if op == 0x62 and popped != [_DICT]:  # BUILD: an OrderedDict's __dict__, from a dict
            _refuse(f"BUILD on an OrderedDict() call with {popped[0]}")
    _refuse("no STOP")


_POPS = {0x85: 1, 0x86: 2, 0x87: 3, 0x52: 2, 0x51: 1, 0x73: 2, 0x61: 1, 0x62: 1}
