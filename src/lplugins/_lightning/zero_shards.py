"""A DeepSpeed ZeRO checkpoint directory read once, in this process, as one full checkpoint (no universal conversion).

DeepSpeed's ``ds_to_universal`` writes every parameter's fp32 value and each optimizer moment as files of their
own (through process pools), then merges and reads them back: most of a changed-topology resume. Here each rank's
optimizer-state file is read once (weights-only, memory-mapped: a tensor's bytes are read when used) and every
parameter is cut out of the flat partitions where DeepSpeed's own records say it lies:

* ZeRO-1/2 (``DeepSpeedZeroOptimizer``): ``param_slice_mappings``, per parameter group, gives each parameter's
  fragment (start, numel) in that rank's flat fp32 partition (``single_partition_of_fp32_groups``) and in its
  optimizer state (``base_optimizer_state``, the same layout); a parameter is its fragments in rank order;
* ZeRO-3: every parameter is split into ``ceil(numel / ranks)`` pieces, rank ``r`` holding piece ``r`` (the last
  padded), and a rank's flat sub-group (``fp32_flat_groups``, its optimizer state) is its pieces in the order of
  ``param_shapes``.

A parameter in one fragment is a view of the file's bytes (no copy); one split between ranks is joined. The result
is the full checkpoint :mod:`lplugins._lightning.portable` describes (``state_dict`` of fp32 values, torch's
``optimizer_states``, Lightning's own state from the model-states file), plus, when the run scaled its loss (fp16),
DeepSpeed's loss-scaler state as plain values (:data:`LOSS_SCALE_KEY`). The file names and keys are DeepSpeed's
constants (``deepspeed.checkpoint.constants``).

May import: the standard library, ``lplugins._lightning.loading``; torch and DeepSpeed inside functions only.
"""

from __future__ import annotations

import glob
import math
import os
import re
from typing import Any

from lplugins._lightning.loading import DEEPSPEED_SAFE_TYPES, read_tag, weights_only_file

__all__ = [
    "DEEPSPEED_KEYS",
    "LOSS_SCALE_KEY",
    "LayoutError",
    "deepspeed_stage",
    "full_from_zero",
    "loss_scaled",
    "model_states_file",
    "compact",
    "optimizer_files",
    "saved_dp_world_size",
    "tag_dir",
]

ZERO_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
#: The keys of a DeepSpeed model-states file that are DeepSpeed's own (the rest is Lightning's client state).
DEEPSPEED_KEYS = frozenset(
    "module buffer_names optimizer param_shapes frozen_param_shapes shared_params frozen_param_fragments"
    " lr_scheduler data_sampler random_ltd sparse_tensor_module_names skipped_steps global_steps global_samples"
    " dp_world_size mp_world_size checkpoint_parallel_dimensions ds_config ds_version".split()
)
#: Where a full checkpoint made from a loss-scaled (fp16) ZeRO run keeps DeepSpeed's loss-scaler state.
LOSS_SCALE_KEY = "deepspeed_loss_scaler"


class LayoutError(ValueError):
    """A checkpoint's state cannot be put into the layout asked for (the message says what and why)."""


def tag_dir(path: str) -> str:
    """The directory of the tag ``path/latest`` names (Lightning saves one tag per DeepSpeed checkpoint directory)."""
    for latest in ("latest", "latest_universal"):
        if os.path.lexists(os.path.join(path, latest)):
            tag = read_tag(path, latest)  # a plain name from a regular file, or refused
            if os.path.isdir(os.path.join(path, tag)):
                return os.path.join(path, tag)
    return path


def optimizer_files(tag: str) -> list[str]:
    """The optimizer-state files of a ZeRO tag directory, in data-parallel rank order (one model-parallel rank)."""
    found = {}
    for entry in os.listdir(tag):
        match = ZERO_FILE.match(entry)
        if match:
            if int(match.group(2)) != 0:
                raise LayoutError(f"{tag}: a model-parallel checkpoint (mp_rank {match.group(2)}): not supported")
            found[int(match.group(1))] = os.path.join(tag, entry)
    if sorted(found) != list(range(len(found))):
        raise LayoutError(f"{tag}: the optimizer-state files of ranks {sorted(found)} (some are missing)")
    return [found[r] for r in range(len(found))]


def saved_dp_world_size(checkpoint_path: Any) -> int | None:
    """The number of data-parallel ranks that saved the ZeRO checkpoint directory ``checkpoint_path`` (``None``:
    not a ZeRO checkpoint directory).

    Counted from its optimizer-state files, one per data-parallel rank
    (``zero_pp_rank_<R>_mp_rank_00_optim_states.pt``).
    """
    path = os.fspath(checkpoint_path)
    if not os.path.isdir(path):
        return None
    ranks = {int(m.group(1)) for entry in os.listdir(tag_dir(path)) if (m := ZERO_FILE.match(entry))}
    return len(ranks) or None


