"""Built-in plugin ``precision``: the ``fp8`` name and fp16 loss-scale logging."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from lplugins.hookspecs import Register, hookimpl

_FP16 = {"16-mixed", "16", 16}


def _fp8(accelerator: str = "cuda", strategy: Any = None, backend: str = "auto") -> Any:
    from lplugins.precision._fp8 import fp8_precision

    return fp8_precision(accelerator=accelerator, strategy=strategy, backend=backend)


def _monitor(**kwargs: Any) -> Any:
    from lplugins.precision._monitor import LossScaleMonitor

    return LossScaleMonitor(**kwargs)


@hookimpl
def lplugins_register_precisions(register: Register) -> None:
    register("fp8", _fp8, description="float8 training (transformer-engine or torchao) on CUDA capability >= 8.9")


@hookimpl
def lplugins_register_callbacks(register: Register) -> None:
    register("loss_scale_monitor", _monitor, description="log the fp16 loss scale and skipped optimizer steps")


@hookimpl
def lplugins_trainer_callbacks(trainer_kwargs: Mapping[str, Any]) -> list[Any] | None:
    if trainer_kwargs.get("precision") not in _FP16:
        return None
    if any(_is_monitor(cb) for cb in trainer_kwargs.get("callbacks") or []):
        return None  # the user added one already
    return [_monitor()]


def _is_monitor(callback: Any) -> bool:
    """Whether ``callback`` is a loss-scale monitor, by name or instance (without importing Lightning)."""
    if isinstance(callback, str):
        return callback == "loss_scale_monitor"
    # an instance exists only once its module is imported; importing it here would import Lightning
    module = sys.modules.get("lplugins.precision._monitor")
    return module is not None and isinstance(callback, module.LossScaleMonitor)
