"""The strategy advisor: which of DDP / ZeRO-2 / FSDP / ZeRO-3 / ZeRO-3 + offload fits, and why.

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
shard differently. Activations are not modelled: ``headroom`` (default 20% of device memory) is
kept free for them. Recommendations prefer the least sharding that fits (less communication).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lplugins._errors import LPluginsError, closest

if TYPE_CHECKING:
    from torch.nn import Module

log = logging.getLogger("lplugins")

__all__ = [
    "CANDIDATES",
    "OPTIMIZER_STATE_BYTES",
    "Advice",
    "AdvisorError",
    "Estimate",
    "advise",
    "advised_strategy",
    "bytes_per_parameter",
    "parse_count",
    "register_cli",
]

GIB = 2**30


class AdvisorError(LPluginsError, ValueError):
    """The advisor was given invalid input, or no strategy fits."""


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

#: (key, label, lplugins or Lightning strategy name), in the order they are preferred.
CANDIDATES: tuple[tuple[str, str, str], ...] = (
    ("ddp", "DDP", "ddp_timeout"),
    ("zero2", "DeepSpeed ZeRO-2", "deepspeed_stage_2_cpu"),
    ("fsdp", "FSDP (FULL_SHARD)", "fsdp"),
    ("zero3", "DeepSpeed ZeRO-3", "deepspeed_stage_3_cpu"),
    ("zero3_offload", "DeepSpeed ZeRO-3 + CPU offload", "deepspeed_stage_3_offload_cpu"),
)

_PRECISIONS = {
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

    Example:
        >>> bytes_per_parameter("bf16-mixed", "adamw", deepspeed=True)
        (2, 2, 12)
        >>> bytes_per_parameter("bf16-mixed", "adamw", deepspeed=False)
        (4, 4, 8)
    """
    kind = _PRECISIONS.get(str(precision))
    if kind is None:
        raise AdvisorError(f"Unknown precision {precision!r}. Known: {', '.join(_PRECISIONS)}.")
    state = _optimizer_bytes(optimizer)
    if kind == "64":
        return (8, 8, state * 2)
    if kind == "32":
        return (4, 4, state)
    if deepspeed:  # DeepSpeed fp16/bf16: half weights and grads, fp32 master weights in the optimizer
        return (2, 2, 4 + state)
    if kind == "mixed":  # torch autocast: fp32 weights and grads
        return (4, 4, state)
    return (2, 2, state / 2)  # "true" half precision: states in the parameter dtype


def _optimizer_bytes(optimizer: str | float) -> float:
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if optimizer < 0 or not math.isfinite(optimizer):
            raise AdvisorError(f"optimizer state bytes per parameter must be >= 0, got {optimizer!r}.")
        return optimizer
    key = str(optimizer).lower()
    if key not in OPTIMIZER_STATE_BYTES:
        hint = closest(key, OPTIMIZER_STATE_BYTES)
        raise AdvisorError(
            f"Unknown optimizer {optimizer!r}. Known: {', '.join(OPTIMIZER_STATE_BYTES)}"
            + (f". Did you mean {hint!r}?" if hint else "")
            + "; or pass its state size in bytes per parameter as a number."
        )
    return OPTIMIZER_STATE_BYTES[key]


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


