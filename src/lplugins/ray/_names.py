"""The factories behind the Ray names (``ray_ddp``, ``ray_fsdp``, ``ray_deepspeed``, ``ray``, ``ray_report``).

Nothing here imports Ray at module level: the built-in plugin ``ray`` registers these names whether
or not Ray is installed, and a factory imports ``ray.train.lightning`` when its name is selected.
Without Ray the names are listed as unavailable (with the install command) and selecting one is an
error saying what to install.

Ray's Lightning integration is written for one Lightning namespace: ``ray.train.lightning`` imports
``lightning.pytorch`` when the ``lightning`` package is installed (always, with lplugins) and
``pytorch_lightning`` only otherwise. Its classes are built only for a Trainer of that namespace;
for the other one the factory refuses with an error that says so.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from typing import Any

from lplugins._errors import CompositionError
from lplugins._lightning import namespace as _namespace

__all__ = ["INSTALL", "RayUnavailableError", "in_ray_worker", "missing", "ray_namespace"]

#: How to get Ray's part of lplugins.
INSTALL = 'pip install "lplugins[ray]"'

#: name -> (class in ray.train.lightning, runs on CPU, description)
STRATEGIES: dict[str, tuple[str, bool, str]] = {
    "ray_ddp": ("RayDDPStrategy", True, "Ray Train's RayDDPStrategy: DDP in the workers Ray starts; CPU or CUDA"),
    "ray_fsdp": (
        "RayFSDPStrategy",
        False,
        "Ray Train's RayFSDPStrategy (Lightning's FSDP); CUDA only (on CPU under Ray: fsdp2)",
    ),
    "ray_deepspeed": (
        "RayDeepSpeedStrategy",
        False,
        "Ray Train's RayDeepSpeedStrategy (Lightning's DeepSpeed); CUDA only (on CPU under Ray: deepspeed_stage_*_cpu)",
    ),
}

#: What each strategy is instead on CPU.
CPU_INSTEAD = {"ray_fsdp": "fsdp2", "ray_deepspeed": "deepspeed_stage_2_cpu (or another deepspeed_stage_*_cpu)"}


class RayUnavailableError(CompositionError):
    """A Ray name was selected but Ray Train cannot be imported (the message says what to install)."""


def missing() -> str | None:
    """Why the Ray names cannot be used here (``None``: they can); without importing Ray."""
    for module, what in (("ray", "Ray is not installed"), ("pyarrow", "Ray Train's dependencies are not installed")):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{what} ({INSTALL})"
    return None


def description(text: str) -> str:
    """``text`` for ``lplugins list``, prefixed with why it is unavailable when Ray is missing."""
    reason = missing()
    return text if reason is None else f"unavailable: {reason}; {text}"


def require() -> None:
    """Raise :class:`RayUnavailableError` unless Ray Train can be used.

    Raises:
        RayUnavailableError: Ray (or Ray Train's dependencies) is not installed.
    """
    reason = missing()
    if reason is not None:
        raise RayUnavailableError(f"The Ray names (ray_ddp, ray_fsdp, ray_deepspeed, ray) need Ray Train: {reason}.")


def ray_lightning() -> Any:
    """``ray.train.lightning`` (imported here).

    Raises:
        RayUnavailableError: Ray cannot be imported.
    """
    require()
    try:
        import ray.train.lightning as ray_lightning
    except ImportError as err:
        raise RayUnavailableError(f"Importing ray.train.lightning failed ({err}); reinstall with {INSTALL}.") from err
    return ray_lightning


def ray_namespace() -> str:
    """The Lightning namespace Ray's Lightning classes belong to (``"lightning"`` when it is installed)."""
    found = _namespace.of_object(ray_lightning().RayLightningEnvironment)
    return found or _namespace.LIGHTNING


def _check_namespace(name: str) -> None:
    wanted = _namespace.current()
    ours = ray_namespace()
    if wanted != ours:
        theirs_pkg, wanted_pkg = _namespace.NAMESPACES[ours][0], _namespace.NAMESPACES[wanted][0]
        raise CompositionError(
            f"{name!r} cannot be built for a {wanted_pkg}.Trainer: Ray's Lightning integration (ray.train.lightning) "
            f"is written for {theirs_pkg} (it imports lightning.pytorch whenever the lightning package is "
            f"installed). Use {theirs_pkg}.Trainer (compose(..., namespace={ours!r})) with the Ray names."
        )


def _strategy_factory(name: str) -> Any:
    class_name, on_cpu, _ = STRATEGIES[name]

    def factory(trainer_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        module = ray_lightning()
        _check_namespace(name)
        if not on_cpu and trainer_kwargs is not None and _accelerator(trainer_kwargs) == "cpu":
            raise CompositionError(
                f"strategy {name!r} does not run on CPU: Ray's {class_name} is Lightning's "
                f"{class_name[3:]}, which needs CUDA. On CPU use {CPU_INSTEAD[name]!r} (it works under "
                "lplugins.ray too), or accelerator='gpu' on GPU workers."
            )
        return getattr(module, class_name)(**kwargs)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"Build {name!r}: ray.train.lightning.{class_name}."
    return factory


def _accelerator(trainer_kwargs: Mapping[str, Any]) -> str:
    accelerator = trainer_kwargs.get("accelerator")
    if accelerator in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(accelerator) if isinstance(accelerator, str) else type(accelerator).__name__.lower()


ray_ddp = _strategy_factory("ray_ddp")
ray_fsdp = _strategy_factory("ray_fsdp")
ray_deepspeed = _strategy_factory("ray_deepspeed")


def ray_environment(**kwargs: Any) -> Any:
    """Build ``ray``: ray.train.lightning.RayLightningEnvironment (ranks from Ray Train's context)."""
    module = ray_lightning()
    _check_namespace("ray")
    return module.RayLightningEnvironment(**kwargs)


def ray_report(**kwargs: Any) -> Any:
    """Build ``ray_report``: every DurableCheckpoint commit reported to Ray Train."""
    require()
    _check_namespace("ray_report")
    from lplugins.ray._report import RayCheckpointReport

    return RayCheckpointReport(**kwargs)


def in_ray_worker() -> bool:
    """Whether this process runs a Ray Train worker's training function (cheap when Ray is not imported)."""
    if "ray.train" not in sys.modules:
        return False
    try:
        import ray.train

        ray.train.get_context()
    except Exception:
        return False
    return True
