"""Built-in strategy extensions: DeepSpeed ZeRO and FSDP2 on CPU and CUDA, fault-tolerant DDP with torchft
(``ft_ddp``), a strategy advisor, one process-group timeout, and cluster environments.

Importing this package imports neither Lightning nor DeepSpeed; each name is loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lplugins.strategies._ds_config import DeepSpeedConfigError
    from lplugins.strategies._ft_env import FTConfigError, FTUnavailableError
    from lplugins.strategies.advisor import Advice, AdvisorError, advise
    from lplugins.strategies.ddp import DDPStrategy
    from lplugins.strategies.deepspeed import DeepSpeedStrategy
    from lplugins.strategies.environments import VariablesEnvironment
    from lplugins.strategies.fsdp2 import FSDP2Strategy
    from lplugins.strategies.ft import FTDDPStrategy
    from lplugins.strategies.timeout import DEFAULT_PG_TIMEOUT, resolve_timeout

_LAZY = {
    "DeepSpeedStrategy": "lplugins.strategies.deepspeed",
    "DeepSpeedConfigError": "lplugins.strategies._ds_config",
    "DDPStrategy": "lplugins.strategies.ddp",
    "FSDP2Strategy": "lplugins.strategies.fsdp2",
    "FTDDPStrategy": "lplugins.strategies.ft",
    "FTConfigError": "lplugins.strategies._ft_env",
    "FTUnavailableError": "lplugins.strategies._ft_env",
    "Advice": "lplugins.strategies.advisor",
    "AdvisorError": "lplugins.strategies.advisor",
    "advise": "lplugins.strategies.advisor",
    "DEFAULT_PG_TIMEOUT": "lplugins.strategies.timeout",
    "resolve_timeout": "lplugins.strategies.timeout",
    "VariablesEnvironment": "lplugins.strategies.environments",
}

__all__ = [
    "DEFAULT_PG_TIMEOUT",
    "Advice",
    "AdvisorError",
    "DDPStrategy",
    "DeepSpeedConfigError",
    "DeepSpeedStrategy",
    "FSDP2Strategy",
    "FTConfigError",
    "FTDDPStrategy",
    "FTUnavailableError",
    "VariablesEnvironment",
    "advise",
    "resolve_timeout",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lplugins.strategies' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
