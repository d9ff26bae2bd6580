"""The ``fp8`` precision: transformer-engine or torchao float8 training, or an explained error."""

from __future__ import annotations

import importlib.util
from typing import Any

from lplugins._errors import CompositionError
from lplugins._validate import did_you_mean

#: Float8 matrix multiplies need Ada (8.9) or Hopper (9.0) and newer.
MIN_CAPABILITY = (8, 9)

_BACKENDS = ("auto", "transformer-engine", "torchao")


class Float8Unavailable(CompositionError):
    """fp8 was asked for where it cannot run; the message says what is missing."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def fp8_precision(accelerator: str = "cuda", strategy: Any = None, backend: str = "auto") -> Any:
    """Build a float8 precision plugin for the hardware at hand.

    Args:
        accelerator: the accelerator the Trainer will use (filled in by ``compose``).
        strategy: the strategy label (filled in by ``compose``).
        backend: ``"auto"`` (transformer-engine, else torchao), ``"transformer-engine"`` or ``"torchao"``.

    Returns:
        A Lightning ``Precision`` plugin.

    Raises:
        Float8Unavailable: no CUDA device, a GPU older than compute capability 8.9, or neither
            transformer-engine nor torchao is installed; the message lists every missing piece.
        CompositionError: an unknown ``backend`` (also a ``ValueError``).
    """
    if backend not in _BACKENDS:
        raise CompositionError(
            f"fp8 backend={backend!r} is not one of 'auto', 'transformer-engine', 'torchao'."
            + did_you_mean(backend, _BACKENDS)
        )
    import torch

    missing: list[str] = []
    capability: tuple[int, int] | None = None
    if accelerator != "cuda" or not torch.cuda.is_available():
        missing.append(f"a CUDA GPU (the Trainer's accelerator is {accelerator!r})")
    else:
        capability = tuple(torch.cuda.get_device_capability())  # type: ignore[assignment]
        if capability is not None and capability < MIN_CAPABILITY:
            missing.append(
                f"compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (this GPU has "
                f"{capability[0]}.{capability[1]}; fp8 needs Ada or Hopper, e.g. L4, H100, H200)"
            )
    have_te = _installed("transformer_engine")
    have_ao = _installed("torchao")
    wanted_te = backend in ("auto", "transformer-engine")
    wanted_ao = backend in ("auto", "torchao")
    if not ((wanted_te and have_te) or (wanted_ao and have_ao)):
        options = {
            "auto": "transformer-engine or torchao",
            "transformer-engine": "transformer-engine",
            "torchao": "torchao",
        }[backend]
        missing.append(
            f"{options} installed (pip install {'transformer-engine[pytorch]' if wanted_te else 'torchao'}"
            f"{' or torchao' if backend == 'auto' else ''})"
        )
    if missing:
        raise Float8Unavailable(
            "precision 'fp8' cannot run here; it needs "
            + "; and ".join(missing)
            + ". Use precision='auto' to get the best precision this machine supports."
        )
    if wanted_te and have_te:
        from lightning.pytorch.plugins.precision import TransformerEnginePrecision

        return TransformerEnginePrecision(weights_dtype=torch.bfloat16)
    from lplugins.precision._torchao import TorchAOFloat8Precision

    return TorchAOFloat8Precision()
