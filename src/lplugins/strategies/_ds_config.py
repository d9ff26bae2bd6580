"""DeepSpeed config: loading, validation and ``"auto"`` filling, before any training starts.

DeepSpeed ignores top-level keys it does not know (``"zero_optimisation"`` silently trains without
ZeRO), and Lightning refuses a config that sets ``gradient_accumulation_steps`` at all, even to
``"auto"`` as the seed guide's JSON does. Here every key is checked (unknown keys are named, with the
closest known key), the ``"auto"`` values are filled from the Trainer, and a value that contradicts
the Trainer is an error that names both sides instead of being overridden.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

from lplugins._errors import CompositionError, shown_from
from lplugins._validate import did_you_mean, is_int

__all__ = [
    "AUTO_KEYS",
    "DeepSpeedConfigError",
    "TOP_LEVEL_KEYS",
    "TrainerFacts",
    "check_against_trainer",
    "fill_auto",
    "load_config",
    "validate_config",
]


class DeepSpeedConfigError(CompositionError):
    """A DeepSpeed config that is invalid, or that contradicts the Trainer."""


shown_from("lplugins.strategies", DeepSpeedConfigError)


#: Top-level keys DeepSpeed 0.16-0.19 reads (see https://www.deepspeed.ai/docs/config-json/).
TOP_LEVEL_KEYS: frozenset[str] = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_allreduce_op",
        "sparse_gradients",
        "fp16",
        "bf16",
        "amp",
        "torch_autocast",
        "data_types",
        "gradient_clipping",
        "zero_optimization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "aio",
        "activation_checkpointing",
        "flops_profiler",
        "sparse_attention",
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "memory_breakdown",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "autotuning",
        "elasticity",
        "data_efficiency",
        "curriculum_learning",
        "compression_training",
        "checkpoint",
        "pipeline",
        "tensor_parallel",
        "hybrid_engine",
        "disable_allgather",
        "dataloader_drop_last",
        "use_data_before_expert_parallelism",
        "timers",
        "nebula",
        "weight_quantization",
        "quantize_training",
        "compile",
        "graph_harvesting",
        "eigenvalue",
        "progressive_layer_drop",
        "disable_python_gc",
        "lower_precision_safe_modules",
        "managed_gradient_accumulation",
        "fp32_allreduce",
        "zero_optimization_stage",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "expert_parallel",
        "logging",
    }
)

#: Keys whose value may be ``"auto"``, and what fills them.
AUTO_KEYS: Mapping[str, str] = {
    "train_micro_batch_size_per_gpu": "the train dataloader's batch size",
    "gradient_accumulation_steps": "Trainer(accumulate_grad_batches=...)",
    "train_batch_size": "micro-batch size x accumulation x world size",
    "gradient_clipping": "Trainer(gradient_clip_val=...), 0.0 when unset",
    "fp16.enabled": "Trainer(precision=...) is '16-mixed' or '16-true'",
    "bf16.enabled": "Trainer(precision=...) is 'bf16-mixed' or 'bf16-true'",
}

_PRECISION_SECTIONS: Mapping[str, frozenset[str]] = {
    "fp16": frozenset(
        {
            "enabled",
            "auto_cast",
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
            "fp16_master_weights_and_grads",
        }
    ),
    "bf16": frozenset(
        {
            "enabled",
            "immediate_grad_update",
            "check_grad_overflow",
            "bf16_master_weights_and_grads",
            "bf16_optimizer_states",
        }
    ),
}
_ACTIVATION_CHECKPOINTING_KEYS = frozenset(
    {
        "partition_activations",
        "cpu_checkpointing",
        "contiguous_memory_optimization",
        "number_checkpoints",
        "synchronize_checkpoint_boundary",
        "profile",
    }
)
_AIO_KEYS = frozenset(
    {"block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit", "overlap_events", "use_gds"}
)
_OFFLOAD_DEVICES = ("cpu", "nvme", "none")
_POSITIVE_INTS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def load_config(config: Mapping[str, Any] | str | PathLike[str]) -> dict[str, Any]:
    """Return a deep copy of a config given as a dict, or read it from a JSON file.

    Raises:
        DeepSpeedConfigError: the file does not exist, is not valid JSON, or is not a JSON object.
    """
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, PathLike)):
        path = Path(config)
        if not path.is_file():
            raise DeepSpeedConfigError(
                f"DeepSpeed config file {str(path)!r} does not exist; pass a path to a JSON file or a dict."
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DeepSpeedConfigError(
                f"DeepSpeed config file {str(path)!r} is not valid JSON: {exc.msg} (line {exc.lineno}, "
                f"column {exc.colno})."
            ) from None
        if not isinstance(data, dict):
            raise DeepSpeedConfigError(
                f"DeepSpeed config file {str(path)!r} holds a {type(data).__name__}; it must hold a JSON object."
            )
        return data
    raise DeepSpeedConfigError(f"DeepSpeed config {config!r} is neither a dict nor a path to a JSON file.")


def _unknown(path: str, key: str, known: Iterable[str]) -> DeepSpeedConfigError:
    known = sorted(known)
    where = f"in {path!r}" if path else "at the top level"
    msg = f"Unknown DeepSpeed config key {key!r} {where}." + did_you_mean(key, known)
    msg += f" Known keys: {', '.join(known)}."
    if not path:
        msg += " (DeepSpeed itself would ignore it silently.)"
    return DeepSpeedConfigError(msg)


def _check_keys(section: Any, path: str, known: Iterable[str]) -> None:
    if not isinstance(section, Mapping):
        raise DeepSpeedConfigError(f"DeepSpeed config {path!r} must be an object (a dict), got {section!r}.")
    known = frozenset(known)
    for key in section:
        if isinstance(key, str) and key.startswith("_"):
            continue  # "_comment"-style keys are allowed and ignored
        if key not in known:
            raise _unknown(path, key, known)


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _check_auto(config: Mapping[str, Any], path: str = "") -> None:
    for key, value in config.items():
        full = f"{path}.{key}" if path else str(key)
        if isinstance(value, Mapping):
            _check_auto(value, full)
        elif _is_auto(value) and full not in AUTO_KEYS:
            raise DeepSpeedConfigError(
                f"DeepSpeed config {full!r} is 'auto', but lplugins only fills 'auto' for: "
                f"{', '.join(AUTO_KEYS)}. Remove {full!r} to use DeepSpeed's default, or give a value."
            )


def _zero_models() -> tuple[Any, Any, Any] | None:
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from deepspeed.runtime.zero.offload_config import (
            DeepSpeedZeroOffloadOptimizerConfig,
            DeepSpeedZeroOffloadParamConfig,
        )
    except ImportError:  # pragma: no cover - the deepspeed extra is not installed
        return None
    return DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig


def _fields(model: Any) -> set[str]:
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return names


def _validate_zero(zero: Any) -> None:
    models = _zero_models()
    _check_keys(zero, "zero_optimization", _fields(models[0]) if models is not None else zero)
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise DeepSpeedConfigError(f"DeepSpeed config 'zero_optimization.stage' is {stage!r}; allowed: 0, 1, 2, 3.")
    for section, index in (("offload_optimizer", 1), ("offload_param", 2)):
        sub = zero.get(section)
        if sub is None:
            continue
        path = f"zero_optimization.{section}"
        if models is not None:
            _check_keys(sub, path, _fields(models[index]))
        device = sub.get("device", "none") if isinstance(sub, Mapping) else None
        if device not in _OFFLOAD_DEVICES:
            raise DeepSpeedConfigError(
                f"DeepSpeed config '{path}.device' is {device!r}; allowed: {', '.join(map(repr, _OFFLOAD_DEVICES))}."
            )
        if device == "nvme" and not sub.get("nvme_path"):
            raise DeepSpeedConfigError(f"DeepSpeed config '{path}.device' is 'nvme' but '{path}.nvme_path' is not set.")
    if zero.get("offload_param") and zero["offload_param"].get("device", "none") != "none" and stage != 3:
        raise DeepSpeedConfigError(
            f"DeepSpeed config sets 'zero_optimization.offload_param' with stage {stage}; parameter offload needs "
            "stage 3. Use stage 3, or offload only the optimizer ('offload_optimizer') with stage 1 or 2."
        )
    if zero.get("offload_optimizer") and zero["offload_optimizer"].get("device", "none") != "none" and stage == 0:
        raise DeepSpeedConfigError(
            "DeepSpeed config sets 'zero_optimization.offload_optimizer' with stage 0; optimizer offload needs "
            "stage 1, 2 or 3."
        )
    if models is not None:
        from pydantic import ValidationError

        try:
            models[0](**zero)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ()))
            raise DeepSpeedConfigError(
                f"DeepSpeed config 'zero_optimization.{loc}' is invalid: {err.get('msg')} (got {err.get('input')!r})."
            ) from None


def validate_config(config: Mapping[str, Any]) -> None:
    """Check a DeepSpeed config's keys and values before training.

    ``"auto"`` is accepted for the keys in :data:`AUTO_KEYS`; keys that start with ``_`` are
    ignored (comments).

    Raises:
        DeepSpeedConfigError: an unknown key (named, with the closest known key), a value of the
            wrong type or range, or ``"auto"`` where lplugins cannot fill it.

    Examples:
        >>> validate_config({"zero_optimisation": {"stage": 2}})
        Traceback (most recent call last):
        ...
        lplugins.strategies.DeepSpeedConfigError: Unknown DeepSpeed config key 'zero_optimisation' ...
    """
    _check_keys(config, "", TOP_LEVEL_KEYS)
    _check_auto(config)
    for key in _POSITIVE_INTS:
        value = config.get(key)
        if value is None or _is_auto(value):
            continue
        if not is_int(value) or value < 1:
            raise DeepSpeedConfigError(
                f"DeepSpeed config {key!r} is {value!r}; it must be a positive integer or 'auto'."
            )
    clip = config.get("gradient_clipping")
    if clip is not None and not _is_auto(clip):
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
            raise DeepSpeedConfigError(
                f"DeepSpeed config 'gradient_clipping' is {clip!r}; it must be a number >= 0 (0 = off) or 'auto'."
            )
    for name, keys in _PRECISION_SECTIONS.items():
        if name in config:
            _check_keys(config[name], name, keys)
            enabled = config[name].get("enabled", False)
            if not isinstance(enabled, bool) and not _is_auto(enabled):
                raise DeepSpeedConfigError(
                    f"DeepSpeed config '{name}.enabled' is {enabled!r}; allowed: true, false, 'auto'."
                )
    if "activation_checkpointing" in config:
        _check_keys(config["activation_checkpointing"], "activation_checkpointing", _ACTIVATION_CHECKPOINTING_KEYS)
    if "aio" in config:
        _check_keys(config["aio"], "aio", _AIO_KEYS)
    for name in ("optimizer", "scheduler"):
        if name in config:
            _check_keys(config[name], name, {"type", "params"})
            if "type" not in config[name]:
                raise DeepSpeedConfigError(f"DeepSpeed config {name!r} needs a 'type' (e.g. 'AdamW').")
    if "zero_optimization" in config:
        _validate_zero(config["zero_optimization"])


@dataclass(frozen=True)
class TrainerFacts:
    """What the Trainer says about the settings a DeepSpeed config can also set.

    ``None`` means "not known (yet)": such a value is neither checked nor filled.

    Attributes:
        accumulate_grad_batches: ``Trainer(accumulate_grad_batches=...)`` (an int).
        gradient_clip_val: ``Trainer(gradient_clip_val=...)``; ``None`` when not set.
        gradient_clip_algorithm: ``"norm"`` or ``"value"``; ``None`` when not set.
        precision: The Trainer's precision string (e.g. ``"32-true"``, ``"bf16-mixed"``).
        micro_batch_size: The train dataloader's batch size.
        world_size: Number of processes in total.
    """

    accumulate_grad_batches: int | None = None
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    precision: str | None = None
    micro_batch_size: int | None = None
    world_size: int | None = None


_HALF = {"fp16": ("16-mixed", "16-true", "16"), "bf16": ("bf16-mixed", "bf16-true", "bf16")}


def check_against_trainer(config: Mapping[str, Any], facts: TrainerFacts) -> None:
    """Raise if the config contradicts what the Trainer was told. Nothing is changed.

    Raises:
        DeepSpeedConfigError: a conflict, explained with both values and how to resolve it.
    """
    ga = config.get("gradient_accumulation_steps")
    if isinstance(ga, int) and facts.accumulate_grad_batches is not None and ga != facts.accumulate_grad_batches:
        raise DeepSpeedConfigError(
            f"DeepSpeed config 'gradient_accumulation_steps' is {ga} but Trainer(accumulate_grad_batches="
            f"{facts.accumulate_grad_batches}). Set one of them: put 'auto' in the config to follow the Trainer, "
            f"or pass accumulate_grad_batches={ga} to the Trainer."
        )
    if facts.gradient_clip_algorithm == "value":
        raise DeepSpeedConfigError(
            "Trainer(gradient_clip_algorithm='value') cannot be used with DeepSpeed, which clips by norm only; "
            "use gradient_clip_algorithm='norm'."
        )
    clip = config.get("gradient_clipping")
    if (
        isinstance(clip, (int, float))
        and not isinstance(clip, bool)
        and facts.gradient_clip_val is not None
        and float(clip) != float(facts.gradient_clip_val)
    ):
        raise DeepSpeedConfigError(
            f"DeepSpeed config 'gradient_clipping' is {clip} but Trainer(gradient_clip_val={facts.gradient_clip_val})."
            " Set one of them: put 'auto' in the config to follow the Trainer, or drop gradient_clip_val."
        )
    if facts.precision is not None and facts.precision != "auto":
        precision = str(facts.precision)
        enabled = [
            n for n in ("fp16", "bf16") if isinstance(config.get(n), Mapping) and config[n].get("enabled") is True
        ]
        if len(enabled) == 2:
            raise DeepSpeedConfigError("DeepSpeed config enables both 'fp16' and 'bf16'; enable at most one.")
        for name in enabled:
            if precision not in _HALF[name]:
                raise DeepSpeedConfigError(
                    f"DeepSpeed config enables {name!r} ('{name}.enabled': true) but Trainer(precision={precision!r})."
                    f" Pass precision={_HALF[name][0]!r} to the Trainer, or set '{name}.enabled' to 'auto' to "
                    "follow the Trainer."
                )
        for name, names in _HALF.items():
            section = config.get(name)
            if precision in names and isinstance(section, Mapping) and section.get("enabled") is False:
                raise DeepSpeedConfigError(
                    f"Trainer(precision={precision!r}) but the DeepSpeed config disables {name!r} "
                    f"('{name}.enabled': false). Set it to true or 'auto', or change the Trainer's precision."
                )
    micro = config.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, int) and facts.micro_batch_size is not None and micro != facts.micro_batch_size:
        raise DeepSpeedConfigError(
            f"DeepSpeed config 'train_micro_batch_size_per_gpu' is {micro} but the train dataloader's batch size is "
            f"{facts.micro_batch_size}. Use 'auto' to follow the dataloader, or make them equal."
        )
    total = config.get("train_batch_size")
    parts = (
        _int_or_none(micro, facts.micro_batch_size),
        _int_or_none(ga, facts.accumulate_grad_batches),
        facts.world_size,
    )
    if isinstance(total, int) and all(p is not None for p in parts):
        expected = parts[0] * parts[1] * parts[2]  # type: ignore[operator]
        if total != expected:
            raise DeepSpeedConfigError(
                f"DeepSpeed config 'train_batch_size' is {total} but micro-batch {parts[0]} x accumulation "
                f"{parts[1]} x world size {parts[2]} = {expected}. Use 'auto', or make them agree."
            )


def _int_or_none(value: Any, fallback: int | None) -> int | None:
    return value if is_int(value) else fallback


def fill_auto(config: Mapping[str, Any], facts: TrainerFacts) -> tuple[dict[str, Any], list[str]]:
    """Check the config against the Trainer, then fill ``"auto"`` (and absent) values from it.

    Args:
        config: A validated DeepSpeed config.
        facts: What the Trainer says; every field must be known.

    Returns:
        The filled config (a copy) and one line per value filled, for the log.

    Raises:
        DeepSpeedConfigError: a conflict between the config and the Trainer.
    """
    check_against_trainer(config, facts)
    out = copy.deepcopy(dict(config))
    notes: list[str] = []

    def fill(key: str, value: Any, why: str) -> None:
        if key not in out or _is_auto(out[key]):
            notes.append(f"{key} = {value!r} ({why})")
            out[key] = value

    ga = facts.accumulate_grad_batches or 1
    micro = facts.micro_batch_size or 1
    fill("gradient_accumulation_steps", ga, "Trainer accumulate_grad_batches")
    fill("train_micro_batch_size_per_gpu", micro, "train dataloader batch size")
    world = facts.world_size or 1
    fill(
        "train_batch_size",
        out["train_micro_batch_size_per_gpu"] * out["gradient_accumulation_steps"] * world,
        "micro-batch x accumulation x world size",
    )
    fill("gradient_clipping", float(facts.gradient_clip_val or 0.0), "Trainer gradient_clip_val")
    precision = str(facts.precision) if facts.precision is not None else "32-true"
    for name, names in _HALF.items():
        section = out.get(name)
        if isinstance(section, Mapping) and _is_auto(section.get("enabled")):
            out[name] = {**section, "enabled": precision in names}
            notes.append(f"{name}.enabled = {precision in names} (Trainer precision {precision!r})")
    return out, notes
