"""Checkpoint layouts and the conversions between them: one full checkpoint as the common form.

Every layout a built-in strategy writes can be read into one *full* checkpoint, the dict a single-device or
DDP run of Lightning writes (``state_dict`` with each parameter's fp32 value, ``optimizer_states`` as torch
optimizers' own ``state_dict()``, and Lightning's ``loops``, ``callbacks``, ``lr_schedulers``, ``epoch``,
``global_step`` ...), with nothing lost that a resume needs:

* a DeepSpeed ZeRO directory (stages 1-3, any world size): read once, in this process, each parameter cut out of
  the ranks' flat partitions (:func:`lplugins._lightning.zero_shards.full_from_zero`; DeepSpeed's ``ds_to_universal``,
  :func:`convert_to_universal`, is kept for DeepSpeed's own tools, resumes do not need it);
* a torch distributed checkpoint (FSDP2's sharded directory): :func:`full_from_dcp` reads it whole, weights-only;
* a full file already is one.

The other way, a full checkpoint goes into a running DeepSpeed engine of any stage and world size through
DeepSpeed's public ``safe_set_full_*`` functions (:func:`load_full_into_deepspeed`); DDP and single device load
it as it is, and Lightning's ``ModelParallelStrategy`` (FSDP2) shards it on load.

May import: the standard library, ``lplugins._errors``, the modules of this package; torch and DeepSpeed
inside functions only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
from typing import Any

from lplugins._lightning.loading import (
    DCP_METADATA_TYPES,
    _dcp_weights_only_classes,
    _restricted_unpickle,
    check_dcp_paths,
    weights_only_file,
)
from lplugins._lightning.registry import _private
from lplugins._lightning.zero_shards import (
    LayoutError,
    deepspeed_stage,
    full_from_zero,
    saved_dp_world_size,
    tag_dir,
)

__all__ = [
    "DEEPSPEED_DIR",
    "DCP_DIR",
    "FULL_FILE",
    "LayoutError",
    "convert_to_universal",
    "deepspeed_stage",
    "full_checkpoint",
    "full_from_dcp",
    "full_from_zero",
    "layout",
    "load_full_into_deepspeed",
    "restore_loss_scale",
    "torch_loss_scale",
    "saved_dp_world_size",
    "tag_dir",
]

_DCP = "torch.distributed.checkpoint"
_private(f"{_DCP}.default_planner", "_EmptyStateDictLoadPlanner", "class", "reads a whole DCP (as dcp_to_torch_save)")
_private("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "_lazy_init_hp_params_optimizer_state",
         "class", "ZeRO-1/2 link parameters to optimizer state at the first step: done at load")  # fmt: skip
_private(f"{_DCP}.state_dict_loader", "_load_state_dict", "class", "dcp.load without a process group (no_dist)")

#: The layouts :func:`layout` tells apart.
FULL_FILE, DEEPSPEED_DIR = "one full checkpoint file", "a DeepSpeed ZeRO directory"
DCP_DIR = "an FSDP2 sharded directory (torch distributed checkpoint)"


def layout(path: Any) -> str | None:
    """Which layout the checkpoint at ``path`` has (``None``: none lplugins knows)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return FULL_FILE
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, ".metadata")):
        return DCP_DIR
    if saved_dp_world_size(path) is not None:
        return DEEPSPEED_DIR
    return None


def convert_to_universal(checkpoint_path: str, work: str) -> float:
    """Convert the ZeRO checkpoint directory ``checkpoint_path`` into a DeepSpeed universal checkpoint in ``work``.

    For DeepSpeed's own tools (``"checkpoint": {"load_universal": true}``); lplugins' resumes read the ZeRO
    directory directly (:func:`full_from_zero`).

    ``work`` gets ``latest_universal`` and the tag directory (DeepSpeed's ``ds_to_universal``, run in this
    process, with one worker, its output kept off the console); ``checkpoint_path`` is only read.

    Returns:
        The seconds the conversion took.

    Raises:
        Exception: whatever DeepSpeed's converter raises (with its last output lines as a note).
    """
    import time

    from deepspeed.checkpoint import ds_to_universal

    tag = tag_dir(checkpoint_path)
    start = time.perf_counter()
    shutil.rmtree(work, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=tag, output_folder=os.path.join(work, os.path.basename(tag)), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
    )  # fmt: skip
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            ds_to_universal.main(args)
    except BaseException as err:
        tail = "\n".join(out.getvalue().strip().splitlines()[-5:])
        note = getattr(err, "add_note", None)  # Python 3.11+
        if tail and note is not None:
            note(f"ds_to_universal said:\n{tail}")
        shutil.rmtree(work, ignore_errors=True)
        raise
    return time.perf_counter() - start