def model_states_file(tag: str) -> str:
    """The model-states file of a ZeRO tag directory (rank 0's under ZeRO-3): Lightning's state is in it."""
    files = sorted(glob.glob(os.path.join(glob.escape(tag), "*mp_rank_00_model_states.pt")))
    if not files:
        raise LayoutError(f"{tag} has no DeepSpeed model-states file (*mp_rank_00_model_states.pt)")
    return files[0]


def deepspeed_stage(checkpoint_path: Any) -> int | None:
    """The ZeRO stage a DeepSpeed checkpoint directory was written with (from its config), ``None`` if unknown."""
    try:
        states = weights_only_file(model_states_file(tag_dir(os.fspath(checkpoint_path))), DEEPSPEED_SAFE_TYPES)
    except Exception:  # unreadable, or not weights-only (a run that trusts it loads it as DeepSpeed does)
        return None
    stage = ((states.get("ds_config") or {}).get("zero_optimization") or {}).get("stage")
    return int(stage) if stage is not None else None


def loss_scaled(path: str) -> bool:
    """Whether the ZeRO checkpoint directory ``path`` was trained with a loss scale (fp16: a dynamic scaler, or a
    static scale other than 1), from rank 0's optimizer-state file."""
    from deepspeed.checkpoint.constants import LOSS_SCALER, OPTIMIZER_STATE_DICT

    files = optimizer_files(tag_dir(path))
    scaler = _read(files[0])[OPTIMIZER_STATE_DICT].get(LOSS_SCALER) if files else None
    return bool(getattr(scaler, "dynamic", False) or float(getattr(scaler, "cur_scale", 1.0)) != 1.0)


def _read(path: str) -> Any:
    return weights_only_file(path, DEEPSPEED_SAFE_TYPES, mmap=True)


