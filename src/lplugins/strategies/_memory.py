"""The advisor's memory model: what each strategy keeps on a device, per parameter.

The arithmetic is the ZeRO paper's (Rajbhandari et al., 2020): per parameter, a training job holds
its weights, its gradients and the optimizer state, and each strategy shards a different subset
of them over the ``N`` processes:

============================  ===================  ===============================================
strategy                      per device           note
============================  ===================  ===============================================
DDP                           W + G + O            everything replicated
DeepSpeed ZeRO-2              W + (G + O) / N      gradients and optimizer state sharded
FSDP (FULL_SHARD)             (W + G + O) / N      everything sharded (torch-native)
DeepSpeed ZeRO-3              (W + G + O) / N      everything sharded (DeepSpeed)
DeepSpeed ZeRO-3 + offload    ~0                   (W + G + O) x P / nodes in each node's host RAM
============================  ===================  ===============================================

Bytes per parameter (``W``, ``G``, ``O``) depend on the precision and on who implements it: with
``"bf16-mixed"`` Lightning's DDP/FSDP keep fp32 weights and gradients (4 + 4) and autocast the
compute, while DeepSpeed keeps bf16 weights and gradients (2 + 2) and an fp32 master copy in the
optimizer state (+4). Adam's two moments are 8 bytes. Both add up to 16 bytes per parameter; they
shard differently. Activations are not modelled: the advisor keeps a ``headroom`` free for them.

The hardware: this machine's (:func:`local_gpu`, :func:`host_memory_bytes`) when it is the target;
for another GPU node not described in full, the host memory typical for its GPUs
(:func:`typical_host_memory_gib`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from lplugins._errors import LPluginsError, shown_from
from lplugins._validate import did_you_mean, positive_number

__all__ = [
    "CANDIDATES",
    "GIB",
    "OPTIMIZER_STATE_BYTES",
    "PRECISIONS",
    "STRATEGY_NAMES",
    "TYPICAL_HOST_GIB_PER_GPU",
    "AdvisorError",
    "Estimate",
    "LocalGPU",
    "auto_precision",
    "bytes_per_parameter",
    "device_bytes_per_parameter",
    "gib",
    "host_memory_bytes",
    "local_gpu",
    "optimizer_state_bytes",
    "parse_count",
    "typical_host_memory_gib",
]

GIB = 2**30


class AdvisorError(LPluginsError, ValueError):
    """The advisor was given invalid input, or no strategy fits."""


shown_from("lplugins.strategies", AdvisorError)


#: Optimizer state, in bytes per trainable parameter, with fp32 state.
OPTIMIZER_STATE_BYTES: Mapping[str, float] = {
    "adam": 8,
    "adamw": 8,
    "lion": 4,
    "sgd": 4,  # momentum buffer
    "sgd_nomomentum": 0,
    "rmsprop": 4,
    "adagrad": 4,
    "adam8bit": 2,
}

#: Lightning precision strings, and how the weights are kept: ``"32"``, ``"64"``, ``"mixed"`` (autocast), ``"half"``.
PRECISIONS: Mapping[str, str] = {
    "32-true": "32",
    "32": "32",
    "64-true": "64",
    "16-mixed": "mixed",
    "bf16-mixed": "mixed",
    "16": "mixed",
    "bf16": "mixed",
    "16-true": "half",
    "bf16-true": "half",
}


#: (key, label), in the order they are preferred.
CANDIDATES: tuple[tuple[str, str], ...] = (
    ("ddp", "DDP"),
    ("zero2", "DeepSpeed ZeRO-2"),
    ("fsdp", "FSDP (FULL_SHARD)"),
    ("zero3", "DeepSpeed ZeRO-3"),
    ("zero3_offload", "DeepSpeed ZeRO-3 + CPU offload"),
)

#: The strategy name recommended for each candidate, by target accelerator: Lightning's own names on
#: CUDA, lplugins' names that also run with ``accelerator="cpu"`` on CPU (Lightning's DeepSpeed and
#: FSDP refuse it). ``ddp_timeout`` is DDP with the lplugins process-group timeout, on either.
STRATEGY_NAMES: Mapping[str, Mapping[str, str]] = {
    "cuda": {
        "ddp": "ddp_timeout",
        "zero2": "deepspeed_stage_2",
        "fsdp": "fsdp",
        "zero3": "deepspeed_stage_3",
        "zero3_offload": "deepspeed_stage_3_offload",
    },
    "cpu": {
        "ddp": "ddp_timeout",
        "zero2": "deepspeed_stage_2_cpu",
        "fsdp": "fsdp2",
        "zero3": "deepspeed_stage_3_cpu",
        "zero3_offload": "deepspeed_stage_3_offload_cpu",
    },
}


@dataclass(frozen=True)
class Estimate:
    """The memory one strategy needs.

    Attributes:
        key: ``"ddp"``, ``"zero2"``, ``"fsdp"``, ``"zero3"`` or ``"zero3_offload"``.
        label: A readable name.
        strategy: The strategy name to pass to ``lplugins.compose`` (or Lightning, for ``"fsdp"``; on CPU
            it is lplugins' ``"fsdp2"``).
        bytes_per_param: (weights, gradients, optimizer state) before sharding.
        device_bytes_per_param: What each device holds per parameter of the model.
        device_bytes: Per device, in bytes.
        host_bytes_per_node: Host memory per node for offloaded state, in bytes.
        fits: Whether it fits the device (and, for offload, the host) memory.
        available: Whether the strategy can run here (offload is pointless with ``accelerator="cpu"``).
        note: Why it does not fit or is not available.
    """

    key: str
    label: str
    strategy: str
    bytes_per_param: tuple[float, float, float]
    device_bytes_per_param: float
    device_bytes: float
    host_bytes_per_node: float
    fits: bool
    available: bool
    note: str = ""


def bytes_per_parameter(precision: str, optimizer: str | float, *, deepspeed: bool) -> tuple[float, float, float]:
    """Bytes per parameter for (weights, gradients, optimizer state incl. any fp32 master copy).

    Args:
        precision: A Lightning precision string (``"32-true"``, ``"bf16-mixed"``, ``"16-true"``...).
        optimizer: An optimizer name from :data:`OPTIMIZER_STATE_BYTES`, or its state bytes per
            parameter (fp32) as a number.
        deepspeed: Whether DeepSpeed implements the precision (it keeps half-precision weights and
            an fp32 master copy) rather than Lightning/torch (fp32 weights under autocast).

    Returns:
        ``(weights, gradients, optimizer_state)``.

    Raises:
        AdvisorError: an unknown precision or optimizer.

    Examples:
        >>> bytes_per_parameter("bf16-mixed", "adamw", deepspeed=True)
        (2, 2, 12)
        >>> bytes_per_parameter("bf16-mixed", "adamw", deepspeed=False)
        (4, 4, 8)
    """
    kind = PRECISIONS.get(str(precision))
    if kind is None:
        raise AdvisorError(f"Unknown precision {precision!r}. Known: {', '.join(PRECISIONS)}.")
    state = optimizer_state_bytes(optimizer)
    if kind == "64":
        return (8, 8, state * 2)
    if kind == "32":
        return (4, 4, state)
    if deepspeed:  # DeepSpeed fp16/bf16: half weights and grads, fp32 master weights in the optimizer
        return (2, 2, 4 + state)
    if kind == "mixed":  # torch autocast: fp32 weights and grads
        return (4, 4, state)
    return (2, 2, state / 2)  # "true" half precision: states in the parameter dtype


def optimizer_state_bytes(optimizer: str | float) -> float:
    """The optimizer state in bytes per parameter, for a name or a number.

    Raises:
        AdvisorError: an unknown name (with "did you mean"), or a negative number.
    """
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        unit = "state bytes per parameter"
        return positive_number("optimizer", optimizer, allow_zero=True, error=AdvisorError, unit=unit)
    key = str(optimizer).lower()
    if key not in OPTIMIZER_STATE_BYTES:
        raise AdvisorError(
            f"Unknown optimizer {optimizer!r}. Known: {', '.join(OPTIMIZER_STATE_BYTES)}."
            + did_you_mean(key, OPTIMIZER_STATE_BYTES)
            + " Or pass its state size in bytes per parameter as a number."
        )
    return OPTIMIZER_STATE_BYTES[key]


def device_bytes_per_parameter(key: str, weights: float, grads: float, state: float, world_size: int) -> float:
    """What each device holds per parameter of the model under strategy ``key`` (see the table above).

    Examples:
        >>> device_bytes_per_parameter("zero2", 2, 2, 12, world_size=8)
        3.75
    """
    if key == "ddp":
        return weights + grads + state
    if key == "zero2":
        return weights + (grads + state) / world_size
    if key in ("fsdp", "zero3"):
        return (weights + grads + state) / world_size
    return 0.0  # offloaded to host memory


def parse_count(value: str | float) -> int:
    """Parse a parameter count: ``7e9``, ``"7B"``, ``"1.3b"``, ``"350M"``, ``"125k"``, ``"7_000_000"``.

    Raises:
        AdvisorError: not a positive count.

    Examples:
        >>> parse_count("7B"), parse_count("350M"), parse_count(1.3e9)
        (7000000000, 350000000, 1300000000)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9][0-9_]*\.?[0-9_]*(?:e[0-9]+)?)\s*([kmbt]?)\s*", str(value), re.IGNORECASE)
        if not match:
            raise AdvisorError(f"Cannot read {value!r} as a parameter count; write e.g. 7e9, 7B, 1.3B, 350M.")
        scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
        number = float(match.group(1).replace("_", "")) * scale
    if not math.isfinite(number) or number < 1:
        raise AdvisorError(f"A parameter count must be a positive number, got {value!r}.")
    return round(number)


