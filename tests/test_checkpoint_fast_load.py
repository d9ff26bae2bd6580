"""The fast verified load builds what ``torch.load(mmap=True, weights_only=True)`` builds, and never more.

Equivalence: files written by ``torch.save`` (and by a real fit) come out with the same types, values,
strides, sharing and attributes as torch's own weights-only load. Safety: hostile pickles (a code
payload, ``BUILD`` on an allowed function, ``SETITEM`` on a tensor, a forged memo index, legacy and
TorchScript files) are not built by the fast path: it returns ``None`` without running or changing
anything, and the caller's torch load refuses what torch refuses.
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._errors import UnsafeCheckpointError
from lplugins.callbacks._inert_pickle import Refused, read_inert, scan
from lplugins.callbacks._mapped_build import fast_mapped_load
from lplugins.callbacks._safe_io import mapped_load
from tests.models import Regression, regression_loader

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def same(a: Any, b: Any, seen: dict[int, int] | None = None, path: str = "") -> None:
    """``a`` and ``b`` equal in type, value, tensor layout, attributes and the pattern of shared objects."""
    seen = {} if seen is None else seen
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
        assert a.requires_grad == b.requires_grad and type(a._backward_hooks) is type(b._backward_hooks), path
        assert torch.equal(a.detach(), b.detach()), path
        pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
        assert seen.setdefault(pa, pb) == pb, f"{path}: storage shared differently"
        return
    if isinstance(a, (list, tuple, dict, set)):
        assert seen.setdefault(id(a), id(b)) == id(b), f"{path}: shared differently"
        if seen.get(-id(a)):
            return  # already compared (a cycle or a shared object)
        seen[-id(a)] = 1
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], seen, f"{path}.{k}")
        assert getattr(a, "__dict__", {}).keys() == getattr(b, "__dict__", {}).keys(), path
        for k, v in getattr(a, "__dict__", {}).items():
            same(v, b.__dict__[k], seen, f"{path}@{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, seen, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def both(path: Path) -> tuple[Any, Any]:
    fast = fast_mapped_load(str(path))
    assert fast is not None, "the fast path refused a file torch.save wrote"
    return fast, torch.load(path, mmap=True, weights_only=True, map_location=lambda s, _: s)


def saved(tmp_path: Path, obj: Any) -> Path:
    path = tmp_path / "state.ckpt"
    torch.save(obj, path)
    return path


def test_a_state_of_every_kind_of_tensor_and_plain_data_builds_as_torch_builds_it(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    shared: list[Any] = [1, "x"]
    cyclic: list[Any] = [0]
    cyclic.append(cyclic)
    state = {
        "state_dict": model.state_dict(),  # an OrderedDict with _metadata
        "view": base[1:, ::2],  # an offset, non-contiguous view of the same storage as "base"
        "base": base,
        "transposed": base.t(),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "dtypes": [
            torch.ones(3, dtype=d) for d in (torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8)
        ],
        "complex": torch.tensor([1 + 2j], dtype=torch.complex64),
        "param": torch.nn.Parameter(torch.randn(2, 2)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "grad": torch.randn(3).requires_grad_(),
        "plain": {"a": 1, "b": 2.5, "c": None, "d": True, "e": b"\x00\xffbytes", 3: (1, 2), (1, "k"): "tuple key"},
        "set": {1, 2, 3},
        "empty_set": set(),
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "dtype": torch.bfloat16,
        "shared": [shared, shared],
        "cyclic": cyclic,
        "big_int": 2**80,
        "text": "ünïcode",
    }
    fast, stock = both(saved(tmp_path, state))
    same(fast, stock)
    assert fast["view"].untyped_storage().data_ptr() == fast["base"].untyped_storage().data_ptr()
    assert fast["cyclic"][1] is fast["cyclic"] and fast["shared"][0] is fast["shared"][1]
    assert isinstance(fast["param"], torch.nn.Parameter) and not fast["frozen"].requires_grad


def test_a_checkpoint_from_a_real_fit_builds_as_torch_builds_it_and_the_verified_resume_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_everything(5, verbose=False)
    durable = DurableCheckpoint(tmp_path, every_n_steps=2, save_on_train_end=False)
    trainer = Trainer(callbacks=[durable], max_steps=2, **QUIET)
    model = Regression(hidden=[16], optimizer="adam")
    trainer.fit(model, regression_loader(16, batch_size=4))
    path = Path(durable.committed[-1])
    fast, stock = both(path)
    same(fast, stock)
    assert fast["optimizer_states"][0]["state"], "Adam's moments are in the file"

    built: list[str] = []
    import lplugins.callbacks._safe_io as safe_io

    monkeypatch.setattr(safe_io, "fast_mapped_load", lambda p: built.append(p) or fast_mapped_load(p))
    durable.setup(trainer, model, "fit")
    try:
        loaded = trainer.strategy.checkpoint_io.load_checkpoint("latest")
    finally:
        durable.teardown(trainer, model, "fit")
    assert built == [str(path)]
    same(loaded, stock)


def zip_with_pickle(tmp_path: Path, data: bytes, tensors: int = 1) -> Path:
    """A torch zip archive (as ``torch.save`` writes it) whose ``data.pkl`` is replaced by ``data``."""
    source = saved(tmp_path, [torch.zeros(4) for _ in range(tensors)])
    target = tmp_path / "forged.ckpt"
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            body = data if item.filename.endswith("/data.pkl") else zin.read(item)
            zout.writestr(item, body)
    return target


class Payload:
    """Unpickling this runs ``os.system`` (the classic code-execution pickle)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_code_payload_is_never_run_and_the_load_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = zip_with_pickle(tmp_path, pickle.dumps({"x": Payload(marker)}, protocol=2))
    assert fast_mapped_load(str(path)) is None
    with pytest.raises(UnsafeCheckpointError):
        mapped_load(str(path))
    assert not marker.exists()


