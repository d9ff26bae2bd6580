"""The built-in plugin ``strategies``: named DeepSpeed, FSDP2, DDP, fault-tolerant (torchft) and advised strategies.

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


def ft_ddp(trainer_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """Build ``ft_ddp``: data parallelism across torchft replica groups (a lost one does not stop the others)."""
    from lplugins.strategies import _ft_env

    _ft_env.require("ft_ddp")
    if trainer_kwargs is not None:
        _ft_env.check_trainer_kwargs("ft_ddp", trainer_kwargs)
    from lplugins.strategies.ft import FTDDPStrategy

    return FTDDPStrategy(**kwargs)


def ft_hsdp(trainer_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """Refuse ``ft_hsdp`` with the reason: torchft's FSDP2/HSDP inside a replica group needs CUDA."""
    from lplugins.strategies import _ft_env

    raise _ft_env.FTConfigError(_ft_env.HSDP_REFUSAL)


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
    from lplugins.strategies import _ft_env

    register(
        "ft_ddp",
        ft_ddp,
        description=_ft_env.description(
            "fault-tolerant DDP across torchft replica groups (one CPU process each, gloo): a lost group does "
            "not stop the others and rejoins with a peer's state; start with `lplugins ft run`"
        ),
    )
    register(
        "ft_hsdp",
        ft_hsdp,
        description="unavailable: FSDP2/HSDP inside a torchft replica group needs CUDA (torchft 0.2); "
        "on CPU use ft_ddp",
    )
    register(
        "advised",
        advised,
        description="the strategy lplugins' advisor picks from the model size and the hardware "
        "(give num_parameters=...)",
    )