def host_memory_bytes() -> float:
    """This machine's physical memory, in bytes."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        import psutil

        return float(psutil.virtual_memory().total)


@dataclass(frozen=True)
class LocalGPU:
    """This machine's CUDA devices: how many, the first one's memory (bytes) and name, bf16 support."""

    count: int
    memory: float
    name: str
    bf16: bool


def local_gpu() -> LocalGPU | None:
    """This machine's CUDA devices (the first one's memory and name), or ``None``."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    count = torch.cuda.device_count()
    return LocalGPU(count, float(props.total_memory), str(props.name), bool(torch.cuda.is_bf16_supported()))


def auto_precision(accelerator: str, local: LocalGPU | None) -> tuple[str, str]:
    """``precision="auto"`` for the target, by lplugins' rule (:func:`lplugins.precision.default_precision`)."""
    if accelerator == "cpu":
        return "32-true", "lplugins' precision='auto' rule on CPU, without cpu_bf16=True"
    if local is not None:
        if local.bf16:
            return "bf16-mixed", f"lplugins' precision='auto' rule for this machine's {local.name}, which has bf16"
        return "16-mixed", f"lplugins' precision='auto' rule for this machine's {local.name}, which has no bf16"
    return "bf16-mixed", (
        "lplugins' precision='auto' rule for a CUDA GPU with bf16 (compute capability 8.0+, A100 and later); "
        "for a V100 it picks '16-mixed', which needs the same memory"
    )


