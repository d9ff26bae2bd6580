"""The resource bounds of a checkpoint file, checked before torch unpickles it.

A file can pass its CRC check and torch's weights-only rules and still be built to hurt: torch's
unpickler admits tuples, lists, dicts and sets, so ~40 nested tuples that share their parts make a dict
key or set element that takes 2^40 steps to hash (a 700-byte file); lists that share lists (a "billion
laughs") make every later walk of the state exponential; lists nested 10^5 deep end the walk in a
``RecursionError``; a list that holds itself makes it endless; and a 1 MB zip can declare a ``data.pkl``
of 1 GiB. Each would hang or crash the resume *after* the file was accepted, where nothing falls back.

:func:`check_file` reads the zip's directory and its ``data.pkl`` (nothing is unpickled) and refuses:

* a file that is not a zip (torch has written zip files since 1.6), or has no single ``*/data.pkl``;
* entries that declare more bytes than :data:`INFLATION` times the file (torch stores them uncompressed);
* a ``data.pkl`` over :data:`MAX_PICKLE_BYTES`;
* an object graph nested deeper than :data:`MAX_DEPTH`, one that refers to itself, or one that expands
  (every shared part counted each time it is used, as a walk or a hash visits it) to more than
  :data:`WORK_PER_BYTE` objects per byte of pickle, or :data:`WORK_FLOOR` for a small one.

A checkpoint Lightning writes nests about 8 deep and expands to a few objects per pickled byte. The
refusal raises :class:`~lplugins.callbacks._errors.UnsafeCheckpointError`, which the resume treats as it
treats what torch's weights-only load refuses: the file is skipped (left in place) and the next older one
is tried. Lightning-free.
"""

from __future__ import annotations

import copy
import os
import pickletools
import zipfile
from typing import Any, BinaryIO

from lplugins._errors import UnsafeCheckpointError

__all__ = ["INFLATION", "MAX_DEPTH", "MAX_PICKLE_BYTES", "WORK_FLOOR", "WORK_PER_BYTE", "check_file", "check_pickle"]

MAX_DEPTH = 100
MAX_PICKLE_BYTES = 256 * 2**20
WORK_PER_BYTE = 16
WORK_FLOOR = 1_000_000
INFLATION = 2


class _Bounds(Exception):
    """Why a pickle is refused (internal: :func:`check_file` turns it into an ``UnsafeCheckpointError``)."""


def check_file(path: Any, file: BinaryIO | None = None) -> None:
    """Refuse ``path`` before torch reads it when it exceeds a bound (see the module docstring).

    Args:
        path: The checkpoint file (named in the error).
        file: The file already opened (read from its start; left open), else ``path`` is opened.

    Raises:
        UnsafeCheckpointError: a bound exceeded, naming the file and the bound.
    """
    try:
        if file is None:
            with open(path, "rb") as opened:
                _check_zip(opened)
        else:
            file.seek(0)
            _check_zip(file)
    except _Bounds as why:
        raise UnsafeCheckpointError(
            f"Refusing to load checkpoint {os.fspath(path)!r}: {why} (nothing in it was unpickled; lplugins' bounds"
            ' for a checkpoint file, docs/checkpoint.md, "The directory is untrusted input").'
        ) from None


def _check_zip(file: BinaryIO) -> None:
    size = os.fstat(file.fileno()).st_size
    try:
        archive = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        raise _Bounds(f"it is not a zip file as torch.save writes ({err})") from None
    entries = archive.infolist()
    declared = sum(entry.file_size for entry in entries)
    if declared > INFLATION * size + 2**20:
        raise _Bounds(f"its zip entries declare {declared} bytes in a file of {size} bytes")
    pickles = [e for e in entries if e.filename.endswith("/data.pkl") and e.filename.count("/") == 1]
    if len(pickles) != 1:
        raise _Bounds(f"it holds {len(pickles)} top-level data.pkl entries, not one")
    if pickles[0].file_size > MAX_PICKLE_BYTES:
        raise _Bounds(f"its data.pkl declares {pickles[0].file_size} bytes (at most {MAX_PICKLE_BYTES})")
    entry_info = copy.copy(pickles[0])
    del entry_info.CRC  # torch writes records without CRC32s when asked (DurableCheckpoint's own CRC covers them)
    with archive.open(entry_info) as entry:  # reads at most the declared size
        data = entry.read(MAX_PICKLE_BYTES + 1)
    if len(data) > MAX_PICKLE_BYTES:
        raise _Bounds(f"its data.pkl is over {MAX_PICKLE_BYTES} bytes")
    check_pickle(data)


