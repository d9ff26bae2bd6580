"""The object graph of a pickle, read without unpickling it, and the bounds it must keep (see :mod:`lplugins._bounds`).

Every container the pickle builds becomes a :class:`_Node` that keeps its expanded size (each shared part
counted every time it is used, as a hash or a walk visits it) and its depth as it is built; plain values
are leaves (``None``, or a marker where their kind matters: a number whose hash others can share, a short
string, a callable torch allows that can be made to hurt). Two readers build the same graph: a fast one,
by byte code, for protocol 2 as ``torch.save`` writes it, and :func:`pickletools.genops` for the rest.
"""

from __future__ import annotations

import pickletools
from typing import Any

__all__ = ["Bounds", "check_pickle"]

MAX_DEPTH = 100
WORK_PER_BYTE = 16
WORK_FLOOR = 10_000_000
NODES_FLOOR = 1_000_000
#: How many keys of one dict or set may be numbers whose hashes an attacker can make equal (large ints, floats).
MAX_SHARED_HASH_KEYS = 64


class Bounds(Exception):
    """Why a pickle is refused (the message names the bound, never the file's data)."""


class _Leaf:
    """A plain value whose kind matters."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


_NUM, _BIG = _Leaf("a number"), _Leaf("a number whose hash others can share")
#: Callables torch's weights-only unpickler allows whose arguments decide what calling them costs.
_KEYED = frozenset(
    f"{module}.{name}"
    for module in ("builtins", "__builtin__", "collections")
    for name in ("set", "frozenset", "dict", "Counter", "OrderedDict", "defaultdict")
)
_WATCHED = _KEYED | {"builtins.bytearray", "__builtin__.bytearray", "_codecs.encode"}


class _Fn(_Leaf):
    """A global that :data:`_WATCHED` names."""


class _Node:
    """A container the pickle builds: what it holds, its expanded size and depth, kept as it is built.

    ``used`` once it is put in another container: a container that grows after that (never in what
    torch.save writes) makes the whole graph measured again at the end.
    """

    __slots__ = ("big", "depth", "kids", "size", "used")

    def __init__(self, state: _State, kids: list[Any] | None = None) -> None:
        state.nodes += 1
        if state.nodes > state.node_limit:
            raise Bounds(f"it builds more than {state.node_limit} containers")
        self.kids: list[Any] = kids if kids is not None else []
        self.size, self.depth, self.used, self.big = 1, 0, False, 0
        if kids:
            _add(state, self, kids)


class _State:
    """The bounds of the pickle being read, and what was counted."""

    def __init__(self, length: int, node_limit: int) -> None:
        self.limit = max(WORK_FLOOR, WORK_PER_BYTE * length)
        self.node_limit = node_limit
        self.nodes = 0
        self.late = False


def _add(state: _State, node: _Node, items: list[Any]) -> None:
    size, depth = node.size, node.depth
    for kid in items:
        if kid.__class__ is _Node:
            if kid is node:
                raise Bounds("an object in its data.pkl holds itself")
            kid.used = True
            size += kid.size
            if kid.depth >= depth:
                depth = kid.depth + 1
        else:
            size += 1
    if depth > MAX_DEPTH:
        raise Bounds(f"its objects are nested more than {MAX_DEPTH} deep")
    if size > state.limit:
        raise Bounds(
            f"its objects expand to more than {state.limit} (each shared part counted every time it is used,"
            " as hashing or walking the state visits it)"
        )
    node.size, node.depth = size, depth


def _into(state: _State, target: Any, items: list[Any], keys: list[Any] | None = None) -> None:
    """``items`` added to ``target`` (``keys``: those of them that are dict keys or set elements)."""
    if target.__class__ is not _Node:  # APPEND and friends on a plain value: torch's unpickler refuses it later
        raise Bounds("its data.pkl adds items to something that is not a container")
    if target.used:  # inside another container already: the sizes kept are stale, measured again at the end
        state.late = True
    if keys:
        target.big += sum(1 for key in keys if key is _BIG)
        _shared_hashes(target.big)
    target.kids.extend(items)
    _add(state, target, items)


def _shared_hashes(count: int) -> None:
    if count > MAX_SHARED_HASH_KEYS:
        raise Bounds(
            f"a dict or set of it has more than {MAX_SHARED_HASH_KEYS} keys that are large numbers (numbers can be"
            " chosen to share one hash, which makes building it quadratic)"
        )


def _call(state: _State, fn: Any, args: Any) -> _Node:
    """``REDUCE``: ``fn(*args)``, checked when ``fn`` is a watched callable."""
    if fn.__class__ is _Fn:
        first = args.kids[0] if args.__class__ is _Node and args.kids else None
        if fn.name.endswith(".bytearray") and first.__class__ is _Leaf:
            raise Bounds("it calls bytearray with a size (it would allocate that many bytes)")
        if fn.name == "_codecs.encode":
            encoding = args.kids[-1] if args.__class__ is _Node and len(args.kids) == 2 else None
            if encoding not in (b"latin1", b"latin-1"):
                raise Bounds("it calls _codecs.encode with another encoding than latin1 (torch.save writes only that)")
        if fn.name in _KEYED:
            _shared_hashes(_big_within(args, 3))
    return _Node(state, [fn, args])


def _big_within(node: Any, depth: int) -> int:
    if node.__class__ is not _Node or depth == 0:
        return 1 if node is _BIG else 0
    return sum(_big_within(kid, depth - 1) for kid in node.kids)


def check_pickle(data: bytes, node_limit: int = NODES_FLOOR) -> None:
    """Refuse a pickle that is too deep, refers to itself, expands past its work bound or builds a costly call.

    Raises:
        Bounds: a bound exceeded.
    """
    state = _State(len(data), max(NODES_FLOOR, node_limit))
    try:
        fast = _graph_v2(state, data) if data[:2] == b"\x80\x02" else _Fallback
        if fast is _Fallback:  # another protocol, or an opcode the fast reader leaves to the general one
            state = _State(len(data), max(NODES_FLOOR, node_limit))
            root = _graph(state, data)
        else:
            root = fast
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        raise Bounds(f"its data.pkl is not a well-formed pickle ({type(err).__name__})") from None
    if state.late:
        _measure(root, state.limit)


class _Fallback:
    """Returned by the fast reader for what only the general one reads."""


_INT_OPS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"})
_STRING_OPS = frozenset({"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING"})
_MAKE = frozenset({"TUPLE", "LIST", "OBJ", "INST"})  # from the items since the MARK
_MAKE_N = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "NEWOBJ": 2, "NEWOBJ_EX": 3, "BINPERSID": 1}
_EMPTY = frozenset({"EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE"})
_NOTHING = frozenset({"PROTO", "FRAME", "STOP", "NEXT_BUFFER", "READONLY_BUFFER"})


def _value(op: str, arg: Any) -> Any:
    """The leaf for a value opcode of the general reader."""
    if op in _INT_OPS:
        return _BIG if isinstance(arg, int) and abs(arg) >= 2**61 - 1 else _NUM
    if op in ("FLOAT", "BINFLOAT"):
        return _BIG
    if op in _STRING_OPS and isinstance(arg, str) and len(arg) <= 32:
        return arg.encode("utf-8", "replace")
    return None


def _global(name: str) -> Any:
    return _Fn(name) if name in _WATCHED else None


def _graph(state: _State, data: bytes) -> Any:
    """The object graph of any pickle, from :func:`pickletools.genops` (the general reader)."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "MARK":
            marks.append(len(stack))
        elif name in _MAKE or name in ("DICT", "FROZENSET"):
            start = marks.pop()
            items = stack[start:]
            del stack[start:]
            if name in ("DICT", "FROZENSET"):
                node = _Node(state)
                _into(state, node, items, items[0::2] if name == "DICT" else items)
            else:
                node = _Node(state, items)
            stack.append(node)
        elif name == "REDUCE":
            args = stack.pop()
            stack.append(_call(state, stack.pop(), args))
        elif name in _MAKE_N:
            count = _MAKE_N[name]
            node = _Node(state, stack[-count:])
            del stack[-count:]
            stack.append(node)
        elif name in ("APPEND", "SETITEM", "BUILD"):
            count = 2 if name == "SETITEM" else 1
            items = stack[-count:]
            del stack[-count:]
            _into(state, stack[-1], items, items[:1] if name == "SETITEM" else None)
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            start = marks.pop()
            items = stack[start:]
            del stack[start:]
            keys = items[0::2] if name == "SETITEMS" else items if name == "ADDITEMS" else None
            _into(state, stack[-1], items, keys)
        elif name in _EMPTY:
            stack.append(_Node(state))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = stack[-1]  # type: ignore[arg-type]  # an int for the PUT opcodes
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[int(arg)])  # type: ignore[arg-type]  # an int for the GET opcodes
        elif name == "GLOBAL":
            stack.append(_global(str(arg).replace(" ", ".", 1)))
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            known = isinstance(module, bytes) and isinstance(attr, bytes)
            stack.append(_global(f"{module.decode()}.{attr.decode()}") if known else None)
        elif name == "POP":
            stack.pop()
        elif name == "POP_MARK":
            del stack[marks.pop() :]
        elif name == "DUP":
            stack.append(stack[-1])
        elif name not in _NOTHING:
            stack.append(_value(name, arg))
    if len(stack) != 1 or marks:
        raise Bounds("its data.pkl does not end with exactly one object")
    return stack[0]


