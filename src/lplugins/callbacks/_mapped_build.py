"""The fast verified load: a checkpoint file's tensors built straight onto its memory-mapped pages.

:func:`fast_mapped_load` gives what ``torch.load(path, mmap=True, weights_only=True)`` gives for the
files torch itself writes with ``torch.save`` (plain CPU tensors and parameters, Python's plain data,
``OrderedDict`` with its ``_metadata``, dtypes, ``torch.Size``, ``torch.device``, bytes and sets), about
twice as fast on a checkpoint of many small tensors (8 ms against 18 ms for 304 tensors): torch's
weights-only unpickler is pure Python and its storage loading goes through fake-mode and device hooks
per tensor; here C ``pickle`` parses
the bytes into inert records (:mod:`~lplugins.callbacks._inert_pickle`, where nothing the file names is
called or looked up), and this module turns them into objects, each kind by its own checked builder
from an explicit allow-list, every argument's type and range checked as torch's rebuild functions would
use it, each tensor a view of the file's mapped pages (``MAP_PRIVATE``, as ``torch.load(mmap=True)``).

Anything outside that list (another global, a ``BUILD`` or ``SETITEM`` on anything but an
``OrderedDict``, a tensor with hooks or metadata, quantized or sparse storage, a legacy or TorchScript
file, a big-endian file, objects nested more than 100 deep, torch set to map files shared or to compute
storage offsets from the zip headers) makes it return ``None``, and the caller loads the file through torch's own
weights-only unpickler, which then accepts or refuses it by its own rules. So this path never accepts
what torch would refuse, and what it accepts comes out as torch would build it.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
from collections import OrderedDict
from typing import Any

from lplugins.callbacks._inert_pickle import NO_STATE, Call, Global, ListPrefix, Persistent, Refused, read_inert

__all__ = ["fast_mapped_load"]

log = logging.getLogger(__name__)

_PLAIN = frozenset({str, int, float, bool, type(None), bytes})
_MAX_DEPTH = 100  # a Lightning checkpoint nests about 8 deep; deeper files load through torch's own unpickler


def _tables() -> tuple[dict[str, Any], dict[str, Any], frozenset[tuple[str, str]]]:
    """Storage types and dtypes by the names a torch pickle gives them, and every global allowed."""
    import torch

    storages = {
        name: dtype
        for dtype, name in torch.storage._dtype_to_storage_type_map().items()
        if not name.startswith(("QInt", "QUInt"))  # quantized storages rebuild differently
    }
    dtypes = {str(dtype).removeprefix("torch."): dtype for dtype in torch.storage._dtype_to_storage_type_map()}
    dtypes.update({str(dtype).removeprefix("torch."): dtype for dtype in torch.storage._new_dtypes()})
    allowed = {
        ("collections", "OrderedDict"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("_codecs", "encode"),
        ("builtins", "set"),
        ("torch", "Size"),
        ("torch", "device"),
    }
    allowed.update(("torch", name) for name in [*storages, *dtypes])
    return storages, dtypes, frozenset(allowed)


_TABLES: tuple[dict[str, Any], dict[str, Any], frozenset[tuple[str, str]]] | None = None


def fast_mapped_load(path: str) -> Any | None:
    """``torch.load(path, mmap=True, weights_only=True)`` with every storage kept on the CPU, or ``None``.

    ``None`` means the file holds something this path does not build (see the module docstring): load
    it with torch's own weights-only unpickler instead.
    """
    global _TABLES
    import torch

    if sys.byteorder != "little":  # pragma: no cover -- every platform torch ships wheels for
        return None
    if torch._guards.detect_fake_mode(None) is not None or torch.serialization._serialization_tls.skip_data:
        return None  # torch builds fake or empty storages there
    if torch.serialization.get_default_mmap_options() != mmap.MAP_PRIVATE or _storage_offsets_from_headers():
        return None  # a shared mapping, or offsets torch computes from the zip headers: torch's own load decides
    if _TABLES is None:
        _TABLES = _tables()
    storages, dtypes, allowed = _TABLES
    try:
        with open(path, "rb") as file:
            if file.read(4) != b"PK\x03\x04":
                return None  # not a zip archive (a legacy torch file, a safetensors file)
        reader: Any = torch._C.PyTorchFileReader(path)
        if reader.has_record("constants.pkl") or not reader.has_record("byteorder"):
            return None  # TorchScript, or written before torch recorded the byte order
        if reader.get_record("byteorder") != b"little":
            return None
        tree = read_inert(reader.get_record("data.pkl"), allowed)
        size = os.path.getsize(path)
        whole = torch.UntypedStorage.from_file(path, False, size)
        return _Builder(reader, whole, size, storages, dtypes).build(tree)
    except Exception as why:  # Refused, or torch's complaint (not a zip, a missing record, out of bounds)
        log.debug("lplugins: %s loads through torch's weights-only unpickler (%s: %s)", path, type(why).__name__, why)
        return None


def _storage_offsets_from_headers() -> bool:
    """Whether torch is set to compute storage offsets from the zip headers (then it, not this path, loads)."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # pragma: no cover -- a torch without the setting
        return False
    return bool(config.load.calculate_storage_offsets)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not tuple or any(type(v) is not int or v < 0 for v in value):
        raise Refused(f"{what} is {type(value).__name__}, not a tuple of non-negative ints")
    return value