def test_build_on_an_allowed_function_changes_nothing_in_torch(tmp_path: Path) -> None:
    original = torch._utils._rebuild_tensor_v2.__dict__.copy()
    # GLOBAL torch._utils _rebuild_tensor_v2, then BUILD with (None, {"owned": 1}): set an attribute on the function
    data = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}X\x05\x00\x00\x00ownedK\x01s\x86b."
    with pytest.raises(Refused, match="'b' on a global"):
        read_inert(data, frozenset({("torch._utils", "_rebuild_tensor_v2")}))
    assert fast_mapped_load(str(zip_with_pickle(tmp_path, data))) is None
    assert torch._utils._rebuild_tensor_v2.__dict__ == original


def torch_saved_pickle(tmp_path: Path, obj: Any) -> bytes:
    """The ``data.pkl`` ``torch.save`` writes for ``obj``."""
    with zipfile.ZipFile(saved(tmp_path, obj)) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def test_setitem_on_a_tensor_is_refused_and_the_file_keeps_its_bytes(tmp_path: Path) -> None:
    good = torch_saved_pickle(tmp_path, torch.zeros(4))
    assert good.endswith(b"Rq\x0b.")  # the tensor: REDUCE, BINPUT 11, STOP
    forged = good[:-1] + b"K\x00G" + struct.pack(">d", 7.0) + b"s."  # tensor[0] = 7.0, on the mapped pages
    path = zip_with_pickle(tmp_path, forged)
    before = path.read_bytes()
    assert fast_mapped_load(str(path)) is None
    with pytest.raises(UnsafeCheckpointError, match="Refusing to load"):  # torch refuses it too
        mapped_load(str(path))
    assert path.read_bytes() == before