def full_from_dcp(path: str) -> dict[str, Any]:
    """A full checkpoint from a torch distributed checkpoint directory written by Lightning (FSDP2), read weights-only.

    Its optimizer states, keyed by parameter name in the directory, are keyed by position, as torch's
    ``Optimizer.state_dict()`` is.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    meta: dict[str, Any] = weights_only_file(os.path.join(path, "meta.pt"), ())
    metadata = _restricted_unpickle(os.path.join(path, ".metadata"), DCP_METADATA_TYPES)
    check_dcp_paths(metadata, path)
    reader_cls, planner_cls = _dcp_weights_only_classes()

    class Planner(planner_cls, _EmptyStateDictLoadPlanner):  # type: ignore[misc,valid-type]
        """Every key in the directory (an empty state dict to fill), its bytes read weights-only."""

    loaded: dict[str, Any] = {}
    _load_state_dict(loaded, storage_reader=reader_cls(path, metadata), planner=Planner(path), no_dist=True)
    optimizers = []
    for idx in range(len([k for k in loaded if k.startswith("optimizer_")])):
        optimizers.append(_keyed_by_position(loaded[f"optimizer_{idx}"]))
    return {**meta, "state_dict": loaded.get("state_dict", {}), "optimizer_states": optimizers}


def _keyed_by_position(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name, keyed by position (torch's own form)."""
    groups: list[dict[str, Any]] = []
    index: dict[Any, int] = {}
    for group in state.get("param_groups", []):
        ids = []
        for name in group["params"]:
            index[name] = len(index)
            ids.append(index[name])
        groups.append({**group, "params": ids})
    return {"state": {index[k]: v for k, v in state.get("state", {}).items() if k in index}, "param_groups": groups}


def full_checkpoint(path: str) -> dict[str, Any]:
    """The full checkpoint of ``path`` in any layout lplugins knows.

    Raises:
        LayoutError: the layout is unknown (or a ZeRO directory this reader does not know: the message says why).
    """
    kind = layout(path)
    if kind == FULL_FILE:
        checkpoint: dict[str, Any] = weights_only_file(path, ())
        return checkpoint
    if kind == DCP_DIR:
        return full_from_dcp(path)
    if kind == DEEPSPEED_DIR:
        return full_from_zero(path)
    raise LayoutError(f"{path} is not a checkpoint layout lplugins knows (a file, {DEEPSPEED_DIR}, {DCP_DIR})")


_Z3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
_private(_Z3, "_get_fp32_opt_state_partition", "class", "this rank's fp32 (or moment) partition of a ZeRO-3 parameter")
_private(_Z3, "_get_param_partition_rank", "class", "which slice of a ZeRO-3 parameter this rank holds")


def _set_zero3_partition(optimizer: Any, param: Any, value: Any, key: str | None) -> None:
    """Set this rank's partition of a ZeRO-3 parameter's fp32 value (``key`` None) or optimizer state ``key``.

    DeepSpeed's ``safe_set_full_*`` slice the full value by the padded partition size, which runs past its end for
    the last rank of a parameter whose size the world size does not divide; here the slice is clamped and the
    padding left zero.
    """
    part, _ = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    size = part.numel()
    start = optimizer._get_param_partition_rank(param) * size
    chunk = value.flatten()[start : start + size]
    part.data.zero_()
    part.data[: chunk.numel()].copy_(chunk)