def _no_hooks(node: Any) -> None:
    """A tensor's ``backward_hooks`` argument must be the empty ``OrderedDict()`` torch writes."""
    if not (
        type(node) is Call
        and (node.func.module, node.func.name) == ("collections", "OrderedDict")
        and node.args == ()
        and not node.items
        and node.state is NO_STATE
    ):
        raise Refused("a tensor with backward hooks")


class _Builder:
    """Turns :func:`read_inert`'s records into objects; shared and cyclic references kept as pickled."""

    def __init__(self, reader: Any, whole: Any, size: int, storages: dict[str, Any], dtypes: dict[str, Any]) -> None:
        self._reader = reader
        self._whole = whole
        self._size = size
        self._storage_dtypes = storages
        self._dtypes = dtypes
        self._built: dict[int, Any] = {}  # id(record or container) -> what it became
        self._building: set[int] = set()  # tuples and calls under construction (a cycle through one: refused)
        self._storages: dict[str, tuple[Any, Any]] = {}  # key -> (untyped storage, dtype)
        self._depth = 0

    def build(self, node: Any) -> Any:
        kind = type(node)
        if kind in _PLAIN:
            return node
        key = id(node)
        if key in self._built:
            return self._built[key]
        if key in self._building:
            raise Refused("a reference cycle through a tuple or a call")
        # recursion: bounded here, not by the interpreter's limit (raised high, C frames could overflow the stack)
        self._depth += 1
        try:
            if self._depth > _MAX_DEPTH:
                raise Refused(f"objects nested more than {_MAX_DEPTH} deep")
            return self._new(node, kind, key)
        finally:
            self._depth -= 1

    def _new(self, node: Any, kind: type, key: int) -> Any:
        if kind is list:
            out: Any = []
            self._built[key] = out
            out.extend(v if type(v) in _PLAIN else self.build(v) for v in node)
            return out
        if kind is dict:
            out = {}
            self._built[key] = out
            for k, v in node.items():
                out[self._key(k)] = v if type(v) in _PLAIN else self.build(v)
            return out
        self._building.add(key)
        if kind is tuple:
            out = tuple(v if type(v) in _PLAIN else self.build(v) for v in node)
        elif kind is set and not node:
            out = set()
        elif kind is Call:
            out = self._call(node)
        elif kind is Global and node.module == "torch" and node.name in self._dtypes:
            out = self._dtypes[node.name]
        else:
            raise Refused(f"a {kind.__name__}")
        self._building.discard(key)
        self._built[key] = out
        return out

    def _key(self, node: Any) -> Any:
        built = node if type(node) in _PLAIN else self.build(node)
        if type(built) is tuple and all(type(v) in _PLAIN for v in built):
            return built
        if type(built) not in _PLAIN:
            raise Refused(f"a dict key of type {type(built).__name__}")
        return built

    def _call(self, node: Call) -> Any:
        name = node.func.name
        if node.func.module == "collections":  # OrderedDict: its items and __dict__ (``_metadata``) may follow
            return self._ordered_dict(node)
        if node.items or node.state is not NO_STATE:
            raise Refused(f"SETITEM or BUILD on a call of {node.func.module}.{name}")
        if name == "_rebuild_tensor_v2":
            return self._tensor(*node.args) if len(node.args) == 6 else _refuse_args(node)
        if name == "_rebuild_parameter":
            return self._parameter(*node.args) if len(node.args) == 3 else _refuse_args(node)
        if name == "set" and len(node.args) == 1 and type(node.args[0]) is ListPrefix:
            given = node.args[0]
            return set(self.build(given.items)[: given.length])  # the items it held at the call
        args = [v if type(v) in _PLAIN else self.build(v) for v in node.args]
        import torch

        if name == "encode" and len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
            return args[0].encode("latin1")
        if name == "Size" and len(args) == 1:
            return torch.Size(_ints(args[0], "torch.Size"))
        if name == "device" and len(args) in (1, 2) and type(args[0]) is str:
            if len(args) == 2 and type(args[1]) is not int:
                _refuse_args(node)
            return torch.device(*args)
        return _refuse_args(node)

    def _ordered_dict(self, node: Call) -> OrderedDict[Any, Any]:
        if node.args != ():
            _refuse_args(node)
        out: OrderedDict[Any, Any] = OrderedDict()
        self._built[id(node)] = out  # before the items: they may refer back to it
        self._building.discard(id(node))
        for k, v in node.items:
            out[self._key(k)] = v if type(v) in _PLAIN else self.build(v)
        if node.state is not NO_STATE:
            state = self.build(node.state)
            if type(state) is not dict or any(type(k) is not str for k in state):
                raise Refused("BUILD on an OrderedDict with a state that is not a dict of names")
            out.__dict__.update(state)
        return out

    def _storage(self, node: Any) -> tuple[Any, Any]:
        pid = node.pid if type(node) is Persistent else None
        # the messages name types, never the file's values (a shared list's repr can be exponential)
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise Refused(f"a storage argument of type {type(pid).__name__}")
        _, kind, key, location, numel = pid
        if type(key) is not str or type(location) is not str or type(numel) is not int or numel < 0:
            raise Refused("a storage record whose key, location or size is not of its type")
        if type(kind) is not Global or kind.module != "torch" or kind.name not in self._storage_dtypes:
            raise Refused(f"a storage whose type is {type(kind).__name__}, not an allowed torch storage")
        found = self._storages.get(key)
        if found is None:
            dtype = self._storage_dtypes[kind.name]
            nbytes = numel * dtype.itemsize
            offset = self._reader.get_record_offset(f"data/{key}")
            if offset < 0 or offset + nbytes > self._size:
                raise Refused("a storage that lies outside the file")
            found = self._storages[key] = (self._whole[offset : offset + nbytes], dtype)
        return found

    def _tensor(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any) -> Any:
        import torch

        untyped, dtype = self._storage(storage)
        if type(offset) is not int or offset < 0 or type(requires_grad) is not bool:
            raise Refused("a tensor's offset or requires_grad")
        size, stride = _ints(size, "size"), _ints(stride, "stride")
        if len(size) != len(stride):
            raise Refused("a size and a stride that differ in length")
        _no_hooks(hooks)
        tensor = torch.empty((0,), dtype=dtype).set_(untyped, offset, size, stride)  # set_ checks the bounds
        if requires_grad:
            tensor.requires_grad = True
        tensor._backward_hooks = self._empty_ordered_dict(hooks)
        return tensor

    def _empty_ordered_dict(self, node: Call) -> OrderedDict[Any, Any]:
        """What ``build`` makes of a record :func:`_no_hooks` accepted (an ``OrderedDict()``), without its detour."""
        out = self._built.get(id(node))
        if out is None:
            out = self._built[id(node)] = OrderedDict()
        return out

    def _parameter(self, data: Any, requires_grad: Any, hooks: Any) -> Any:
        import torch

        tensor = self.build(data)
        if type(tensor) is not torch.Tensor or type(requires_grad) is not bool:
            raise Refused("a parameter's data or requires_grad")
        _no_hooks(hooks)
        param = torch.nn.Parameter(tensor, requires_grad)
        param._backward_hooks = self._empty_ordered_dict(hooks)
        return param


def _refuse_args(node: Call) -> Any:
    raise Refused(f"a call of {node.func.module}.{node.func.name} with {len(node.args)} arguments")
