"""The object graph of a pickle, read without unpickling it, and the bounds it must keep (see :mod:`lplugins._bounds`).

Every container the pickle builds becomes a :class:`_Node` that keeps its expanded size (each shared part
counted every time it is used, as a hash or a walk visits it) and its depth as it is built; plain values
are leaves: numbers and short strings as their values (a dict key's hash must be known to bound how many
keys share one), a marker for strings whose hash the process draws at random, and the callables torch allows
whose arguments decide what calling them costs. Two readers build the same graph: a fast one,
by byte code, for protocol 2 as ``torch.save`` writes it, and :func:`pickletools.genops` for the rest.
"""

from __future__ import annotations

import pickletools
import struct
from typing import Any

__all__ = ["Bounds", "check_pickle"]

MAX_DEPTH = 100
WORK_PER_BYTE = 16
WORK_FLOOR = 10_000_000
NODES_FLOOR = 2_000_000
#: How many keys of one dict or set may share one hash (numbers, tuples of them... can be chosen to collide).
MAX_SHARED_HASH_KEYS = 64


class Bounds(Exception):
    """Why a pickle is refused (the message names the bound, never the file's data)."""


class _Leaf:
    """A plain value whose kind matters (numbers and short strings are kept as their Python values)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


#: A value whose hash the process draws at random (a long string, bytes): no key of it can be made to collide.
_RANDOM = _Leaf("a string")
_TORCH = "torch."
#: Callables torch's weights-only unpickler allows whose arguments decide what calling them costs.
_KEYED = frozenset(
    f"{module}.{name}"
    for module in ("builtins", "__builtin__", "collections")
    for name in ("set", "frozenset", "dict", "Counter", "OrderedDict", "defaultdict")
)
_BYTEARRAY = frozenset({"builtins.bytearray", "__builtin__.bytearray"})
_COMPLEX = frozenset({"builtins.complex", "__builtin__.complex"})
_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"  # calls its first argument with its third
_WATCHED = _KEYED | _BYTEARRAY | _COMPLEX | {"_codecs.encode", "torch.Size", _FROM_TYPE}
_UNKNOWN_HASH = -1 - 2**64  # the bucket of keys whose hash cannot be known before loading


class _Fn(_Leaf):
    """A global that :data:`_WATCHED` names, or a legacy tensor constructor (``torch.FloatTensor``...)."""


class _Node:
    """A container the pickle builds: what it holds, its expanded size and depth, kept as it is built.

    ``used`` once it is put in another container: a container that grows after that (never in what
    torch.save writes) makes the whole graph measured again at the end.
    """

    __slots__ = ("depth", "hashes", "kids", "kind", "size", "used")

    def __init__(self, state: _State | None, kids: list[Any] | None = None, kind: str = "") -> None:
        self.kids: list[Any] = kids if kids is not None else []
        self.size, self.depth, self.used, self.kind = 1, 0, False, kind
        self.hashes: dict[int, int] | None = None  # as a dict or set: how many of its keys have each hash
        if state is None:  # a scratch counter of keys
            return
        state.nodes += 1
        if state.nodes > state.node_limit:
            raise Bounds(f"it builds more than {state.node_limit} containers")
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
        _count_hashes(target, keys)
    target.kids.extend(items)
    _add(state, target, items)


def _key_value(key: Any, depth: int = 0) -> Any:
    """The value of a key whose hash does not depend on the process (numbers, tuples and calls of them),
    ``_RANDOM`` when its hash is drawn at random per process, or ``_UNKNOWN_HASH`` when it cannot be known here."""
    if key is None or isinstance(key, (bool, int, float)):
        return key
    if key is _RANDOM or isinstance(key, bytes):
        return _RANDOM
    if key.__class__ is not _Node or depth > 4 or len(key.kids) > 64:
        return _UNKNOWN_HASH
    parts: list[Any] | None = None
    if key.kind == "tuple":
        parts = key.kids
    elif key.kind == "torch.Size" and len(key.kids) == 2 and key.kids[1].__class__ is _Node:
        inner = key.kids[1].kids
        parts = inner[0].kids if len(inner) == 1 and inner[0].__class__ is _Node else None
    elif key.kind in _COMPLEX and len(key.kids) == 2 and key.kids[1].__class__ is _Node:
        values = [_key_value(kid, depth + 1) for kid in key.kids[1].kids]
        if 1 <= len(values) <= 2 and all(isinstance(v, (int, float)) for v in values):
            return complex(*values)
        return _UNKNOWN_HASH
    if parts is None:
        return _UNKNOWN_HASH
    values = [_key_value(kid, depth + 1) for kid in parts]
    if any(v is _RANDOM for v in values):
        return _RANDOM
    return _UNKNOWN_HASH if any(v is _UNKNOWN_HASH for v in values) else tuple(values)


def _count_hashes(target: _Node, keys: list[Any]) -> None:
    """Keys of a dict or set: at most :data:`MAX_SHARED_HASH_KEYS` of them share one hash (or have one unknown)."""
    counts = target.hashes if target.hashes is not None else {}
    target.hashes = counts
    for key in keys:
        value = _key_value(key)
        if value is _RANDOM:
            continue
        try:
            digest = _UNKNOWN_HASH if value is _UNKNOWN_HASH else hash(value)
        except TypeError:  # nothing Python can hash: torch's unpickler refuses it
            digest = _UNKNOWN_HASH
        counts[digest] = counts.get(digest, 0) + 1
        if counts[digest] > MAX_SHARED_HASH_KEYS:
            raise Bounds(
                f"more than {MAX_SHARED_HASH_KEYS} keys of a dict or set of it share one hash (or have one that"
                " cannot be known before loading): building it would be quadratic"
            )


def _call(state: _State, fn: Any, args: Any) -> _Node:
    """``REDUCE``: ``fn(*args)``, checked when ``fn`` is a watched callable."""
    _check_call(fn, args, 0)
    return _Node(state, [fn, args], fn.name if fn.__class__ is _Fn else "")


def _check_call(fn: Any, args: Any, depth: int) -> None:
    if fn.__class__ is not _Fn:
        return
    kids = args.kids if args.__class__ is _Node else []
    name = fn.name
    if name == _FROM_TYPE and len(kids) >= 3 and depth < 4:  # (func, type, args, state): func(*args)
        _check_call(kids[0], kids[2], depth + 1)
    elif name in _BYTEARRAY:
        made_from = kids[0] if len(kids) == 1 else None
        if not (isinstance(made_from, bytes) or (made_from.__class__ is _Node and made_from.kind == "_codecs.encode")):
            raise Bounds("it calls bytearray with something else than bytes (a size allocates, a codec can be slow)")
    elif name == "_codecs.encode":
        if len(kids) != 2 or kids[1] not in (b"latin1", b"latin-1"):
            raise Bounds("it calls _codecs.encode with another encoding than latin1 (torch.save writes only that)")
    elif name in _KEYED and kids and kids[0].__class__ is _Node:
        first = kids[0]
        pairs = name.rsplit(".", 1)[1] in ("dict", "OrderedDict", "defaultdict")
        keys = [p.kids[0] for p in first.kids if p.__class__ is _Node and p.kids] if pairs else first.kids
        _count_hashes(_Node(None), keys)
    elif name.startswith(_TORCH) and name.endswith("Tensor") and any(isinstance(k, int) for k in kids):
        raise Bounds(f"it calls {name} with a size (a legacy constructor: it allocates)")


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
    if op in _INT_OPS or op in ("FLOAT", "BINFLOAT", "NONE"):
        return arg
    if op in ("NEWTRUE", "NEWFALSE"):
        return op == "NEWTRUE"
    if op in _STRING_OPS and isinstance(arg, str) and len(arg) <= 32:
        return arg.encode("utf-8", "replace")
    return _RANDOM if isinstance(arg, (str, bytes)) else None


def _global(name: str) -> Any:
    legacy = name.startswith(_TORCH) and name.endswith("Tensor") and name.count(".") == 1
    return _Fn(name) if name in _WATCHED or legacy else None


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
                node = _Node(state, items, "tuple" if name == "TUPLE" else "")
            stack.append(node)
        elif name == "REDUCE":
            args = stack.pop()
            stack.append(_call(state, stack.pop(), args))
        elif name in _MAKE_N:
            count = _MAKE_N[name]
            node = _Node(state, stack[-count:], "tuple" if name.startswith("TUPLE") else "")
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
            stack.append(_Node(state, None, "tuple" if name == "EMPTY_TUPLE" else ""))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[len(memo) if name == "MEMOIZE" else int(arg)] = stack[-1]  # type: ignore[arg-type]  # an int
            if len(memo) > state.node_limit:
                raise Bounds(f"it keeps more than {state.node_limit} objects in its memo")
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
_FLOAT = struct.Struct(">d")
_NUMBER = {ord("K"): 1, ord("M"): 2}
_POP_MAKE = {0x85: 1, 0x86: 2, 0x87: 3, ord("Q"): 1}  # TUPLE1-3, BINPERSID
_EMPTY_CODES = frozenset(b"]}\x8f")


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
            push(data[i + 4 : i + 4 + length] if length <= 32 else _RANDOM)
            i += 4 + length
        elif op in _NUMBER:
            push(int.from_bytes(data[i : i + _NUMBER[op]], "little"))
            i += _NUMBER[op]
        elif op == 0x4A:  # BININT
            push(int.from_bytes(data[i : i + 4], "little", signed=True))
            i += 4
        elif op == 0x28:  # MARK
            marks.append(len(stack))
        elif op == 0x74:  # TUPLE
            start = marks.pop()
            node = _Node(state, stack[start:], "tuple")
            del stack[start:]
            push(node)
        elif op in _POP_MAKE:
            count = _POP_MAKE[op]
            if len(stack) < count:
                raise IndexError
            node = _Node(state, stack[-count:], "tuple" if op != 0x51 else "")
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
        elif op == 0x29:  # EMPTY_TUPLE
            push(_Node(state, None, "tuple"))
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
            if len(memo) > state.node_limit:
                raise Bounds(f"it keeps more than {state.node_limit} objects in its memo")
        elif op == 0x6A:  # LONG_BINGET
            push(memo[int.from_bytes(data[i : i + 4], "little")])
            i += 4
        elif op == 0x47:  # BINFLOAT
            push(_FLOAT.unpack_from(data, i)[0])
            i += 8
        elif op == 0x8A:  # LONG1
            push(int.from_bytes(data[i + 1 : i + 1 + data[i]], "little", signed=True))
            i += 1 + data[i]
        elif op == 0x55:  # SHORT_BINSTRING
            push(_RANDOM)
            i += 1 + data[i]
        elif op == 0x4E:  # NONE
            push(None)
        elif op == 0x88 or op == 0x89:  # NEWTRUE, NEWFALSE
            push(op == 0x88)
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