@dataclass(frozen=True)
class Advice:
    """The advisor's answer. ``str(advice)`` shows the arithmetic.

    Attributes:
        key: The recommended strategy's key (``"zero2"``...).
        label: Its readable name.
        strategy: The strategy name to use (``"deepspeed_stage_2_cpu"``...).
        num_parameters: Parameters in the model.
        world_size: Devices in total (devices per node x nodes).
        usable_device_bytes: Device memory available for weights, gradients and optimizer state.
        host_bytes_per_node: Host memory per node (for offload).
        estimates: Every candidate's arithmetic, in order of preference.
        inputs: The inputs, for the record.
    """

    key: str
    label: str
    strategy: str
    num_parameters: int
    world_size: int
    usable_device_bytes: float
    host_bytes_per_node: float | None
    estimates: tuple[Estimate, ...]
    inputs: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = asdict(self)
        out["estimates"] = [asdict(e) for e in self.estimates]
        out["inputs"] = dict(self.inputs)
        return out

    def __str__(self) -> str:
        return explain(self)


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def explain(advice: Advice) -> str:
    """The recommendation with the memory arithmetic, as text."""
    i = advice.inputs
    lines = [
        f"Model: {advice.num_parameters:,} parameters, optimizer {i.get('optimizer')}, precision {i.get('precision')}",
        f"Hardware: {i.get('num_nodes')} node(s) x {i.get('devices_per_node')} {i.get('accelerator')} device(s) = "
        f"{advice.world_size} processes; {_gib(advice.usable_device_bytes)} usable per device "
        f"({_gib(i.get('device_memory_bytes', 0))} less {i.get('headroom', 0):.0%} headroom for activations)"
        + (f"; host {_gib(advice.host_bytes_per_node)} per node" if advice.host_bytes_per_node else ""),
        "",
        f"{'strategy':<32}{'bytes/param W+G+O':<20}{'per device':<22}{'per device':>14}  verdict",
    ]
    for e in advice.estimates:
        w, g, o = e.bytes_per_param
        verdict = "fits" if e.fits else ("n/a" if not e.available else "does not fit")
        if e.note:
            verdict += f" ({e.note})"
        lines.append(
            f"{e.label:<32}{f'{_num(w)}+{_num(g)}+{_num(o)}={_num(w + g + o)}':<20}"
            f"{_formula(e.key, w, g, o, advice.world_size):<22}{_gib(e.device_bytes):>14}  {verdict}"
        )
    lines += ["", f"Recommended: {advice.label} -> strategy={advice.strategy!r}"]
    return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:g}"


def _formula(key: str, w: float, g: float, o: float, n: int) -> str:
    if key == "ddp":
        return f"{_num(w + g + o)} B"
    if key == "zero2":
        return f"{_num(w)}+{_num(g + o)}/{n} = {_num(w + (g + o) / n)} B"
    if key in ("fsdp", "zero3"):
        return f"{_num(w + g + o)}/{n} = {_num((w + g + o) / n)} B"
    return "~0 B (host RAM)"


