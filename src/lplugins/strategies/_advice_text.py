"""The advisor's words: the table ``str(advice)`` prints, and the message when nothing fits."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lplugins.strategies._memory import Estimate, device_bytes_per_parameter, gib

if TYPE_CHECKING:
    from lplugins.strategies.advisor import Advice

__all__ = ["explain", "nothing_fits"]


def explain(advice: Advice) -> str:
    """The recommendation with the memory arithmetic, as text."""
    i = advice.inputs
    lines = [
        f"Model: {advice.num_parameters:,} parameters, optimizer {i.get('optimizer')}, precision {i.get('precision')}",
        f"Hardware: {i.get('num_nodes')} node(s) x {i.get('devices_per_node')} {i.get('accelerator')} device(s) = "
        f"{advice.world_size} processes; {gib(advice.usable_device_bytes)} usable per device "
        f"({gib(i.get('device_memory_bytes', 0))} less {i.get('headroom', 0):.0%} headroom for activations)"
        + (f"; host {gib(advice.host_bytes_per_node)} per node" if advice.host_bytes_per_node else ""),
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
    count: int, estimates: Sequence[Estimate], usable: float, host_usable: float, inputs: Mapping[str, Any]
) -> str:
    """The message when no strategy fits: what the fully sharded strategies need, and how many nodes would do."""
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
        msg += f". It would fit on {min(nodes_sharded, nodes_offload)} node(s)"
    else:
        msg += f". It would fit on {nodes_sharded} node(s)"
    return msg + ", or with a smaller optimizer state or lower precision."
