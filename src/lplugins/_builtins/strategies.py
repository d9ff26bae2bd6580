"""The built-in plugin ``strategies``: named DeepSpeed, FSDP2, DDP and advised strategies.

Every factory imports its strategy class when it is called, so loading the built-ins imports
neither DeepSpeed nor Lightning's strategy modules.

Names end in ``_cpu`` where Lightning already owns the plain name: ``deepspeed_stage_2_cpu`` is
Lightning's ``deepspeed_stage_2`` made to run with ``accelerator="cpu"`` (gloo) too; on CUDA it
behaves like Lightning's. (lplugins refuses names that Lightning's ``StrategyRegistry`` already has.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lplugins.hookspecs import Register, hookimpl

#: name -> (ZeRO stage, offload optimizer, offload parameters, description)
DEEPSPEED_STRATEGIES: Mapping[str, tuple[int, bool, bool, str]] = {
    "deepspeed_stage_1_cpu": (1, False, False, "DeepSpeed ZeRO-1 (optimizer state sharded); CPU (gloo) or CUDA"),
    "deepspeed_stage_2_cpu": (2, False, False, "DeepSpeed ZeRO-2 (+ gradients sharded); CPU (gloo) or CUDA"),
    "deepspeed_stage_2_offload_cpu": (
        2,
        True,
        False,
        "DeepSpeed ZeRO-2, optimizer state offloaded to host memory; CPU (gloo) or CUDA",
    ),
    "deepspeed_stage_3_cpu": (3, False, False, "DeepSpeed ZeRO-3 (+ parameters sharded); CPU (gloo) or CUDA"),
    "deepspeed_stage_3_offload_cpu": (
        3,
        True,
        True,
        "DeepSpeed ZeRO-3, optimizer state and parameters offloaded to host memory; CPU (gloo) or CUDA",
    ),
}


def _deepspeed_factory(name: str) -> Callable[..., Any]:
    stage = DEEPSPEED_STRATEGIES[name][0]

    def factory(trainer_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        from lplugins.strategies.deepspeed import DeepSpeedStrategy, config_for_stage

        if kwargs.get("config") is not None:
            kwargs["config"] = config_for_stage(kwargs["config"], name, stage, kwargs)
        strategy = DeepSpeedStrategy(**kwargs)
        if trainer_kwargs is not None:
            strategy.check_trainer_kwargs(trainer_kwargs)
        return strategy

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"Build the {name!r} strategy (lplugins.strategies.DeepSpeedStrategy)."
    return factory


def ddp_timeout(**kwargs: Any) -> Any:
    """Build Lightning's DDP strategy with the lplugins process-group timeout."""
    from lplugins.strategies.ddp import DDPStrategy

    return DDPStrategy(**kwargs)


def fsdp2(**kwargs: Any) -> Any:
    """Build FSDP2 (``fully_shard``) data parallelism that shards the model itself; CPU (gloo) or CUDA."""
    from lplugins.strategies.fsdp2 import FSDP2Strategy

    return FSDP2Strategy(**kwargs)


def advised(trainer_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """Build the strategy that :func:`lplugins.strategies.advise` recommends."""
    from lplugins.strategies.advisor import advised_strategy

    return advised_strategy(trainer_kwargs=trainer_kwargs, **kwargs)


@hookimpl
def lplugins_register_strategies(register: Register) -> None:
    for name, (stage, offload_optimizer, offload_parameters, description) in DEEPSPEED_STRATEGIES.items():
        defaults: dict[str, Any] = {"stage": stage}
        if offload_optimizer:
            defaults["offload_optimizer"] = True
        if offload_parameters:
            defaults["offload_parameters"] = True
        register(name, _deepspeed_factory(name), description=description, defaults=defaults)
    register(
        "ddp_timeout",
        ddp_timeout,
        description="DDP whose process-group timeout is LPLUGINS_PG_TIMEOUT (default 30 min)",
    )
    register(
        "fsdp2",
        fsdp2,
        description="FSDP2 (fully_shard) over all ranks, the model sharded by the strategy; CPU (gloo) or CUDA",
    )
    register(
        "advised",
        advised,
        description="the strategy lplugins' advisor picks from the model size and the hardware "
        "(give num_parameters=...)",
    )