class _Node:
    """A container the pickle builds: what it holds (``None`` for a plain value), its expanded size and depth.

    Size and depth are kept as the container is built; ``used`` once it is put in another container: a
    container that grows after that (never in what torch.save writes) makes the whole graph measured again.
    """

    __slots__ = ("depth", "kids", "size", "used")

    def __init__(self, kids: list[_Node | None] | None = None) -> None:
        self.kids: list[_Node | None] = kids if kids is not None else []
        self.size, self.depth, self.used = 1, 0, False
        if kids:
            _add(self, kids)


class _State:
    """The bound of the pickle being read, and whether it must be measured again at the end."""

    limit = WORK_FLOOR
    late = False


def _add(node: _Node, items: list[_Node | None]) -> None:
    size, depth = node.size, node.depth
    for kid in items:
        if kid is None:
            size += 1
        else:
            if kid is node:
                raise _Bounds("an object in its data.pkl holds itself")
            kid.used = True
            size += kid.size
            if kid.depth >= depth:
                depth = kid.depth + 1
    if depth > MAX_DEPTH:
        raise _Bounds(f"its objects are nested more than {MAX_DEPTH} deep")
    if size > _State.limit:
        raise _Bounds(
            f"its objects expand to more than {_State.limit} (each shared part counted every time it is used,"
            " as hashing or walking the state visits it)"
        )
    node.size, node.depth = size, depth


_MAKE = {"TUPLE", "LIST", "DICT", "FROZENSET", "OBJ", "INST"}  # from the items since the MARK
_MAKE_N = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3, "BINPERSID": 1}
_ADD_N = {"APPEND": 1, "SETITEM": 2, "BUILD": 1}  # into the object below them
_ADD_MARK = {"APPENDS", "SETITEMS", "ADDITEMS"}  # the items since the MARK, into the object below it
_EMPTY = {"EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE"}
_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET = {"GET", "BINGET", "LONG_BINGET"}
_NOTHING = {"PROTO", "FRAME", "STOP", "NEXT_BUFFER", "READONLY_BUFFER"}


def check_pickle(data: bytes) -> None:
    """Refuse a pickle whose object graph is too deep, refers to itself, or expands past its work bound.

    Raises:
        _Bounds: a bound exceeded (the message names it, never the file's data).
    """
    _State.limit, _State.late = max(WORK_FLOOR, WORK_PER_BYTE * len(data)), False
    try:
        fast = _graph_v2(data) if data[:2] == b"\x80\x02" else _Fallback
        # another protocol, or an opcode the fast reader leaves to the general one
        root = _graph(data) if fast is _Fallback else fast
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise _Bounds(f"its data.pkl is not a well-formed pickle ({type(err).__name__})") from None
    if _State.late:
        assert not isinstance(root, type)
        _measure(root, _State.limit)


class _Fallback:
    """Returned by the fast reader for what only the general one reads."""


def _graph(data: bytes) -> _Node | None:
    """The object graph of any pickle, from :func:`pickletools.genops` (the general reader)."""
    stack: list[_Node | None] = []
    marks: list[int] = []
    memo: dict[int, _Node | None] = {}
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "MARK":
            marks.append(len(stack))
        elif name in _MAKE:
            start = marks.pop()
            node = _Node(stack[start:])
            del stack[start:]
            stack.append(node)
        elif name in _MAKE_N:
            count = _MAKE_N[name]
            node = _Node(stack[-count:])
            del stack[-count:]
            stack.append(node)
        elif name in _ADD_N:
            count = _ADD_N[name]
            items = stack[-count:]
            del stack[-count:]
            _into(stack[-1], items)
        elif name in _ADD_MARK:
            start = marks.pop()
            items = stack[start:]
            del stack[start:]
            _into(stack[-1], items)
        elif name in _EMPTY:
            stack.append(_Node())
        elif name in _PUT:
            memo[int(arg)] = stack[-1]  # type: ignore[arg-type]  # an int for the PUT opcodes
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in _GET:
            stack.append(memo[int(arg)])  # type: ignore[arg-type]  # an int for the GET opcodes
        elif name == "STACK_GLOBAL":
            del stack[-2:]
            stack.append(None)
        elif name == "POP":
            stack.pop()
        elif name == "POP_MARK":
            del stack[marks.pop() :]
        elif name == "DUP":
            stack.append(stack[-1])
        elif name not in _NOTHING:  # a value: a number, a string, a global, a persistent id...
            stack.append(None)
    if len(stack) != 1 or marks:
        raise _Bounds("its data.pkl does not end with exactly one object")
    return stack[0]


# The fast reader: protocol 2 as torch.save writes it, by byte code (about 5x faster than genops).
_VALUE_SIZE = [-1] * 256  # a value's argument: its size, or -2/-3 for a 4-/1-byte length before it
for _code, _size in ((b"N", 0), (b"\x88", 0), (b"\x89", 0), (b"K", 1), (b"M", 2), (b"J", 4), (b"G", 8)):
    _VALUE_SIZE[_code[0]] = _size