#: Host memory per GPU on typical servers, by the GPU's memory: (at least this many GiB per GPU,
#: host GiB per GPU, where the figure comes from). Below the last row: twice the GPU memory.
TYPICAL_HOST_GIB_PER_GPU: tuple[tuple[float, float, str], ...] = (
    (64, 256, "NVIDIA's DGX A100 640GB, DGX H100 and DGX H200 have 2 TiB for 8 GPUs"),
    (32, 128, "NVIDIA's DGX A100 320GB has 1 TiB for 8 GPUs of 40 GB"),
)


def typical_host_memory_gib(device_memory_gib: float, devices_per_node: int) -> tuple[float, str]:
    """Host memory per node typical for a node of ``devices_per_node`` GPUs of ``device_memory_gib``.

    What the advisor assumes for a target it cannot measure (another machine) when it is not told.
    Returns ``(GiB per node, where the figure comes from)``.

    Examples:
        >>> typical_host_memory_gib(80, 8)[0], typical_host_memory_gib(40, 8)[0], typical_host_memory_gib(24, 4)[0]
        (2048, 1024, 192)
    """
    for at_least, per_gpu, source in TYPICAL_HOST_GIB_PER_GPU:
        if device_memory_gib >= at_least:
            return per_gpu * devices_per_node, f"{per_gpu:g} GiB per GPU; {source}"
    per_gpu = 2 * device_memory_gib
    return per_gpu * devices_per_node, "twice the GPU memory, a common rule of thumb"


def gib(n: float) -> str:
    """``n`` bytes in GiB, for messages: ``"1.5 GiB"``."""
    return f"{n / GIB:,.1f} GiB"