# The fast reader: protocol 2 as torch.save writes it, by byte code (several times faster than genops).
_SKIP = [-1] * 256  # a value's argument: its size
for _code, _size in ((b"N", 0), (b"\x88", 0), (b"\x89", 0)):
    _SKIP[_code[0]] = _size
_NUMBER = {ord("K"): 1, ord("M"): 2, ord("J"): 4}
_POP_MAKE = {0x85: 1, 0x86: 2, 0x87: 3, ord("Q"): 1}  # TUPLE1-3, BINPERSID
_EMPTY_CODES = frozenset(b")]}\x8f")


def _graph_v2(state: _State, data: bytes) -> Any:
    """:func:`_graph` for protocol 2, or ``_Fallback`` at an opcode outside what torch.save writes."""
    n = len(data)
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    push = stack.append
    i = 2
    while i < n:
        op = data[i]
        i += 1
        if op == 0x71:  # BINPUT
            memo[data[i]] = stack[-1]
            i += 1
        elif op == 0x68:  # BINGET
            push(memo[data[i]])
            i += 1
        elif op == 0x58:  # BINUNICODE
            length = int.from_bytes(data[i : i + 4], "little")
            push(data[i + 4 : i + 4 + length] if length <= 32 else None)
            i += 4 + length
        elif op in _NUMBER:
            push(_NUM)
            i += _NUMBER[op]
        elif op == 0x28:  # MARK
            marks.append(len(stack))
        elif op == 0x74:  # TUPLE
            start = marks.pop()
            node = _Node(state, stack[start:])
            del stack[start:]
            push(node)
        elif op in _POP_MAKE:
            count = _POP_MAKE[op]
            if len(stack) < count:
                raise IndexError
            node = _Node(state, stack[-count:])
            del stack[-count:]
            push(node)
        elif op == 0x52:  # REDUCE
            args = stack.pop()
            push(_call(state, stack.pop(), args))
        elif op == 0x75 or op == 0x65:  # SETITEMS, APPENDS
            start = marks.pop()
            items = stack[start:]
            del stack[start:]
            _into(state, stack[-1], items, items[0::2] if op == 0x75 else None)
        elif op in _EMPTY_CODES:
            push(_Node(state))
        elif op == 0x73 or op == 0x61 or op == 0x62:  # SETITEM, APPEND, BUILD
            count = 2 if op == 0x73 else 1
            if len(stack) <= count:
                raise IndexError
            items = stack[-count:]
            del stack[-count:]
            _into(state, stack[-1], items, items[:1] if op == 0x73 else None)
        elif op == 0x72:  # LONG_BINPUT
            memo[int.from_bytes(data[i : i + 4], "little")] = stack[-1]
            i += 4
        elif op == 0x6A:  # LONG_BINGET
            push(memo[int.from_bytes(data[i : i + 4], "little")])
            i += 4
        elif op == 0x47:  # BINFLOAT
            push(_BIG)
            i += 8
        elif op == 0x8A:  # LONG1
            push(_BIG if data[i] >= 8 else _NUM)
            i += 1 + data[i]
        elif op == 0x55:  # SHORT_BINSTRING
            push(None)
            i += 1 + data[i]
        elif _SKIP[op] >= 0:
            push(None)
            i += _SKIP[op]
        elif op == 0x63:  # GLOBAL: module and name, each ended by a newline
            j = data.index(b"\n", i)
            k = data.index(b"\n", j + 1)
            push(_global(f"{data[i:j].decode('latin-1')}.{data[j + 1 : k].decode('latin-1')}"))
            i = k + 1
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks or i != n:
                raise Bounds("its data.pkl does not end with exactly one object")
            return stack[0]
        else:
            return _Fallback
    raise Bounds("its data.pkl has no STOP")


def _measure(root: Any, limit: int) -> None:
    """Depth and expanded size of the graph from ``root``, each shared node measured once (no recursion)."""
    if root.__class__ is not _Node:
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
                if kid.__class__ is _Node:
                    kid_size, kid_depth = done[id(kid)]
                    size += kid_size
                    depth = max(depth, kid_depth + 1)
                else:
                    size += 1
            if depth > MAX_DEPTH:
                raise Bounds(f"its objects are nested more than {MAX_DEPTH} deep")
            if size > limit:
                raise Bounds(
                    f"its objects expand to more than {limit} (each shared part counted every time it is used,"
                    " as hashing or walking the state visits it)"
                )
            done[key] = (size, depth)
            continue
        if key in done:
            continue
        on_path.add(key)
        todo.append((node, True))
        if len(on_path) > MAX_DEPTH + 1:
            raise Bounds(f"its objects are nested more than {MAX_DEPTH} deep")
        for kid in node.kids:
            if kid.__class__ is _Node and id(kid) not in done:
                if id(kid) in on_path:
                    raise Bounds("an object in its data.pkl holds itself")
                todo.append((kid, False))
