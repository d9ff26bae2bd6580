"""The advisor's answer (:class:`Advice`) and its words: the table ``str(advice)`` prints, and why none fits."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lplugins.strategies._memory import STRATEGY_NAMES, Estimate, device_bytes_per_parameter, gib

__all__ = ["CLI_SPELLING", "PYTHON_SPELLING", "Advice", "Spelling", "explain", "nothing_fits"]


@dataclass(frozen=True)
class Spelling:
    """How the inputs are spelt where the advisor was called from: Python keywords or CLI flags."""

    names: Mapping[str, str]
    cli: bool = False

    def __call__(self, name: str) -> str:
        return self.names.get(name, name)

    def arg(self, name: str, value: object) -> str:
        """``device_memory_gib=80`` in Python, ``--device-memory-gib 80`` on the command line."""
        return f"{self(name)} {value}" if self.cli else f"{self(name)}={value!r}"


PYTHON_SPELLING = Spelling({})
CLI_SPELLING = Spelling(
    {
        "num_parameters": "PARAMETERS",
        "optimizer": "--optimizer",
        "precision": "--precision",
        "device_memory_gib": "--device-memory-gib",
        "devices_per_node": "--devices-per-node",
        "num_nodes": "--nodes",
        "host_memory_gib": "--host-memory-gib",
        "accelerator": "--accelerator",
        "headroom": "--headroom",
    },
    cli=True,
)


@dataclass(frozen=True)
class Advice:
    """The advisor's answer. ``str(advice)`` shows the arithmetic.

    Attributes:
        key: The recommended strategy's key (``"zero2"``...).
        label: Its readable name.
        strategy: The strategy name to use, for the target (``"deepspeed_stage_2"`` on CUDA,
            ``"deepspeed_stage_2_cpu"`` on CPU; see :data:`STRATEGY_NAMES`).
        num_parameters: Parameters in the model.
        world_size: Devices in total (devices per node x nodes).
        usable_device_bytes: Device memory available for weights, gradients and optimizer state.
        host_bytes_per_node: Host memory per node (for offload).
        estimates: Every candidate's arithmetic, in order of preference.
        inputs: The inputs, for the record.
        assumptions: What the advisor assumed or resolved without being told (host memory, a measured
            device, ``precision="auto"``), each as a sentence; ``str(advice)`` shows them.
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
    assumptions: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = asdict(self)
        out["estimates"] = [asdict(e) for e in self.estimates]
        out["inputs"] = dict(self.inputs)
        out["assumptions"] = list(self.assumptions)
        return out

    def __str__(self) -> str:
        return explain(self)


def explain(advice: Advice) -> str:
    """The recommendation with the memory arithmetic, as text."""
    i = advice.inputs
    lines = [
        f"Model: {advice.num_parameters:,} parameters, optimizer {i.get('optimizer')}, precision {i.get('precision')}",
        f"Hardware: {i.get('num_nodes')} node(s) x {i.get('devices_per_node')} {i.get('accelerator')} device(s) = "
        f"{advice.world_size} processes; {gib(advice.usable_device_bytes)} usable per device "
        f"({gib(i.get('device_memory_bytes', 0))} less {i.get('headroom', 0):.0%} headroom for activations)"
        + (f"; host {gib(advice.host_bytes_per_node)} per node" if advice.host_bytes_per_node else ""),
        *(f"Assumed: {a}" for a in advice.assumptions),
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
            f"{_formula(e.key, w, g, o, advice.world_size):<22}{gib(e.device_bytes):>14}  {verdict}"
        )
    lines += ["", f"Recommended: {advice.label} -> strategy={advice.strategy!r}"]
    if advice.key.startswith("zero") and i.get("accelerator") == "cuda":
        lines.append(
            f"Note: with accumulate_grad_batches=k > 1, Lightning's DeepSpeed strategies step with 1/k of the gradient "
            f"(the loss is divided by k twice); lplugins' {STRATEGY_NAMES['cpu'][advice.key]!r} is the same "
            f"strategy on CUDA, dividing once."
        )
    return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:g}"


def _formula(key: str, w: float, g: float, o: float, n: int) -> str:
    per_device = _num(device_bytes_per_parameter(key, w, g, o, n))
    if key == "ddp":
        return f"{per_device} B"
    if key == "zero2":
        return f"{_num(w)}+{_num(g + o)}/{n} = {per_device} B"
    if key in ("fsdp", "zero3"):
        return f"{_num(w + g + o)}/{n} = {per_device} B"
    return "~0 B (host RAM)"


def nothing_fits(
    count: int,
    estimates: Sequence[Estimate],
    usable: float,
    host_usable: float,
    inputs: Mapping[str, Any],
    arg: Callable[[str, object], str] = lambda name, value: f"{name}={value!r}",
) -> str:
    """The message when no strategy fits: what the fully sharded strategies need, and how many nodes would do.

    ``arg(name, value)`` spells an input as the caller writes it (``num_nodes=2``, ``--nodes 2``).
    """
    sharded = next(e for e in estimates if e.key == "zero3")
    total = count * sum(sharded.bytes_per_param)
    per_node = usable * inputs["devices_per_node"]
    nodes_sharded = math.ceil(total / per_node)
    msg = (
        f"No strategy fits {count:,} parameters ({gib(total)} of weights, gradients and optimizer state) on "
        f"{inputs['num_nodes']} node(s) x {inputs['devices_per_node']} device(s) with {gib(usable)} usable each. "
        f"Fully sharded (FSDP / ZeRO-3) it needs {gib(sharded.device_bytes)} per device"
    )
    offload = next(e for e in estimates if e.key == "zero3_offload")
    if offload.available:
        nodes_offload = math.ceil(total / host_usable)
        msg += (
            f"; ZeRO-3 with offload needs {gib(offload.host_bytes_per_node)} host RAM per node, but a node has "
            f"{gib(host_usable)} usable"
        )
        if nodes_offload < nodes_sharded:
            msg += (
                f". It would fit on {nodes_offload} node(s) with ZeRO-3 + offload ({arg('num_nodes', nodes_offload)}),"
                f" on {nodes_sharded} node(s) fully sharded without offload"
            )
        else:
            msg += f". It would fit on {nodes_sharded} node(s) ({arg('num_nodes', nodes_sharded)})"
    else:
        msg += f". It would fit on {nodes_sharded} node(s) ({arg('num_nodes', nodes_sharded)})"
    return msg + ", or with a smaller optimizer state or lower precision."
