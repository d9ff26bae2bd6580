"""float8 training with torchao: bf16 autocast plus ``convert_to_float8_training`` on linear layers."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision


class TorchAOFloat8Precision(MixedPrecision):
    """bf16 mixed precision whose ``nn.Linear`` layers compute in float8 (torchao).

    Linear layers whose dimensions are not multiples of 16 are left in bf16 (float8 kernels need them).
    """

    def __init__(self) -> None:
        super().__init__(precision="bf16-mixed", device="cuda")

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from torchao.float8 import convert_to_float8_training

        def eligible(mod: torch.nn.Module, fqn: str) -> bool:
            return isinstance(mod, torch.nn.Linear) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

        convert_to_float8_training(module, module_filter_fn=eligible)
        return module

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"{type(self).__name__}()"


__all__: list[Any] = ["TorchAOFloat8Precision"]