def load_full_into_deepspeed(strategy: Any, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Put a full checkpoint's weights and optimizer state into ``strategy``'s DeepSpeed engine (any stage, any
    world size); return the rest of it (what Lightning restores itself: loops, callbacks, LR schedulers...).

    Each parameter's fp32 value and optimizer moments go through DeepSpeed's ``safe_set_full_fp32_param`` and
    ``safe_set_full_optimizer_state`` (each rank keeps its partition), the module's own weights are set to the
    same values (gathered and re-partitioned under ZeRO-3), the optimizer's step count and hyper-parameters
    (learning rate...) are those of the checkpoint. Every check is made before anything is set.

    Raises:
        LayoutError: the checkpoint's parameters or optimizer state do not fit this model and optimizer (what,
            and why), e.g. an optimizer whose state is not one tensor per parameter of its shape.
    """
    import torch
    from deepspeed import zero
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    module = strategy.lightning_module
    engine = strategy.deepspeed_engine
    source = checkpoint.get("state_dict") or {}
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    missing = [n for n, _ in params if n not in source]
    if missing:
        raise LayoutError(f"the checkpoint has no value for parameter(s) {', '.join(missing[:5])} of this model")
    optimizers = checkpoint.get("optimizer_states") or []
    if len(optimizers) != 1:
        raise LayoutError(
            f"the checkpoint holds {len(optimizers)} optimizer states; DeepSpeed trains with exactly one optimizer"
        )
    saved = optimizers[0]
    order = [i for group in saved.get("param_groups", []) for i in group["params"]]
    if len(order) != len(params):
        raise LayoutError(
            f"the checkpoint's optimizer holds {len(order)} parameters, this model trains {len(params)}: the"
            " optimizer state cannot be matched to the parameters"
        )
    stage3 = bool(getattr(strategy, "zero_stage_3", False))
    shapes = [tuple(p.ds_shape) if stage3 else tuple(p.shape) for _, p in params]
    moments: list[dict[str, Any]] = []
    steps = set()
    for (name, _), shape_now, index in zip(params, shapes, order, strict=True):
        if tuple(source[name].shape) != shape_now:
            raise LayoutError(
                f"parameter {name!r} is {tuple(source[name].shape)} in the checkpoint and {shape_now} in this model"
            )
        state = saved.get("state", {}).get(index, {})
        entry = {}
        for key, value in state.items():
            if key == "step":
                steps.add(float(value))
            elif not isinstance(value, torch.Tensor) or tuple(value.shape) != shape_now:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise LayoutError(
                    f"optimizer state {key!r} of parameter {name!r} is {shape}, not one value per element of the"
                    f" parameter {tuple(source[name].shape)}: DeepSpeed can only partition optimizer state that is"
                    " shaped like its parameter"
                )
            else:
                entry[key] = value
        moments.append(entry)
    if len(steps) > 1:
        raise LayoutError(f"the checkpoint's parameters have different optimizer step counts {sorted(steps)}")
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    saved_groups, groups = saved.get("param_groups", []), engine.optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise LayoutError(f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this {len(groups)}")
    extra = {k for g in saved_groups for k in g} - {k for g in groups for k in g} - {"params", "initial_lr"}
    if extra:
        raise LayoutError(
            f"the checkpoint's optimizer has hyper-parameters {sorted(extra)} that this run's {type(base).__name__}"
            " has not: it was written with another optimizer"
        )
    keys = {key for entry in moments for key in entry}
    # the partitions' optimizer state, created as the first step would (ZeRO-3 hands its flat fp32 partitions to
    # the optimizer only inside step: they are not in its param_groups now)
    flats = [p for group in base.param_groups for p in group["params"]]
    flats += list(getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or [])
    for flat in {id(f): f for f in flats}.values():
        state = base.state[flat]
        for key in keys:
            state.setdefault(key, torch.zeros_like(flat))
        state.setdefault("step", torch.tensor(0.0))
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO-1/2 link each parameter to its optimizer state at the first step: now
        link()
    for (name, p), entry in zip(params, moments, strict=True):
        values: dict[str | None, Any] = {None: source[name]}
        values.update(entry)
        for key, value in values.items():
            value = value.detach().to(torch.float32)
            if stage3:
                _set_zero3_partition(engine.optimizer, p, value, key)
            elif key is None:
                safe_set_full_fp32_param(p, value)
            else:
                safe_set_full_optimizer_state(p, value, key)
        # the weights the forward uses (under ZeRO-3 gathered, set, and partitioned again)
        with zero.GatheredParameters([p], modifier_rank=0) if stage3 else contextlib.nullcontext():
            p.data.copy_(source[name].to(p.dtype).reshape(p.shape))
    for name, buffer in module.named_buffers():
        if name in source:
            buffer.data.copy_(source[name].to(buffer.dtype))
    if steps:
        step = steps.pop()
        for state in base.state.values():
            if "step" in state:
                old = state["step"]
                state["step"] = (
                    torch.tensor(step, dtype=old.dtype) if isinstance(old, torch.Tensor) else type(old)(step)
                )
    for group, saved_group in zip(groups, saved_groups, strict=True):
        for key, value in saved_group.items():
            if key != "params" and key in group:
                group[key] = value
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}


def restore_loss_scale(engine: Any, saved: dict[str, Any] | None) -> None:
    """Give a loss-scaling (fp16) DeepSpeed engine the loss-scaler state a ZeRO checkpoint saved (scale, iteration,
    last overflow, hysteresis), as DeepSpeed's own load of the same topology does; nothing to do without one."""
    scaler = getattr(getattr(engine, "optimizer", None), "loss_scaler", None)
    if not saved or scaler is None or not engine.fp16_enabled():
        return
    for key, value in saved.items():
        if key != "class" and hasattr(scaler, key):
            setattr(scaler, key, value)


def torch_loss_scale(checkpoint: dict[str, Any]) -> bool:
    """Whether a full checkpoint holds the state of torch's ``GradScaler`` (Lightning's ``16-mixed``), which a
    DeepSpeed fp16 engine's loss scaler cannot take."""
    state = checkpoint.get("MixedPrecision")
    return isinstance(state, dict) and "scale" in state