def _flat_state(state: dict[str, Any], numel: int, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """An optimizer state of a flat partition of ``numel`` values: ``(per-element tensors, scalars such as the step)``.

    A per-element state may run longer than the fp32 partition (DeepSpeed keeps the padding of the last rank's
    moments, not of its fp32 values); the fragments lie within both.
    """
    import torch

    flat, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() >= numel:
            flat[key] = value
        elif not isinstance(value, torch.Tensor) or value.dim() == 0:
            scalars[key] = value
        else:
            raise LayoutError(
                f"{where}: optimizer state {key!r} is {tuple(value.shape)}, not one value per element of the"
                f" partition ({numel}): it cannot be cut into parameters"
            )
    return flat, scalars


def _joined(pieces: list[Any], shape: Any, name: str) -> Any:
    import torch

    numel = math.prod(shape)
    have = sum(p.numel() for p in pieces)
    if have != numel:
        raise LayoutError(f"parameter {name!r}: {have} values found in the partitions, its shape {tuple(shape)}")
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(tuple(shape))


Cut = tuple[dict[str, dict[str | None, list[Any]]], dict[str, Any]]


def _zero12(optims: list[dict[str, Any]], flat_index: int, shapes: dict[str, Any]) -> Cut:
    """The pieces of each parameter's fp32 value (key ``None``) and optimizer state in ZeRO-1/2 flat group
    ``flat_index``, in rank order; and the group's scalar state (the step)."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS
    from deepspeed.checkpoint.constants import SINGLE_PARTITION_OF_FP32_GROUPS as FP32

    pieces: dict[str, dict[str | None, list[Any]]] = {name: {} for name in shapes}
    scalars: dict[str, Any] = {}
    for rank, optim in enumerate(optims):
        fp32 = optim[FP32][flat_index]
        state = optim[BASE_OPTIMIZER_STATE]["state"].get(flat_index, {})
        flat, found = _flat_state(state, fp32.numel(), f"rank {rank}'s group {flat_index}")
        scalars = scalars or found
        for name, frag in optim[PARAM_SLICE_MAPPINGS][flat_index].items():
            if name not in pieces:
                raise LayoutError(f"rank {rank}'s partition holds {name!r}, which param_shapes does not name")
            for key, tensor in ((None, fp32), *flat.items()):
                pieces[name].setdefault(key, []).append(tensor.narrow(0, frag.start, frag.numel))
    return pieces, scalars


def _zero3(optims: list[dict[str, Any]], flat_index: int, shapes: dict[str, Any]) -> Cut:
    """As :func:`_zero12`, for ZeRO-3 sub-group ``flat_index`` (each parameter split evenly, the last piece padded)."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT

    world = len(optims)
    pieces: dict[str, dict[str | None, list[Any]]] = {name: {} for name in shapes}
    scalars: dict[str, Any] = {}
    for rank, optim in enumerate(optims):
        fp32 = optim[FP32_FLAT_GROUPS][flat_index]
        state = optim[OPTIMIZER_STATE_DICT]["state"].get(flat_index, {})
        flat, found = _flat_state(state, fp32.numel(), f"rank {rank}'s sub-group {flat_index}")
        scalars = scalars or found
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            mine = max(0, min(part, numel - rank * part))
            if offset + part > fp32.numel():
                raise LayoutError(f"rank {rank}'s sub-group {flat_index} is shorter than its parameters")
            for key, tensor in ((None, fp32), *flat.items()):
                pieces[name].setdefault(key, []).append(tensor.narrow(0, offset, mine))
            offset += part
    return pieces, scalars


def full_from_zero(path: str) -> dict[str, Any]:
    """The full checkpoint of the ZeRO checkpoint directory ``path`` (stage 1-3, any world size), read once.

    Raises:
        LayoutError: a layout this reader does not know (model or pipeline parallel, ZeRO-3 partition groups),
            or files that do not agree with each other (what, and where).
        UnsafeCheckpointError: a file holds a type outside the weights-only allow-list.
    """
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        LOSS_SCALER,
        OPTIMIZER_STATE_DICT,
        PARAM_GROUPS,
        PARAM_SHAPES,
        ZERO_STAGE,
    )

    tag = tag_dir(path)
    states = _read(model_states_file(tag))
    files = optimizer_files(tag)
    if not files:
        raise LayoutError(f"{path} has no ZeRO optimizer-state files")
    optims = [_read(file)[OPTIMIZER_STATE_DICT] for file in files]
    stage = int(optims[0].get(ZERO_STAGE, 1))
    if stage >= 3 and optims[0].get("ds_zero_partition_groups"):
        raise LayoutError(f"{path}: ZeRO-3 with partition groups (MiCS, hpZ) is not supported")
    base = optims[0][OPTIMIZER_STATE_DICT] if stage >= 3 else optims[0][BASE_OPTIMIZER_STATE]
    shapes = states.get(PARAM_SHAPES) or []
    if isinstance(shapes, dict):
        shapes = [shapes]
    state_dict: dict[str, Any] = dict(states.get("module") or {})  # buffers and frozen parameters
    opt_state: dict[int, dict[str, Any]] = {}
    groups = []
    for group in base.get(PARAM_GROUPS) or []:
        ids = []
        for flat_index in group["params"]:  # ZeRO-1/2: one flat group; ZeRO-3: its sub-groups
            if flat_index >= len(shapes):
                raise LayoutError(f"{path}: optimizer group {flat_index} has no param_shapes entry")
            cut = _zero3 if stage >= 3 else _zero12
            pieces, scalars = cut(optims, flat_index, shapes[flat_index])
            for name, shape in shapes[flat_index].items():
                by_key = pieces[name]
                state_dict[name] = _joined(by_key.pop(None), shape, name)
                entry: dict[str, Any] = {str(key): _joined(parts, shape, name) for key, parts in by_key.items()}
                for key, value in scalars.items():
                    entry.setdefault(key, value.clone() if hasattr(value, "clone") else value)
                opt_state[len(opt_state)] = entry
                ids.append(len(opt_state) - 1)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    client = {k: v for k, v in states.items() if k not in DEEPSPEED_KEYS}
    full = {**client, "state_dict": state_dict, "optimizer_states": [{"state": opt_state, "param_groups": groups}]}
    scaler = optims[0].get(LOSS_SCALER)
    if getattr(scaler, "dynamic", False) or float(getattr(scaler, "cur_scale", 1.0)) != 1.0:
        full[LOSS_SCALE_KEY] = {"class": type(scaler).__name__, **_plain(vars(scaler))}
    return full


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """The attributes of a loss scaler that a weights-only load reads back (numbers, bools, None, dtypes)."""
    import torch

    return {k: v for k, v in values.items() if v is None or isinstance(v, (bool, int, float, str, torch.dtype))}


def compact(value: Any, tensors: bool = True) -> Any:
    """``value`` with its dicts and lists copied, and (``tensors``) every tensor that is a view of a larger storage
    copied into one of its own (before saving: ``torch.save`` writes a view's whole storage).

    ``tensors=False``: the containers only, a snapshot that later changes to the original's dicts do not reach.
    """
    import torch

    copies: dict[int, Any] = {}  # a container shared in ``value`` is copied once and stays shared

    def copy(node: Any, depth: int) -> Any:
        if isinstance(node, torch.Tensor):
            whole = node.untyped_storage().nbytes() == node.numel() * node.element_size()
            return node if not tensors or (whole and node.storage_offset() == 0) else node.clone()
        if not isinstance(node, (dict, list)):
            return node
        if id(node) in copies:
            return copies[id(node)]
        if depth > _MAX_DEPTH:
            raise ValueError(f"the state is nested more than {_MAX_DEPTH} deep")
        made: Any = {} if isinstance(node, dict) else []
        copies[id(node)] = made
        if isinstance(node, dict):
            made.update((k, copy(v, depth + 1)) for k, v in node.items())
        else:
            made.extend(copy(v, depth + 1) for v in node)
        return made

    return copy(value, 0)


#: How deep :func:`compact` follows nested containers (a Lightning or DeepSpeed checkpoint nests about 8 deep).
_MAX_DEPTH = 100
