"""DeepSpeed on a CPU accelerator: its CPU accelerator made current, and fp16 refused where it cannot run.

DeepSpeed's CPU accelerator runs fp16 only where oneDNN does (CPUs with AVX512-FP16 or AMX-FP16); elsewhere
``deepspeed.initialize`` fails on every rank with "Type fp16 is not supported on your device". lplugins asks
DeepSpeed's own accelerator the same question first, and refuses before training, naming the precision and
what runs instead (bf16 runs on any CPU).
"""

from __future__ import annotations

import platform
from typing import Any

from lplugins.strategies._ds_config import DeepSpeedConfigError

__all__ = ["FP16_PRECISIONS", "check_cpu_precision", "use_cpu_accelerator"]

#: The Trainer precisions DeepSpeed runs in fp16.
FP16_PRECISIONS = ("16-mixed", "16-true", "16")


def use_cpu_accelerator() -> None:
    """Make DeepSpeed use its CPU accelerator (it would pick CUDA on a machine that has it)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


def _fp16_supported() -> bool:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    return bool(CPU_Accelerator().is_fp16_supported())  # None, not False, where oneDNN has no fp16


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def check_cpu_precision(precision: Any) -> None:
    """Refuse ``precision`` for DeepSpeed on this machine's CPU if DeepSpeed's CPU accelerator cannot run it.

    Raises:
        DeepSpeedConfigError: fp16 on a CPU without oneDNN fp16, naming the precision and what runs instead.
    """
    if str(precision) in FP16_PRECISIONS and not _fp16_supported():
        cpu = _cpu_name()
        raise DeepSpeedConfigError(
            f"Trainer(precision={precision!r}) with DeepSpeed on CPU: DeepSpeed's CPU accelerator runs fp16 only on"
            f" CPUs whose oneDNN supports it (AVX512-FP16 or AMX-FP16), and this one ({cpu}) does not. Use"
            " precision='bf16-mixed' (any CPU) or '32-true', or accelerator='gpu'."
        )
