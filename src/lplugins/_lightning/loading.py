"""Loading policy: what a strategy's own checkpoint load may unpickle (weights only by default).

DeepSpeed and FSDP2 (torch distributed checkpoints) load with ``weights_only=False`` in Lightning and
DeepSpeed; lplugins loads them through restricted unpicklers with explicit allow-lists
(:data:`DEEPSPEED_SAFE_TYPES`, :data:`DCP_METADATA_TYPES`) and refuses anything else with
:class:`~lplugins.callbacks.UnsafeCheckpointError` naming the type, unless the user opted out
(``fit(weights_only=False)``). Not a private-access registry: the private names it needs are declared
like everywhere in :mod:`lplugins._lightning`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from lplugins._lightning.registry import _private

if TYPE_CHECKING:
    pass


# ------------------------------------------------------------------ strategy loads, weights-only
# (owned by lplugins.strategies; DurableCheckpoint's resolver reaches it through wrap_strategy_load)

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_private(_DCP_METADATA, "_MEM_FORMAT_ENCODING", "class", "an enum a DCP .metadata file holds: allow-listed")
_private("torch.distributed.checkpoint.filesystem", "_StorageInfo", "class", "DCP .metadata: allow-listed")
_private("torch.serialization", "_get_layout", "class", "how torch pickles a layout (DCP .metadata): allow-listed")
_private("lightning.fabric.utilities.load", "_METADATA_FILENAME", "class", "meta.pt: a sharded checkpoint's rest")

#: The DeepSpeed types a ZeRO-2/ZeRO-3 checkpoint holds (found by saving them on CPU), allowed in its
#: weights-only loads; ``docs/strategies.md`` says why each is safe.
DEEPSPEED_SAFE_TYPES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

#: What the ``.metadata`` pickle of a torch distributed checkpoint may hold (plus torch's dtypes), read
#: with a restricted unpickler instead of torch's plain ``pickle.load``.
DCP_METADATA_TYPES = (
    *(
        f"{_DCP_METADATA}.{name}"
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size",
    "torch.serialization._get_layout",
    "pathlib.Path",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
    "collections.OrderedDict",
    "builtins.set",
    "builtins.frozenset",
)

_private(
    "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector",
    "_restore_modules_and_callbacks",
    "class",
    "called without fit's weights_only for strategies that restore after setup: read from Trainer._run's frame",
)

#: Set on a strategy while :func:`load_weights_only` runs its load (an inner call passes through).
_LOADING = "_lplugins_weights_only_load"


def running_weights_only(depth: int = 32) -> bool | None:
    """The ``weights_only`` given to the running ``trainer.fit`` (``validate``, ...), or ``None``.

    Lightning 2.6 drops it for strategies that restore after setup (DeepSpeed, FSDP, ModelParallel):
    ``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it, so their
    ``load_checkpoint`` always gets ``None``. It is read from ``Trainer._run``'s frame up the stack.
    """
    import sys

    from lightning.pytorch import Trainer

    frame = sys._getframe(1)
    for _ in range(depth):
        if frame.f_code.co_name == "_run" and isinstance(frame.f_locals.get("self"), Trainer):
            value = frame.f_locals.get("weights_only")
            return value if isinstance(value, bool) else None
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


def load_weights_only(strategy: Any, load: Callable[..., Any], checkpoint_path: Any, weights_only: bool | None) -> Any:
    """Run ``load`` (a strategy's own ``load_checkpoint``) with every file it reads read weights-only.

    * DeepSpeed: every ``*.pt`` file of the checkpoint's tag directory is first read weights-only
      (memory-mapped, with :data:`DEEPSPEED_SAFE_TYPES` allowed) on every rank, so that all ranks refuse
      the same checkpoint before any state is touched; then DeepSpeed's checkpoint engine reads each
      file weights-only too.
    * ``ModelParallelStrategy`` (FSDP2): a full checkpoint file is read weights-only; a sharded
      directory (torch distributed checkpoint) is loaded here, with its ``.metadata`` read by a
      restricted unpickler (:data:`DCP_METADATA_TYPES`) and its non-tensor items weights-only.
    * Any other strategy: ``load`` with ``weights_only=True``.

    ``weights_only=None`` means the value given to the running ``trainer.fit`` (see
    :func:`running_weights_only`), and ``True`` if none was. ``weights_only=False`` runs ``load`` with full
    unpickling, for a file the user trusts, after one warning on rank zero naming it.

    Raises:
        UnsafeCheckpointError: a file holds a type outside the allow-list (the message names both);
            nothing in it was executed, and the strategy can load another checkpoint next.
    """
    if getattr(strategy, _LOADING, False):  # an lplugins strategy's own guard inside the resolver's
        return load(checkpoint_path, weights_only=weights_only)
    if weights_only is None:
        weights_only = running_weights_only()
    setattr(strategy, _LOADING, True)
    try:
        if weights_only is False:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                f"lplugins: loading {os.fspath(checkpoint_path)!r} with weights_only=False, as asked: every object"
                " pickled in it is unpickled in full, which can run code. Do this only for a checkpoint you trust."
            )
            return load(checkpoint_path, weights_only=False)
        from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

        if isinstance(strategy, DeepSpeedStrategy):
            return _deepspeed_load(strategy, load, checkpoint_path)
        if isinstance(strategy, ModelParallelStrategy):
            return _model_parallel_load(strategy, load, checkpoint_path)
        with _refusing(checkpoint_path):
            return load(checkpoint_path, weights_only=True)
    finally:
        delattr(strategy, _LOADING)


def _deepspeed_load(strategy: Any, load: Callable[..., Any], checkpoint_path: Any) -> Any:
    if strategy.load_full_weights and strategy.zero_stage_3:  # one file, read through the CheckpointIO
        with _safe_globals(DEEPSPEED_SAFE_TYPES), _refusing(checkpoint_path):
            return load(checkpoint_path, weights_only=True)
    for file in _deepspeed_files(os.fspath(checkpoint_path)):
        weights_only_file(file, DEEPSPEED_SAFE_TYPES, mmap=True)
    engine = getattr(strategy.deepspeed_engine, "checkpoint_engine", None)
    if engine is None:
        return load(checkpoint_path, weights_only=True)

    def engine_load(path: str, map_location: Any = None) -> Any:
        return weights_only_file(path, DEEPSPEED_SAFE_TYPES, map_location=map_location)

    previous = vars(engine).get("load")
    engine.load = engine_load  # on the instance: every engine (torch, fast, decoupled) saves with torch.save
    try:
        return load(checkpoint_path, weights_only=True)
    finally:
        if previous is None:
            del engine.load
        else:
            engine.load = previous


def _deepspeed_files(path: str) -> list[str]:
    """The files DeepSpeed reads to resume from ``path``: the ``*.pt`` files of its tag directory."""
    import glob

    if not os.path.isdir(path):
        return []  # Lightning refuses it with its own message
    latest = os.path.join(path, "latest")
    tag_dir = path
    if os.path.lexists(latest):
        candidate = os.path.join(path, read_tag(path, "latest"))
        if os.path.isdir(candidate):
            tag_dir = candidate
    return sorted(glob.glob(os.path.join(glob.escape(tag_dir), "**", "*.pt"), recursive=True))


def plain_name(name: str, what: str) -> str:
    """``name`` when it is one entry's plain name inside a checkpoint directory (no ``/``, ``..``, NUL, not empty).

    Raises:
        ValueError: it is not (a tag, a ``.metadata`` path pointing elsewhere); ``what`` says where it came from.
    """
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"{what} names {name!r}, not an entry of the checkpoint directory: refused")
    return name


def read_tag(path: str, latest: str) -> str:
    """DeepSpeed's tag in ``path/<latest>``: a plain name, read from a regular file (no link, no FIFO).

    Raises:
        ValueError: the tag file is a link or not a regular file, or the tag is not a plain name.
    """
    import stat

    file = os.path.join(path, latest)
    mode = os.lstat(file).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{file} is not a regular file (a link, a FIFO or a device): refused")
    with open(file) as f:
        tag = f.read(4096).strip()
    candidate = os.path.join(path, plain_name(tag, file))
    if os.path.islink(candidate):
        raise ValueError(f"{file} names {tag!r}, a symbolic link: refused")
    return tag


def check_dcp_paths(metadata: Any, path: Any) -> None:
    """Every file a DCP ``.metadata`` sends reads to is a plain name inside ``path``, and a regular file there.

    Raises:
        ValueError: one names a path outside the directory (``../``, absolute) or a link.
    """
    import stat

    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        full = os.path.join(os.fspath(path), plain_name(rel, f"{os.fspath(path)}/.metadata"))
        if os.path.lexists(full) and not stat.S_ISREG(os.lstat(full).st_mode):
            raise ValueError(f"{full} (named by .metadata) is not a regular file: refused")


def _model_parallel_load(strategy: Any, load: Callable[..., Any], checkpoint_path: Any) -> Any:
    from pathlib import Path

    path = Path(strategy.broadcast(checkpoint_path))  # Lightning loads rank 0's path
    if not path.is_dir():
        with _refusing(path):
            return load(path, weights_only=True)
    return _load_sharded(strategy, path)


def _load_sharded(strategy: Any, path: Any) -> dict[str, Any]:
    """Lightning's ``ModelParallelStrategy`` load of a sharded directory, with nothing unpickled in full."""
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.utilities.load import _METADATA_FILENAME
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    # the two pickles first, so that a refused checkpoint changes nothing
    checkpoint: dict[str, Any] = weights_only_file(path / _METADATA_FILENAME, ())
    metadata = _restricted_unpickle(path / ".metadata", DCP_METADATA_TYPES)
    check_dcp_paths(metadata, path)
    reader_cls, planner_cls = _dcp_weights_only_classes()
    module = strategy.model
    module_state = {"state_dict": get_model_state_dict(module)}
    _dcp_load(dcp, module_state, reader_cls(path, metadata), planner_cls(path))
    module.load_state_dict(module_state["state_dict"], strict=strategy.lightning_module.strict_loading)
    for idx, optimizer in enumerate(strategy.optimizers):
        key = f"optimizer_{idx}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        _dcp_load(dcp, optimizer_state, reader_cls(path, metadata), planner_cls(path))
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key], options=options)
    return checkpoint