def test_a_forged_memo_index_is_refused_before_c_pickle_allocates_for_it() -> None:
    forged = b"\x80\x02Nr" + (2**30).to_bytes(4, "little") + b"."
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(Refused, match="memo index out of order"):
        scan(forged)
    with pytest.raises(Refused, match="memo index out of order"):
        read_inert(forged, frozenset())
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB: not the 8 GiB table


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (pickle.dumps({"a": 1}, protocol=4), "protocol 2"),
        (b"\x80\x02\x8c\x01a.", "opcode 0x8c"),  # SHORT_BINUNICODE: not an opcode torch's unpickler runs
        (b"\x80\x02N", "no STOP"),
        (b"\x80\x02cN\nK\nc", "GLOBAL without its two lines"),  # once looped for ever
        (b"\x80\x02ccollections\nOrderedDict\n)RNb.", "BUILD on an OrderedDict.. call with a plain value"),
        (b"\x80\x02ctorch\nSize\n)R}b.", "'b' on a call"),  # BUILD on a tensor, a Size: only OrderedDict
        (b"\x80\x02)Q}b.", "'b' on a persistent id"),
        (b"\x80\x02}K\x01a.", "'a' on a dict"),  # APPEND only on a list
        (b"\x80\x02]K\x01K\x02s.", "'s' on a list"),  # SETITEM only on a dict or an OrderedDict()
        (b"\x80\x02ctorch\nSize\n)RK\x01K\x02s.", "'s' on a call"),
        (b"\x80\x02])R.", "REDUCE of a list"),  # REDUCE only calls a global
        (b"\x80\x02K\x01Q.", "persistent id that is not a tuple"),
        (b"\x80\x02h\x00.", "read before it is written"),
        (b"\x80\x02Nq\x01.", "out of order"),
        (b"\x80\x02(K\x01\x86.", "pop across a MARK"),
        (b"\x80\x02NN.", "STOP with other than one object"),
        (b"\x80\x02ctorch\nSize\n)\x81.", "opcode 0x81"),  # NEWOBJ: the fast load builds no class
    ],
)
@pytest.mark.timeout(10)
def test_the_scan_refuses_what_torchs_weights_only_unpickler_would_not_read(data: bytes, why: str) -> None:
    with pytest.raises(Refused, match=why):
        scan(data)
    with pytest.raises(Refused):
        read_inert(data, frozenset({("collections", "OrderedDict"), ("torch", "Size")}))


def test_a_refusal_names_kinds_never_the_files_values(tmp_path: Path) -> None:
    # 60 levels of a list holding the level below twice: its repr would be 2**60 pairs of brackets
    nested: list[Any] = []
    for _ in range(60):
        nested = [nested, nested]

    class WithPid(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", nested, "0", "cpu", 4) if obj is marker else None

    marker = object()
    for tree in ({"t": marker}, {"size": nested}):
        stream = io.BytesIO()
        WithPid(stream, protocol=2).dump(tree)
        path = zip_with_pickle(tmp_path, stream.getvalue())
        with pytest.raises(Refused) as refused:
            fast_mapped_load_or_refusal(path)
        assert len(str(refused.value)) < 200


def fast_mapped_load_or_refusal(path: Path) -> Any:
    """Build ``path`` as the fast load does, but raise its refusal instead of returning ``None``."""
    from lplugins.callbacks import _mapped_build

    reader = torch._C.PyTorchFileReader(str(path))
    storages, dtypes, allowed = _mapped_build._tables()
    tree = read_inert(reader.get_record("data.pkl"), allowed)
    whole = torch.UntypedStorage.from_file(str(path), False, path.stat().st_size)
    built = _mapped_build._Builder(reader, whole, path.stat().st_size, storages, dtypes).build(tree)
    if isinstance(built, dict) and "size" in built:
        _mapped_build._ints(built["size"], "size")
    return built


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # [OrderedDict() BUILT with a dict that gains a key after the BUILD, that dict]: __dict__ stays empty
        (b"\x80\x02](ccollections\nOrderedDict\n)Rq\x00}q\x01bh\x01X\x01\x00\x00\x00kK\x01se.", "od"),
        # [set(a list), the list after an APPEND]: the set is made from the list as it was at the call
        (b"\x80\x02](cbuiltins\nset\n]q\x00\x85Rh\x00K\x01ae.", "set"),
    ],
)
def test_what_an_opcode_gave_a_record_is_kept_as_it_was_then(tmp_path: Path, data: bytes, expected: str) -> None:
    fast, torchs = both(zip_with_pickle(tmp_path, data))
    same(fast, torchs)
    if expected == "od":
        assert torchs[0].__dict__ == {} and torchs[1] == {"k": 1}
    else:
        assert torchs == [set(), [1]]


def test_a_persistent_id_or_a_second_build_never_takes_state() -> None:
    from lplugins.callbacks._inert_pickle import Call, Global, Persistent

    with pytest.raises(Refused, match="persistent id"):
        Persistent(("storage",)).__setstate__({})
    call = Call(Global("collections", "OrderedDict"), ())
    call.__setstate__({"_metadata": {}})
    with pytest.raises(Refused, match="second BUILD"):
        call.__setstate__({"_metadata": {}})
    with pytest.raises(Refused, match="without a dict"):
        Call(Global("collections", "OrderedDict"), ()).__setstate__(None)