def parse_count(value: str | float) -> int:
    """Parse a parameter count: ``7e9``, ``"7B"``, ``"1.3b"``, ``"350M"``, ``"125k"``, ``"7_000_000"``.

    Raises:
        AdvisorError: not a positive count.

    Example:
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


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        import psutil

        return float(psutil.virtual_memory().total)


def _positive(name: str, value: Any, *, integer: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        raise AdvisorError(f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}.")


def advise(
    num_parameters: float | str | None = None,
    *,
    model: Module | None = None,
    optimizer: str | float = "adamw",
    precision: str = "bf16-mixed",
    device_memory_gib: float | None = None,
    devices_per_node: int = 1,
    num_nodes: int = 1,
    host_memory_gib: float | None = None,
    accelerator: str = "cuda",
    headroom: float = 0.2,
    prefer_deepspeed: bool = False,
) -> Advice:
    """Recommend a strategy for a model on given hardware, with the memory arithmetic.

    Args:
        num_parameters: The parameter count (``7e9``, ``"7B"``); or give ``model``.
        model: A ``torch.nn.Module`` whose parameters are counted.
        optimizer: An optimizer name (:data:`OPTIMIZER_STATE_BYTES`) or its state bytes per parameter.
        precision: A Lightning precision string.
        device_memory_gib: Memory per device in GiB. Default: the first CUDA device's memory, or on
            CPU the host memory divided by ``devices_per_node``.
        devices_per_node: Processes (GPUs) per node.
        num_nodes: Nodes.
        host_memory_gib: Host RAM per node in GiB, for offload. Default: this machine's RAM.
        accelerator: ``"cuda"`` (or ``"gpu"``) or ``"cpu"``. On CPU, FSDP is lplugins' ``"fsdp2"``
            (Lightning's FSDP refuses CPU), and offload is pointless (the device memory is host memory).
        headroom: Fraction of device memory kept free for activations and buffers (0 <= h < 1).
        prefer_deepspeed: Recommend DeepSpeed ZeRO-3 rather than FSDP when both fit.

    Returns:
        The :class:`Advice`; ``print(advice)`` shows the table.

    Raises:
        AdvisorError: invalid input, or nothing fits (the message says how many nodes would do).

    Example:
        >>> advice = advise("13B", device_memory_gib=80, devices_per_node=8, host_memory_gib=1024)
        >>> advice.strategy
        'deepspeed_stage_2_cpu'
    """
    if (num_parameters is None) == (model is None):
        raise AdvisorError("Give either num_parameters or model (not both).")
    if model is not None:
        count = sum(p.numel() for p in model.parameters())
        if count < 1:
            raise AdvisorError("The model has no parameters.")
    else:
        assert num_parameters is not None
        count = parse_count(num_parameters)
    accelerator = {"gpu": "cuda"}.get(str(accelerator), str(accelerator))
    if accelerator not in ("cuda", "cpu"):
        raise AdvisorError(f"accelerator={accelerator!r} is not supported by the advisor; use 'cuda' or 'cpu'.")
    _positive("devices_per_node", devices_per_node, integer=True)
    _positive("num_nodes", num_nodes, integer=True)
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise AdvisorError(f"headroom must be a fraction in [0, 1), got {headroom!r}.")
    host_bytes = host_memory_gib * GIB if host_memory_gib is not None else _host_memory_bytes()
    _positive("host_memory_gib", host_bytes / GIB)
    if device_memory_gib is None:
        if accelerator == "cpu":
            device_bytes_total = host_bytes / devices_per_node
        else:
            import torch

            if not torch.cuda.is_available():
                raise AdvisorError("No CUDA device here to measure: pass device_memory_gib (e.g. 80 for an H100).")
            device_bytes_total = float(torch.cuda.get_device_properties(0).total_memory)
    else:
        _positive("device_memory_gib", device_memory_gib)
        device_bytes_total = device_memory_gib * GIB
    world = int(devices_per_node) * int(num_nodes)
    usable = device_bytes_total * (1 - headroom)

    estimates: list[Estimate] = []
    for key, label, strategy in CANDIDATES:
        ds = key.startswith("zero")
        w, g, o = bytes_per_parameter(precision, optimizer, deepspeed=ds)
        host_per_node = 0.0
        if key == "ddp":
            per_param = w + g + o
        elif key == "zero2":
            per_param = w + (g + o) / world
        elif key in ("fsdp", "zero3"):
            per_param = (w + g + o) / world
        else:
            per_param = 0.0
            host_per_node = count * (w + g + o) / num_nodes
        device_need = per_param * count
        available, note = True, ""
        if key == "fsdp" and accelerator == "cpu":
            strategy, note = "fsdp2", "FSDP2 (lplugins' 'fsdp2'): Lightning's FSDP refuses accelerator='cpu'"
        if key == "zero3_offload" and accelerator == "cpu":
            available, note = False, "on CPU the device memory is host memory already"
        fits = available and device_need <= usable
        if key == "zero3_offload" and available:
            fits = host_per_node <= host_bytes * (1 - headroom)
            if not fits:
                note = f"needs {_gib(host_per_node)} host RAM per node"
        estimates.append(
            Estimate(key, label, strategy, (w, g, o), per_param, device_need, host_per_node, fits, available, note)
        )

    order = [e for e in estimates if e.fits]
    if prefer_deepspeed:
        order.sort(key=lambda e: e.key == "fsdp")
    inputs = {
        "optimizer": optimizer,
        "precision": precision,
        "accelerator": accelerator,
        "devices_per_node": int(devices_per_node),
        "num_nodes": int(num_nodes),
        "device_memory_bytes": device_bytes_total,
        "headroom": headroom,
        "prefer_deepspeed": prefer_deepspeed,
    }
    if not order:
        raise AdvisorError(_impossible(count, estimates, usable, host_bytes * (1 - headroom), inputs))
    best = order[0]
    return Advice(best.key, best.label, best.strategy, count, world, usable, host_bytes, tuple(estimates), inputs)


def _impossible(
    count: int, estimates: Sequence[Estimate], usable: float, host_usable: float, inputs: Mapping[str, Any]
) -> str:
    sharded = next(e for e in estimates if e.key == "zero3")
    total = count * sum(sharded.bytes_per_param)
    per_node = usable * inputs["devices_per_node"]
    nodes_sharded = math.ceil(total / per_node)
    msg = (
        f"No strategy fits {count:,} parameters ({_gib(total)} of weights, gradients and optimizer state) on "
        f"{inputs['num_nodes']} node(s) x {inputs['devices_per_node']} device(s) with {_gib(usable)} usable each. "
        f"Fully sharded (FSDP / ZeRO-3) it needs {_gib(sharded.device_bytes)} per device"
    )
    offload = next(e for e in estimates if e.key == "zero3_offload")
    if offload.available:
        nodes_offload = math.ceil(total / host_usable)
        msg += (
            f"; ZeRO-3 with offload needs {_gib(offload.host_bytes_per_node)} host RAM per node, but a node has "
            f"{_gib(host_usable)} usable"
        )
        msg += f". It would fit on {min(nodes_sharded, nodes_offload)} node(s)"
    else:
        msg += f". It would fit on {nodes_sharded} node(s)"
    return msg + ", or with a smaller optimizer state or lower precision."


# ---------------------------------------------------------------------- the named strategy "advised"
def _devices_from(value: Any, accelerator: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if accelerator == "cuda":
        import torch

        return max(torch.cuda.device_count(), 1)
    return 1


def advised_strategy(
    trainer_kwargs: Mapping[str, Any] | None = None,
    *,
    num_parameters: float | str | None = None,
    model: Module | None = None,
    optimizer: str | float = "adamw",
    precision: str | None = None,
    device_memory_gib: float | None = None,
    devices_per_node: int | None = None,
    num_nodes: int | None = None,
    host_memory_gib: float | None = None,
    accelerator: str | None = None,
    headroom: float = 0.2,
    prefer_deepspeed: bool = False,
    **strategy_kwargs: Any,
) -> Any:
    """Build the strategy :func:`advise` recommends, reading the hardware from the Trainer arguments.

    Used as ``lplugins.compose(strategy={"name": "advised", "num_parameters": 7e9}, devices=8, ...)``:
    ``accelerator``, ``devices``, ``num_nodes`` and ``precision`` come from the Trainer arguments
    unless given here. ``strategy_kwargs`` go to the chosen strategy (e.g. ``timeout=``).

    Returns:
        A strategy object; its ``lplugins_advice`` attribute holds the :class:`Advice`.

    Raises:
        AdvisorError: as :func:`advise`.
    """
    if num_parameters is None and model is None:
        raise AdvisorError(
            "The 'advised' strategy needs the model size: pass "
            "strategy={'name': 'advised', 'num_parameters': 7e9} (or 'model': module) to lplugins.compose()."
        )
    tk = dict(trainer_kwargs or {})
    if accelerator is None:
        accelerator = str(tk.get("accelerator") or "auto")
    if accelerator in ("auto", "gpu"):
        import torch

        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if devices_per_node is None:
        devices_per_node = _devices_from(tk.get("devices", "auto"), accelerator)
    if num_nodes is None:
        num_nodes = int(tk.get("num_nodes", 1))
    if precision is None:
        p = tk.get("precision")
        precision = str(p) if p is not None and str(p) in _PRECISIONS else "32-true"
    advice = advise(
        num_parameters,
        model=model,
        optimizer=optimizer,
        precision=precision,
        device_memory_gib=device_memory_gib,
        devices_per_node=devices_per_node,
        num_nodes=num_nodes,
        host_memory_gib=host_memory_gib,
        accelerator=accelerator,
        headroom=headroom,
        prefer_deepspeed=prefer_deepspeed,
    )
    log.info("lplugins: advisor\n%s", advice)
    strategy = _build(advice.key, strategy_kwargs, tk, accelerator)
    strategy.lplugins_advice = advice
    return strategy


def _build(key: str, kwargs: dict[str, Any], trainer_kwargs: Mapping[str, Any], accelerator: str = "cuda") -> Any:
    from lplugins.strategies.timeout import resolve_timeout

    if key == "fsdp" and accelerator == "cpu":
        from lplugins.strategies.fsdp2 import FSDP2Strategy

        return FSDP2Strategy(**kwargs)
    if key == "ddp":
        from lplugins.strategies.ddp import DDPStrategy

        return DDPStrategy(**kwargs)
    if key == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        kwargs.setdefault("sharding_strategy", "FULL_SHARD")
        kwargs["timeout"] = resolve_timeout(kwargs.get("timeout"))
        return FSDPStrategy(**kwargs)
    from lplugins.strategies.deepspeed import DeepSpeedStrategy

    stage = 2 if key == "zero2" else 3
    offload = key == "zero3_offload"
    strategy = DeepSpeedStrategy(stage=stage, offload_optimizer=offload, offload_parameters=offload, **kwargs)
    if trainer_kwargs:
        strategy.check_trainer_kwargs(trainer_kwargs)
    return strategy


# ---------------------------------------------------------------------- CLI
def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``advise`` subcommand to the ``lplugins`` command's subparsers.

    Returns:
        The subcommand's parser.
    """
    p = subparsers.add_parser(
        "advise",
        help="recommend a distributed strategy for a model size and hardware",
        description="Recommend DDP / DeepSpeed ZeRO-2 / FSDP / ZeRO-3 / ZeRO-3 + offload for a model, with the "
        "memory arithmetic (bytes per parameter for weights, gradients and optimizer state, per strategy).",
    )
    p.add_argument("parameters", help="parameter count: 7e9, 7B, 1.3B, 350M")
    p.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZER_STATE_BYTES)} (default adamw)")
    p.add_argument("--precision", default="bf16-mixed", help="Lightning precision (default bf16-mixed)")
    p.add_argument("--device-memory-gib", type=float, default=None, help="memory per GPU (default: measured)")
    p.add_argument("--devices-per-node", type=int, default=1, help="GPUs (processes) per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--host-memory-gib", type=float, default=None, help="host RAM per node (default: this machine's)")
    p.add_argument("--accelerator", default="cuda", choices=["cuda", "gpu", "cpu"])
    p.add_argument("--headroom", type=float, default=0.2, help="fraction of device memory kept for activations")
    p.add_argument("--prefer-deepspeed", action="store_true", help="ZeRO-3 rather than FSDP when both fit")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_advise)
    return p


def _cmd_advise(args: argparse.Namespace) -> int:
    advice = advise(
        args.parameters,
        optimizer=args.optimizer,
        precision=args.precision,
        device_memory_gib=args.device_memory_gib,
        devices_per_node=args.devices_per_node,
        num_nodes=args.nodes,
        host_memory_gib=args.host_memory_gib,
        accelerator=args.accelerator,
        headroom=args.headroom,
        prefer_deepspeed=args.prefer_deepspeed,
    )
    print(json.dumps(advice.as_dict(), indent=2) if args.json else str(advice))
    return 0