def _dcp_load(dcp: Any, state: dict[str, Any], reader: Any, planner: Any) -> None:
    """``torch.distributed.checkpoint.load``; a refusal on any rank is raised as itself on every rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    from lplugins._errors import UnsafeCheckpointError

    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointException as err:
        for failure, _ in err.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise UnsafeCheckpointError(str(failure)) from err
        raise


def _dcp_weights_only_classes() -> tuple[Any, Any]:
    """torch's ``FileSystemReader`` given metadata read safely, and a load planner that reads items weights-only."""
    import io

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def __init__(self, path: Any, metadata: Any) -> None:
            super().__init__(path)
            self.checked_metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise FileNotFoundError("lplugins reads the checkpoint's global .metadata only")
            metadata = self.checked_metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def __init__(self, path: Any) -> None:
            super().__init__()
            self.path = path

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            import torch

            with _refusing(f"{os.fspath(self.path)} (item {read_item.dest_index.fqn})"):
                torch.load(value, weights_only=True)
            # accepted weights-only: the default planner's full unpickling of the same bytes (in memory) builds
            # the same plain objects, through the same allowed globals only
            value.seek(0)
            super().load_bytes(read_item, value)

    return Reader, Planner


def weights_only_file(path: Any, allowed: tuple[str, ...], map_location: Any = None, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with the types named in ``allowed`` (``"module.Name"``) allowed.

    Raises:
        UnsafeCheckpointError: the file holds another type (named, with the file).
    """
    import torch

    from lplugins._bounds import check_file

    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        check_file(path)  # resource bounds first (nesting, shared parts, zip sizes): docs/checkpoint.md
    with _safe_globals(allowed), _refusing(path):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError as err:
            if not mmap or "mmap" not in str(err):
                raise
            return torch.load(path, map_location=map_location, weights_only=True)  # a legacy (not zip) file


@contextmanager
def _safe_globals(names: tuple[str, ...]) -> Iterator[None]:
    """torch's ``safe_globals`` for types named ``"module.Name"`` (a module that is not installed is skipped)."""
    import torch

    with torch.serialization.safe_globals([obj for obj in map(_resolve_global, names) if obj is not None]):
        yield


def _resolve_global(name: str) -> Any:
    import importlib

    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


@contextmanager
def _refusing(path: Any) -> Iterator[None]:
    """Turn a weights-only refusal while reading ``path`` into :class:`~lplugins._errors.UnsafeCheckpointError`."""
    import pickle

    try:
        yield
    except pickle.UnpicklingError as err:
        raise unsafe_checkpoint_error(path, err) from err


def unsafe_checkpoint_error(path: Any, err: BaseException) -> Exception:
    """The :class:`~lplugins._errors.UnsafeCheckpointError` for a refused read of ``path``."""
    import re

    from lplugins._errors import UnsafeCheckpointError

    text = str(err)
    found = re.search(r"disallowed type ([\w.]+)", text) or re.search(r"GLOBAL ([\w.]+)", text)
    named = found.group(1) if found else None
    if named is not None and "." not in named:
        named = f"builtins.{named}"  # torch names a builtin without its module ("GLOBAL exec")
    names = _unsafe_globals(path) or ([named] if named else [])
    if names:
        what = f"the type{'s' if len(names) > 1 else ''} {', '.join(names)}, which a weights-only load does not allow"
    else:
        lines = [line for line in text.splitlines() if "WeightsUnpickler error" in line] or text.splitlines()[:1]
        what = f"content a weights-only load does not allow ({lines[0].strip() if lines else type(err).__name__})"
    return UnsafeCheckpointError(
        f"Refusing to load checkpoint file {os.fspath(path) if not isinstance(path, str) else path!r}: it holds"
        f" {what}; nothing in it was executed. If you wrote this checkpoint and trust it, load it with"
        " trainer.fit(model, ckpt_path=..., weights_only=False) (see docs/strategies.md)."
    )


def _unsafe_globals(path: Any) -> list[str]:
    """The disallowed globals a torch checkpoint file names, fully qualified (``[]`` if it cannot tell)."""
    import torch

    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path)) if os.path.isfile(path) else []
    except Exception:  # not a zip checkpoint: torch's message is used
        return []