_VALUE_SIZE[ord("X")] = -2  # BINUNICODE
_VALUE_SIZE[ord("U")] = _VALUE_SIZE[0x8A] = -3  # SHORT_BINSTRING, LONG1
_EMPTY_CODES = frozenset(b")]}\x8f")
_POP_MAKE = {0x85: 1, 0x86: 2, 0x87: 3, ord("R"): 2, ord("Q"): 1}  # TUPLE1-3, REDUCE, BINPERSID
_POP_ADD = {ord("s"): 2, ord("a"): 1, ord("b"): 1}  # SETITEM, APPEND, BUILD


def _graph_v2(data: bytes) -> _Node | type[_Fallback] | None:
    """:func:`_graph` for protocol 2, or ``_Fallback`` at an opcode outside what torch.save writes."""
    n = len(data)
    stack: list[_Node | None] = []
    marks: list[int] = []
    memo: dict[int, _Node | None] = {}
    push = stack.append
    i = 2
    while i < n:
        op = data[i]
        i += 1
        size = _VALUE_SIZE[op]
        if size >= 0:
            push(None)
            i += size
        elif size == -2:
            push(None)
            i += 4 + int.from_bytes(data[i : i + 4], "little")
        elif size == -3:
            push(None)
            i += 1 + data[i]
        elif op == 0x71:  # BINPUT
            memo[data[i]] = stack[-1]
            i += 1
        elif op == 0x68:  # BINGET
            push(memo[data[i]])
            i += 1
        elif op == 0x72:  # LONG_BINPUT
            memo[int.from_bytes(data[i : i + 4], "little")] = stack[-1]
            i += 4
        elif op == 0x6A:  # LONG_BINGET
            push(memo[int.from_bytes(data[i : i + 4], "little")])
            i += 4
        elif op == 0x28:  # MARK
            marks.append(len(stack))
        elif op in _EMPTY_CODES:
            push(_Node())
        elif op == 0x74:  # TUPLE
            start = marks.pop()
            node = _Node(stack[start:])
            del stack[start:]
            push(node)
        elif op == 0x75 or op == 0x65:  # SETITEMS, APPENDS
            start = marks.pop()
            items = stack[start:]
            del stack[start:]
            _into(stack[-1], items)
        elif op in _POP_MAKE:
            count = _POP_MAKE[op]
            if len(stack) < count:
                raise IndexError
            node = _Node(stack[-count:])
            del stack[-count:]
            push(node)
        elif op in _POP_ADD:
            count = _POP_ADD[op]
            if len(stack) <= count:
                raise IndexError
            items = stack[-count:]
            del stack[-count:]
            _into(stack[-1], items)
        elif op == 0x63:  # GLOBAL: module and name, each ended by a newline
            j = data.index(b"\n", i)
            i = data.index(b"\n", j + 1) + 1
            push(None)
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks or i != n:
                raise _Bounds("its data.pkl does not end with exactly one object")
            return stack[0]
        else:
            return _Fallback
    raise _Bounds("its data.pkl has no STOP")


def _into(target: _Node | None, items: list[_Node | None]) -> None:
    if target is None:  # APPEND and friends on a plain value: torch's unpickler refuses it later
        raise _Bounds("its data.pkl adds items to something that is not a container")
    if target.used:  # inside another container already: the sizes kept are stale, measured again at the end
        _State.late = True
    target.kids.extend(items)
    _add(target, items)


def _measure(root: _Node | None, limit: int) -> None:
    """Depth and expanded size of the graph from ``root``, each shared node measured once (no recursion)."""
    if root is None:
        return
    done: dict[int, tuple[int, int]] = {}  # id -> (expanded size, depth)
    on_path: set[int] = set()
    todo: list[tuple[_Node, bool]] = [(root, False)]
    while todo:
        node, children_done = todo.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            size, depth = 1, 0
            for kid in node.kids:
                if kid is not None:
                    kid_size, kid_depth = done[id(kid)]
                    size += kid_size
                    depth = max(depth, kid_depth + 1)
                else:
                    size += 1
            if depth > MAX_DEPTH:
                raise _Bounds(f"its objects are nested more than {MAX_DEPTH} deep")
            if size > limit:
                raise _Bounds(
                    f"its objects expand to more than {limit} (each shared part counted every time it is used,"
                    " as hashing or walking the state visits it)"
                )
            done[key] = (size, depth)
            continue
        if key in done:
            continue
        if key in on_path:
            raise _Bounds("an object in its data.pkl holds itself")
        on_path.add(key)
        todo.append((node, True))
        if len(on_path) > MAX_DEPTH + 1:
            raise _Bounds(f"its objects are nested more than {MAX_DEPTH} deep")
        for kid in node.kids:
            if kid is not None and id(kid) not in done:
                if id(kid) in on_path:
                    raise _Bounds("an object in its data.pkl holds itself")
                todo.append((kid, False))
