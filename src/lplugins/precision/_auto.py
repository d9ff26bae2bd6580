"""``precision="auto"``: the decision rule and the hardware probe."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

#: Lightning's own precision inputs, accepted unchanged.
LIGHTNING_PRECISIONS: tuple[str, ...] = (
    "transformer-engine",
    "transformer-engine-float16",
    "16-true",
    "16-mixed",
    "bf16-true",
    "bf16-mixed",
    "32-true",
    "64-true",
    "64",
    "32",
    "16",
    "bf16",
)


def default_precision(accelerator: str, capabilities: Mapping[str, Any]) -> tuple[str, str]:
    """lplugins' own rule for ``precision="auto"``: returns ``(precision, reason)``.

    Examples:
        >>> default_precision("cpu", {})
        ('32-true', 'CPU: full precision is fastest and exact unless CPU bf16 is opted into (cpu_bf16=True)')
        >>> default_precision("cuda", {"bf16_supported": True, "cuda_capability": (9, 0)})[0]
        'bf16-mixed'
        >>> default_precision("cuda", {"bf16_supported": False, "cuda_capability": (7, 0)})[0]
        '16-mixed'
    """
    if accelerator == "cuda":
        cap = capabilities.get("cuda_capability")
        where = f"CUDA device with compute capability {cap[0]}.{cap[1]}" if cap else "CUDA device"
        if capabilities.get("bf16_supported"):
            return "bf16-mixed", f"{where} supports bf16: bf16 mixed precision needs no loss scaling"
        return "16-mixed", f"{where} has no bf16 support: fp16 mixed precision with loss scaling"
    if accelerator == "cpu":
        if capabilities.get("cpu_bf16"):
            return "bf16-mixed", "CPU with cpu_bf16=True: bf16 autocast on CPU"
        return "32-true", "CPU: full precision is fastest and exact unless CPU bf16 is opted into (cpu_bf16=True)"
    return "32-true", f"accelerator {accelerator!r}: no mixed precision known to be supported, using full precision"


def resolve_accelerator(accelerator: object) -> str:
    """The accelerator a Trainer will use for ``accelerator`` (``"auto"``/``None`` probes the machine)."""
    if accelerator is None or accelerator == "auto":
        import torch

        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return "mps"
        return "cpu"
    if isinstance(accelerator, str):
        return {"gpu": "cuda"}.get(accelerator, accelerator)
    name = type(accelerator).__name__.lower()
    for known in ("cuda", "cpu", "mps", "xla"):
        if known in name:
            return known
    return name


def probe_capabilities(accelerator: str, *, cpu_bf16: bool = False) -> dict[str, Any]:
    """Facts about the hardware that ``auto`` decides on.

    Raises:
        CompositionError: ``accelerator="cuda"`` on a machine without a CUDA device.
    """
    caps: dict[str, Any] = {"cpu_bf16": cpu_bf16}
    if accelerator == "cuda":
        import torch

        if not torch.cuda.is_available():
            from lplugins._errors import CompositionError

            raise CompositionError(
                "precision='auto' with accelerator='cuda'/'gpu': no CUDA device is available here, so there is no "
                "hardware to choose for. Use accelerator='auto' or 'cpu', or give a precision name."
            )
        caps["cuda_capability"] = tuple(torch.cuda.get_device_capability())
        caps["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
        caps["device_name"] = torch.cuda.get_device_name()
    return caps


class PluginHooks(Protocol):
    """Anything with pluggy's hook relay for the lplugins hooks, such as :class:`lplugins.PluginManager`."""

    @property
    def hook(self) -> Any: ...


def choose_precision(accelerator: str, capabilities: Mapping[str, Any], manager: PluginHooks) -> tuple[str, str]:
    """What ``precision="auto"`` becomes: plugins are asked first (``lplugins_choose_precision``,
    latest-loaded first), then :func:`default_precision` decides. Returns ``(precision, reason)``.

    Args:
        accelerator: ``"cpu"``, ``"cuda"``, ...
        capabilities: hardware facts (see :func:`probe_capabilities`).
        manager: the plugin manager whose plugins are asked (``lplugins.get_manager()`` for the
            process-wide one).

    Examples:
        >>> import types
        >>> nobody = types.SimpleNamespace(hook=types.SimpleNamespace(lplugins_choose_precision=lambda **kw: None))
        >>> choose_precision("cuda", {"bf16_supported": True}, nobody)
        ('bf16-mixed', 'CUDA device supports bf16: bf16 mixed precision needs no loss scaling')
    """
    chosen = manager.hook.lplugins_choose_precision(accelerator=accelerator, capabilities=dict(capabilities))
    if chosen is not None:
        return str(chosen), "chosen by a plugin's lplugins_choose_precision hook"
    return default_precision(accelerator, capabilities)
