"""Precision by name: ``auto`` selection, fp8, and fp16 loss-scale observability.

Every Lightning precision string works unchanged through :func:`lplugins.compose`; plugins add
names through ``lplugins_register_precisions``. The built-in ``precision`` plugin registers:

* ``fp8`` -- float8 training through transformer-engine or torchao on a CUDA GPU of compute
  capability 8.9 or newer; anywhere else, composing it raises an error that says what is missing.
* the ``loss_scale_monitor`` callback, contributed automatically when the precision is fp16 mixed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lplugins.precision._auto import choose_precision, default_precision
from lplugins.precision._fp8 import Float8Unavailable, fp8_precision

if TYPE_CHECKING:
    from lplugins.precision._monitor import LossScaleMonitor


def __getattr__(name: str) -> Any:  # LossScaleMonitor imports Lightning: only when asked for
    if name == "LossScaleMonitor":
        from lplugins.precision._monitor import LossScaleMonitor

        return LossScaleMonitor
    raise AttributeError(f"module 'lplugins.precision' has no attribute {name!r}")


__all__ = ["Float8Unavailable", "LossScaleMonitor", "choose_precision", "default_precision", "fp8_precision"]