def _restricted_unpickle(path: Any, allowed: tuple[str, ...]) -> Any:
    """Unpickle ``path`` with only ``allowed`` globals (``"module.Name"``) and torch's dtypes.

    Python's own unpickler, not C ``pickle``: its memo is a dict (C ``pickle`` sizes a table by the
    largest memo index a file gives, so one forged index could allocate gigabytes), and its ``BUILD`` can
    be checked: state goes only onto an instance of an allowed class, never onto an allowed class or
    function itself (that would change it for the whole process).
    """
    import pickle

    import torch

    names = set(allowed)
    classes: set[type] = set()

    class Unpickler(pickle._Unpickler):
        dispatch: ClassVar[dict[int, Callable[..., None]]] = dict(pickle._Unpickler.dispatch)

        def find_class(self, module: str, name: str) -> Any:
            full = f"{module}.{name}"
            if full in names or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                obj = _resolve_global(full)
                if obj is not None:
                    if isinstance(obj, type):
                        classes.add(obj)
                    return obj
            raise pickle.UnpicklingError(f"disallowed type {full}")

        def load_build(self) -> None:
            stack: list[Any] = self.stack  # type: ignore[attr-defined]  # pure-Python unpickler's own
            target = stack[-2] if len(stack) > 1 else None
            if type(target) not in classes:
                raise pickle.UnpicklingError(f"disallowed type {type(target).__name__} (BUILD on it)")
            super().load_build()  # type: ignore[misc]

        dispatch[pickle.BUILD[0]] = load_build

    with open(path, "rb") as f, _refusing(path):
        return Unpickler(f).load()