def test_legacy_torchscript_and_foreign_files_fall_back_to_torchs_own_load(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert fast_mapped_load(str(legacy)) is None
    assert torch.equal(mapped_load(str(legacy))["w"], torch.ones(2))

    script = tmp_path / "script.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), script)
    assert fast_mapped_load(str(script)) is None
    with pytest.raises(Exception, match="TorchScript"):
        mapped_load(str(script))

    other = tmp_path / "other.ckpt"
    other.write_bytes(b"not a checkpoint")
    assert fast_mapped_load(str(other)) is None


def test_a_global_outside_the_allow_list_is_left_to_torch_which_decides(tmp_path: Path) -> None:
    path = saved(tmp_path, {"counter": __import__("collections").Counter(a=1)})  # torch allows Counter; we don't
    assert fast_mapped_load(str(path)) is None
    assert mapped_load(str(path))["counter"] == {"a": 1}


def test_a_tensor_reaching_past_its_storage_is_not_built(tmp_path: Path) -> None:
    good = torch_saved_pickle(tmp_path, torch.zeros(4))
    forged = good.replace(b"K\x04\x85", b"M\x90\x01\x85", 1)  # size (4,) -> (400,) over a storage of 4 floats
    assert forged != good
    path = zip_with_pickle(tmp_path, forged)
    assert fast_mapped_load(str(path)) is None
    with pytest.raises(RuntimeError, match=r"not resizable|out of bounds"):
        torch.load(path, mmap=True, weights_only=True)


def test_the_inert_reader_keeps_what_opcodes_set_on_a_call_as_records() -> None:
    ordered = OrderedDict(a=1)
    ordered._metadata = {"k": 2}  # type: ignore[attr-defined]
    tree = read_inert(pickle.dumps(ordered, protocol=2), frozenset({("collections", "OrderedDict")}))
    assert (tree.func.module, tree.func.name, tree.args, tree.items) == ("collections", "OrderedDict", (), [("a", 1)])
    assert tree.state == {"_metadata": {"k": 2}}
    stream = io.BytesIO()
    pickle.dump(ordered, stream, protocol=2)
    with pytest.raises(Refused, match=r"collections\.OrderedDict"):
        read_inert(stream.getvalue(), frozenset())


def test_one_list_given_to_many_calls_costs_its_size_once_not_per_call(tmp_path: Path) -> None:
    # a memoized list of 2000 items, given to set() 500 times: copies would hold a million references
    data = b"\x80\x02](cbuiltins\nset\nq\x00]q\x01(" + b"N" * 2000 + b"e\x85R" + b"h\x00h\x01\x85R" * 499 + b"e."
    path = zip_with_pickle(tmp_path, data)
    fast, torchs = both(path)
    same(fast, torchs)
    assert len(fast) == 500 and fast[0] == {None}
    from lplugins.callbacks._inert_pickle import Call, ListPrefix

    tree = read_inert(data, frozenset({("builtins", "set")}))
    given = [call.args[0] for call in tree if type(call) is Call]
    assert all(type(g) is ListPrefix and g.items is given[0].items and g.length == 2000 for g in given)


def test_nesting_deeper_than_the_builder_goes_is_left_to_torch(tmp_path: Path) -> None:
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # as a program may: the builder's own bound must hold, not the interpreter's
    try:
        deep = b"\x80\x02" + b"]" * 500 + b"a" * 499 + b"."
        path = zip_with_pickle(tmp_path, deep)
        assert fast_mapped_load(str(path)) is None
    finally:
        sys.setrecursionlimit(limit)
    loaded = mapped_load(str(path))
    for _ in range(499):
        (loaded,) = loaded
    assert loaded == []


def test_torch_load_settings_the_fast_path_does_not_follow_send_the_file_to_torch(tmp_path: Path) -> None:
    import mmap

    from torch.utils.serialization import config

    path = saved(tmp_path, {"w": torch.ones(2)})
    assert fast_mapped_load(str(path)) is not None
    torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)
    try:
        assert fast_mapped_load(str(path)) is None  # torch maps it shared: writes reach the file
    finally:
        torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE)
    with config.patch({"load.calculate_storage_offsets": True}):
        assert fast_mapped_load(str(path)) is None  # torch computes the offsets from the zip headers
    assert fast_mapped_load(str(path)) is not None
