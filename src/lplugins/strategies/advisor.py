"""The strategy advisor: which of DDP / ZeRO-2 / FSDP / ZeRO-3 / ZeRO-3 + offload fits, and why.

Three parts: the memory model (bytes per parameter, per strategy, and what is assumed about a target
it cannot measure: :mod:`lplugins.strategies._memory`, which shows the ZeRO paper's table), the
recommendation and the named strategy ``"advised"`` (here), and the words, Python's or the CLI's
(:mod:`lplugins.strategies._advice_text`). Activations are not modelled: ``headroom``
(default 20% of device memory) is kept free for them. Recommendations prefer the least sharding
that fits (less communication).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lplugins._log import announce
from lplugins._validate import did_you_mean, is_int, positive_int, positive_number
from lplugins.strategies._advice_text import CLI_SPELLING, PYTHON_SPELLING, Advice, Spelling, explain, nothing_fits
from lplugins.strategies._memory import (
    CANDIDATES,
    GIB,
    OPTIMIZER_STATE_BYTES,
    PRECISIONS,
    STRATEGY_NAMES,
    AdvisorError,
    Estimate,
    auto_precision,
    bytes_per_parameter,
    device_bytes_per_parameter,
    gib,
    host_memory_bytes,
    local_gpu,
    optimizer_state_bytes,
    parse_count,
    typical_host_memory_gib,
)

if TYPE_CHECKING:
    from torch.nn import Module


__all__ = [
    "CANDIDATES",
    "OPTIMIZER_STATE_BYTES",
    "STRATEGY_NAMES",
    "Advice",
    "AdvisorError",
    "Estimate",
    "advise",
    "advised_strategy",
    "bytes_per_parameter",
    "explain",
    "parse_count",
    "register_cli",
]


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

    The hardware is the *target's*: this machine is measured only when the target is this machine.
    Whatever the advisor assumes is listed in :attr:`Advice.assumptions` and in ``str(advice)``.

    Args:
        num_parameters: The parameter count (``7e9``, ``"7B"``); or give ``model``.
        model: A ``torch.nn.Module`` whose parameters are counted.
        optimizer: An optimizer name (:data:`OPTIMIZER_STATE_BYTES`) or its state bytes per parameter.
        precision: A Lightning precision string, or ``"auto"``: what lplugins' ``precision="auto"``
            picks for the target (``"32-true"`` on CPU, ``"bf16-mixed"`` on a CUDA GPU with bf16).
        device_memory_gib: Memory per device in GiB. Default: this machine's first CUDA device, or on
            CPU the host memory divided by ``devices_per_node``.
        devices_per_node: Processes (GPUs) per node.
        num_nodes: Nodes.
        host_memory_gib: Host RAM per node in GiB, for offload. Default: this machine's RAM when the
            target is this machine (its GPUs, as many as it has, or CPU); for other GPU nodes, what is
            typical for their GPUs (2,048 GiB for 8 x 80 GiB, see
            :func:`~lplugins.strategies._memory.typical_host_memory_gib`), stated in the advice.
        accelerator: ``"cuda"`` (or ``"gpu"``), ``"cpu"``, or ``"auto"`` (this machine's). On CPU, FSDP
            is lplugins' ``"fsdp2"`` (Lightning's FSDP refuses CPU), and offload is pointless (the device
            memory is host memory).
        headroom: Fraction of device memory kept free for activations and buffers (0 <= h < 1).
        prefer_deepspeed: Recommend DeepSpeed ZeRO-3 rather than FSDP when both fit.

    Returns:
        The :class:`Advice`; ``print(advice)`` shows the table.

    Raises:
        AdvisorError: invalid input, or nothing fits (the message says how many nodes would do).

    Examples:
        >>> advice = advise("13B", device_memory_gib=80, devices_per_node=8)
        >>> advice.strategy
        'deepspeed_stage_2'
        >>> print(advice.assumptions[0][:63])
        host memory 2,048.0 GiB per node, typical for 8 x 80.0 GiB GPUs
        >>> advise("13B", accelerator="cpu", devices_per_node=8, device_memory_gib=80, precision="auto").strategy
        'fsdp2'
    """
    return _advise(
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


def _advise(
    num_parameters: float | str | None,
    *,
    model: Module | None,
    optimizer: str | float,
    precision: str,
    device_memory_gib: float | None,
    devices_per_node: int,
    num_nodes: int,
    host_memory_gib: float | None,
    accelerator: str,
    headroom: float,
    prefer_deepspeed: bool,
    spelling: Spelling = PYTHON_SPELLING,
    notes: tuple[str, ...] = (),
) -> Advice:
    n = spelling
    if (num_parameters is None) == (model is None):
        raise AdvisorError("Give either num_parameters or model (not both).")
    if model is not None:
        count = sum(p.numel() for p in model.parameters())
        if count < 1:
            raise AdvisorError("The model has no parameters.")
    else:
        assert num_parameters is not None
        count = parse_count(num_parameters)
    notes_ = list(notes)
    accelerator = {"gpu": "cuda"}.get(str(accelerator), str(accelerator))
    if accelerator == "auto":
        accelerator = "cuda" if local_gpu() is not None else "cpu"
        notes_.append(f"accelerator 'auto' -> {accelerator!r}, this machine's")
    if accelerator not in ("cuda", "cpu"):
        raise AdvisorError(
            f"{n('accelerator')}={accelerator!r} is not supported by the advisor; use 'cuda' (or 'gpu') or 'cpu'."
        )
    positive_int(n("devices_per_node"), devices_per_node, error=AdvisorError)
    positive_int(n("num_nodes"), num_nodes, error=AdvisorError)
    if not (isinstance(headroom, (int, float)) and not isinstance(headroom, bool) and 0 <= headroom < 1):
        raise AdvisorError(f"{n('headroom')} must be a fraction in [0, 1), got {headroom!r}.")
    positive_number(n("host_memory_gib"), host_memory_gib, optional=True, error=AdvisorError)
    positive_number(n("device_memory_gib"), device_memory_gib, optional=True, error=AdvisorError)
    if str(precision) != "auto" and str(precision) not in PRECISIONS:
        raise AdvisorError(
            f"{n('precision')}={precision!r} is not a precision the advisor knows; use 'auto' or one of "
            f"{', '.join(PRECISIONS)}." + did_you_mean(precision, ["auto", *PRECISIONS])
        )
    optimizer_state_bytes(optimizer)  # an unknown optimizer is an error before anything is measured

    local = local_gpu() if accelerator == "cuda" else None
    if device_memory_gib is not None:
        device_bytes_total = device_memory_gib * GIB
    elif accelerator == "cuda":
        if local is None:
            raise AdvisorError(
                f"No CUDA device here to measure: pass {n.arg('device_memory_gib', 80)} (the memory of one GPU in "
                f"GiB: 80 for an H100 or A100 80GB), or {n.arg('accelerator', 'cpu')} to advise for this machine's CPU."
            )
        device_bytes_total = local.memory
        notes_.append(f"device memory {gib(local.memory)}, measured on this machine's {local.name}")
    this_machine = accelerator == "cpu" or (
        local is not None
        and devices_per_node <= local.count
        and abs(device_bytes_total - local.memory) <= 0.05 * local.memory
    )
    flag = n("host_memory_gib")
    if host_memory_gib is not None:
        host_bytes = host_memory_gib * GIB
    elif accelerator == "cpu" and device_memory_gib is not None:
        host_bytes = device_memory_gib * devices_per_node * GIB
        notes_.append(
            f"host memory {gib(host_bytes)} per node = {n('device_memory_gib')} x {n('devices_per_node')}, as on "
            f"CPU the processes share the host's memory; pass {flag} to say otherwise"
        )
    elif this_machine:
        host_bytes = host_memory_bytes()
        notes_.append(f"host memory {gib(host_bytes)} per node, this machine's; pass {flag} for other nodes")
    else:
        per_node, source = typical_host_memory_gib(device_bytes_total / GIB, devices_per_node)
        host_bytes = per_node * GIB
        notes_.append(
            f"host memory {gib(host_bytes)} per node, typical for {devices_per_node} x {gib(device_bytes_total)} "
            f"GPUs ({source}); pass {flag} for yours"
        )
    if device_memory_gib is None and accelerator == "cpu":
        device_bytes_total = host_bytes / devices_per_node
    if str(precision) == "auto":
        precision, why = auto_precision(accelerator, local if this_machine else None)
        notes_.append(f"precision 'auto' -> {precision!r}: {why}")
    world = devices_per_node * num_nodes
    usable = device_bytes_total * (1 - headroom)
    names = STRATEGY_NAMES[accelerator]

    estimates: list[Estimate] = []
    for key, label in CANDIDATES:
        ds = key.startswith("zero")
        w, g, o = bytes_per_parameter(precision, optimizer, deepspeed=ds)
        per_param = device_bytes_per_parameter(key, w, g, o, world)
        host_per_node = count * (w + g + o) / num_nodes if key == "zero3_offload" else 0.0
        device_need = per_param * count
        available, note = True, ""
        if key == "fsdp" and accelerator == "cpu":
            note = "FSDP2 (lplugins' 'fsdp2'): Lightning's FSDP refuses accelerator='cpu'"
        if key == "zero3_offload" and accelerator == "cpu":
            available, note = False, "on CPU the device memory is host memory already"
        fits = available and device_need <= usable
        if key == "zero3_offload" and available:
            fits = host_per_node <= host_bytes * (1 - headroom)
            if not fits:
                note = f"needs {gib(host_per_node)} host RAM per node"
        estimates.append(
            Estimate(key, label, names[key], (w, g, o), per_param, device_need, host_per_node, fits, available, note)
        )

    order = [e for e in estimates if e.fits]
    if prefer_deepspeed:
        order.sort(key=lambda e: e.key == "fsdp")
    inputs = {
        "optimizer": optimizer,
        "precision": precision,
        "accelerator": accelerator,
        "devices_per_node": devices_per_node,
        "num_nodes": num_nodes,
        "device_memory_bytes": device_bytes_total,
        "host_memory_bytes": host_bytes,
        "headroom": headroom,
        "prefer_deepspeed": prefer_deepspeed,
    }
    if not order:
        message = nothing_fits(count, estimates, usable, host_bytes * (1 - headroom), inputs, n.arg)
        raise AdvisorError(message + (f" Assumed: {'; '.join(notes_)}." if notes_ else ""))
    best = order[0]
    found = (best.key, best.label, best.strategy, count, world, usable, host_bytes)
    return Advice(*found, tuple(estimates), inputs, tuple(notes_))


# ---------------------------------------------------------------------- the named strategy "advised"
def _devices_from(value: Any, accelerator: str) -> int:
    if is_int(value) and value > 0:
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
    notes: list[str] = []
    if accelerator is None:
        accelerator = str(tk.get("accelerator") or "auto")
    if accelerator in ("auto", "gpu"):
        import torch

        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if devices_per_node is None:
        devices_per_node = _devices_from(tk.get("devices", "auto"), accelerator)
    if num_nodes is None:
        num_nodes = tk.get("num_nodes", 1)
    if precision is None:
        p = tk.get("precision")
        if p is None:
            precision = "32-true"
            notes.append("precision '32-true', Lightning's default: the Trainer was given none")
        elif str(p) in PRECISIONS or str(p) == "auto":
            precision = str(p)
        else:
            precision = "32-true"
            notes.append(f"precision {p!r} is not one the advisor models; counted as '32-true'")
    advice = _advise(
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
        notes=tuple(notes),
    )
    announce("lplugins: the 'advised' strategy\n%s", advice)
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
    p.add_argument(
        "--optimizer",
        default="adamw",
        help=f"one of {', '.join(OPTIMIZER_STATE_BYTES)}, or its state in bytes per parameter (default adamw)",
    )
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        help="Lightning precision, or 'auto' (what lplugins' precision='auto' picks for the target); "
        "default bf16-mixed",
    )
    p.add_argument(
        "--device-memory-gib", type=float, default=None, help="memory per GPU in GiB (default: this machine's GPU)"
    )
    p.add_argument("--devices-per-node", type=int, default=1, help="GPUs (processes) per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument(
        "--host-memory-gib",
        type=float,
        default=None,
        help="host RAM per node in GiB (default: this machine's when advising for it, else typical for the GPUs, "
        "e.g. 2048 for 8 x 80 GiB; the advice says which)",
    )
    p.add_argument("--accelerator", default="cuda", choices=["cuda", "gpu", "cpu", "auto"])
    p.add_argument("--headroom", type=float, default=0.2, help="fraction of device memory kept for activations")
    p.add_argument("--prefer-deepspeed", action="store_true", help="ZeRO-3 rather than FSDP when both fit")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_advise)
    return p


def _cmd_advise(args: argparse.Namespace) -> int:
    optimizer: str | float = args.optimizer
    try:
        optimizer = float(args.optimizer)
    except ValueError:
        pass
    advice = _advise(
        args.parameters,
        model=None,
        optimizer=optimizer,
        precision=args.precision,
        device_memory_gib=args.device_memory_gib,
        devices_per_node=args.devices_per_node,
        num_nodes=args.nodes,
        host_memory_gib=args.host_memory_gib,
        accelerator=args.accelerator,
        headroom=args.headroom,
        prefer_deepspeed=args.prefer_deepspeed,
        spelling=CLI_SPELLING,
    )
    print(json.dumps(advice.as_dict(), indent=2) if args.json else str(advice))
    return 0
