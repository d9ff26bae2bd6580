"""``lplugins.ray.fit`` / ``run`` / ``compose``: a composed Trainer in the workers of Ray Train's ``TorchTrainer``.

Every argument is checked here, on the driver, before Ray starts any worker.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from lplugins._errors import CompositionError
from lplugins._log import announce
from lplugins._validate import a_bool, is_int, positive_int, positive_number
from lplugins.ray import _names

__all__ = ["check_scaling", "check_trainer_kwargs", "compose", "fit", "run"]

OWNER = "lplugins.ray"

#: Strategies that start their own processes or use one device: Ray starts one process per worker.
_REFUSED = ("spawn", "fork", "notebook", "single_device", "single_xla")
#: Lightning Trainer arguments Ray decides (from num_workers and where Ray placed the workers).
_RAY_DECIDES = ("devices", "num_nodes")


class RayArgumentError(CompositionError):
    """An argument of ``lplugins.ray.fit``/``run``/``compose`` is not allowed (the message names it)."""


def check_scaling(
    *,
    num_workers: Any,
    use_gpu: Any,
    resources_per_worker: Any,
    max_failures: Any,
    storage_path: Any,
    name: Any,
) -> tuple[str, str]:
    """Check the scaling and run arguments; return the absolute storage path and the run name.

    Raises:
        RayArgumentError: an argument is not allowed (the message names it, its value and what is allowed).
    """
    positive_int("num_workers", num_workers, error=RayArgumentError, owner=OWNER)
    a_bool("use_gpu", use_gpu, error=RayArgumentError, owner=OWNER)
    if resources_per_worker is not None:
        if not isinstance(resources_per_worker, Mapping) or not all(isinstance(k, str) for k in resources_per_worker):
            raise RayArgumentError(
                f"{OWNER}: resources_per_worker={resources_per_worker!r} is not allowed; it must be a dict of "
                "resource name -> amount, e.g. {'CPU': 1} or {'CPU': 2, 'GPU': 1}."
            )
        for key, amount in resources_per_worker.items():
            positive_number(
                f"resources_per_worker[{key!r}]", amount, allow_zero=True, error=RayArgumentError, owner=OWNER
            )
        if resources_per_worker.get("GPU") and not use_gpu:
            raise RayArgumentError(
                f"{OWNER}: resources_per_worker={dict(resources_per_worker)!r} asks for GPUs but use_gpu=False; "
                "pass use_gpu=True or drop 'GPU'."
            )
    if not is_int(max_failures) or max_failures < -1:
        raise RayArgumentError(
            f"{OWNER}: max_failures={max_failures!r} is not allowed; it must be an int >= 0 (restarts after a worker "
            "failure) or -1 (restart without limit)."
        )
    if storage_path is None:
        storage_path = os.path.join(os.path.expanduser("~"), "ray_results")
    if not isinstance(storage_path, (str, os.PathLike)) or not os.fspath(storage_path):
        raise RayArgumentError(
            f"{OWNER}: storage_path={storage_path!r} is not allowed; it must be a directory path or URI "
            "(e.g. '/mnt/shared/runs' or 's3://bucket/runs'), storage every worker node can reach."
        )
    storage = os.fspath(storage_path)
    if "://" not in storage:
        storage = os.path.abspath(os.path.expanduser(storage))
    if name is None:
        name = "lplugins-" + time.strftime("%Y%m%d-%H%M%S")
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise RayArgumentError(
            f"{OWNER}: name={name!r} is not allowed; it must be a non-empty directory name (no '/', not starting "
            "with '.')."
        )
    return storage, name


def check_trainer_kwargs(trainer: Any, use_gpu: bool | None) -> dict[str, Any]:
    """Check Trainer keyword arguments meant for a Ray worker; a copy with the strategy filled in.

    Raises:
        RayArgumentError: an argument Ray decides, an accelerator that contradicts ``use_gpu``, or a
            strategy that cannot run under Ray.
    """
    if trainer is None:
        trainer = {}
    if not isinstance(trainer, Mapping) or not all(isinstance(k, str) for k in trainer):
        raise RayArgumentError(
            f"{OWNER}: trainer={trainer!r} is not allowed; it must be a dict of Trainer keyword arguments "
            "(what lplugins.compose() takes, e.g. {'strategy': 'ray_ddp', 'max_steps': 100})."
        )
    kwargs = dict(trainer)
    for key in _RAY_DECIDES:
        if key in kwargs:
            raise RayArgumentError(
                f"{OWNER}: trainer[{key!r}]={kwargs[key]!r} is not allowed: under Ray, num_workers says how many "
                "processes train and Ray places them (devices and num_nodes follow). Remove it."
            )
    accelerator = kwargs.get("accelerator")
    if use_gpu is not None and isinstance(accelerator, str):
        if use_gpu and accelerator == "cpu":
            raise RayArgumentError(
                f"{OWNER}: trainer['accelerator']='cpu' with use_gpu=True; pass use_gpu=False or drop the accelerator."
            )
        if not use_gpu and accelerator in ("gpu", "cuda"):
            raise RayArgumentError(
                f"{OWNER}: trainer['accelerator']={accelerator!r} with use_gpu=False: the workers get no GPU; "
                "pass use_gpu=True."
            )
    strategy = kwargs.setdefault("strategy", "ray_ddp")
    name = strategy.get("name") if isinstance(strategy, Mapping) else strategy
    if isinstance(name, str):
        if any(part in name for part in _REFUSED) or name == "dp":
            raise RayArgumentError(
                f"{OWNER}: strategy={name!r} cannot run under Ray: it starts its own processes or trains on one "
                "device, and Ray starts one process per worker. Use 'ray_ddp' (the default), 'ddp_timeout', "
                "'fsdp2', 'deepspeed_stage_*_cpu', or on GPUs 'ray_fsdp'/'ray_deepspeed'."
            )
        if use_gpu is False and name in _names.CPU_INSTEAD:
            raise RayArgumentError(
                f"{OWNER}: strategy={name!r} needs CUDA (Ray's {_names.STRATEGIES[name][0]} is Lightning's "
                f"{_names.STRATEGIES[name][0][3:]}), and use_gpu=False. On CPU use {_names.CPU_INSTEAD[name]!r}, "
                "or pass use_gpu=True."
            )
    return kwargs


def _is_ray_strategy(strategy: Any) -> bool:
    name = strategy.get("name") if isinstance(strategy, Mapping) else strategy
    if isinstance(name, str):
        return name in _names.STRATEGIES
    module = _names.ray_lightning()
    return isinstance(strategy, (module.RayDDPStrategy, module.RayFSDPStrategy, module.RayDeepSpeedStrategy))


def compose(**trainer_kwargs: Any) -> dict[str, Any]:
    """:func:`lplugins.compose` for a Trainer built inside a Ray Train worker.

    Fills in what Ray decides and resumes what Ray restored, then composes as usual:

    * ``strategy``: ``"ray_ddp"`` unless given (any name that runs under Ray: ``ray_ddp``,
      ``ddp_timeout``, ``fsdp2``, ``deepspeed_stage_*_cpu``; ``ray_fsdp``/``ray_deepspeed`` on GPUs);
    * ``accelerator``: the device Ray gave this worker; ``devices``/``num_nodes``: from where Ray placed
      the workers; the cluster environment ``ray`` (ranks from Ray);
    * ``default_root_dir``: Ray's run directory (when the storage is a local path and none is given),
      so a ``durable_checkpoint`` without ``dirpath`` writes to shared storage;
    * the ``ray_report`` callback: every committed checkpoint is reported to Ray;
    * after a restart, the checkpoint Ray restored is in the checkpoint directory, so
      ``fit(ckpt_path="latest")`` resumes from it (or from a newer commit).

    Args:
        **trainer_kwargs: What :func:`lplugins.compose` takes, less ``devices`` and ``num_nodes``.

    Returns:
        Keyword arguments for ``lightning.pytorch.Trainer``.

    Raises:
        RayUnavailableError: Ray is not installed.
        RayArgumentError: called outside a Ray Train worker, or an argument Ray decides is given.
    """
    _names.require()
    if not _names.in_ray_worker():
        raise RayArgumentError(
            "lplugins.ray.compose() builds a Trainer inside a Ray Train worker (the function lplugins.ray.run or "
            "TorchTrainer runs); outside one, use lplugins.compose()."
        )
    import ray.train
    import ray.train.torch

    from lplugins._composition.compose import compose as lplugins_compose
    from lplugins.ray import _report

    kwargs = check_trainer_kwargs(trainer_kwargs, use_gpu=None)
    context = ray.train.get_context()
    device = ray.train.torch.get_device()
    kwargs.setdefault("accelerator", "gpu" if device.type == "cuda" else "cpu")
    if _is_ray_strategy(kwargs["strategy"]):
        kwargs.update(devices="auto", num_nodes=1)  # Ray's strategies take ranks and devices from Ray
    else:
        world, local = context.get_world_size(), context.get_local_world_size()
        if world % local:
            raise RayArgumentError(
                f"{OWNER}: strategy={kwargs['strategy']!r} needs the same number of workers on every node, and Ray "
                f"placed {world} workers with {local} on this node. Use strategy='ray_ddp', or a number of workers "
                "that fills whole nodes."
            )
        kwargs.update(devices=local, num_nodes=world // local)
    experiment = _report.EXPERIMENT_DIR
    if experiment is not None and "://" not in experiment:
        kwargs.setdefault("default_root_dir", experiment)
    plugins = list(kwargs.get("plugins") or [])
    if not any(_is_environment(p) for p in plugins):
        kwargs["plugins"] = [*plugins, "ray"]
    out = lplugins_compose(**kwargs)
    from lplugins.callbacks import DurableCheckpoint

    root = out.get("default_root_dir") or os.getcwd()
    dirpaths = [
        str(cb.dirpath or os.path.join(root, "checkpoints"))
        for cb in out.get("callbacks", [])
        if isinstance(cb, DurableCheckpoint)
    ]
    if dirpaths:
        _report.restore(dirpaths)
    return out


def _is_environment(plugin: Any) -> bool:
    if isinstance(plugin, str):
        return plugin == "ray"
    if isinstance(plugin, Mapping):
        return plugin.get("name") == "ray"
    from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

    return isinstance(plugin, ClusterEnvironment)


def run(
    train_fn: Callable[..., Any],
    *,
    config: Mapping[str, Any] | None = None,
    num_workers: int,
    use_gpu: bool = False,
    resources_per_worker: Mapping[str, float] | None = None,
    max_failures: int = 0,
    storage_path: str | os.PathLike[str] | None = None,
    name: str | None = None,
) -> Any:
    """Run ``train_fn`` in ``num_workers`` Ray Train workers (``ray.train.torch.TorchTrainer``).

    Inside ``train_fn`` build the Trainer with :func:`lplugins.ray.compose` (in place of
    :func:`lplugins.compose`) and call ``fit(..., ckpt_path="latest")``.

    Args:
        train_fn: Runs on every worker; takes no argument, or ``config``.
        config: Passed to ``train_fn`` (when it takes an argument).
        num_workers: Number of training processes.
        use_gpu: One GPU per worker (unless ``resources_per_worker`` says otherwise).
        resources_per_worker: Ray resources per worker, e.g. ``{"CPU": 2, "GPU": 1}``.
        max_failures: Restarts after a worker failure (Ray's ``FailureConfig``); -1: no limit.
        storage_path: Where Ray keeps the run (local path on one machine; a shared path or a URI such
            as ``s3://...`` on several). Default: ``~/ray_results``.
        name: The run's directory under ``storage_path`` (default: ``lplugins-<date>-<time>``).

    Returns:
        Ray's ``ray.train.Result`` (``return_value``: what ``train_fn`` returned on rank 0).

    Raises:
        RayUnavailableError: Ray is not installed.
        RayArgumentError: an argument is not allowed (before any worker starts).
    """
    storage, run_name = check_scaling(
        num_workers=num_workers,
        use_gpu=use_gpu,
        resources_per_worker=resources_per_worker,
        max_failures=max_failures,
        storage_path=storage_path,
        name=name,
    )
    if not callable(train_fn):
        raise RayArgumentError(f"{OWNER}: train_fn={train_fn!r} is not allowed; it must be a function.")
    takes_config = _arity(train_fn)
    if config is not None and not isinstance(config, Mapping):
        raise RayArgumentError(f"{OWNER}: config={config!r} is not allowed; it must be a dict or None.")
    _names.require()
    return _start(
        functools.partial(_worker, train_fn, takes_config, _join(storage, run_name)),
        dict(config or {}),
        num_workers=num_workers,
        use_gpu=use_gpu,
        resources_per_worker=resources_per_worker,
        max_failures=max_failures,
        storage=storage,
        name=run_name,
    )


def _arity(train_fn: Callable[..., Any]) -> bool:
    try:
        params = [
            p
            for p in inspect.signature(train_fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    if len(params) > 1:
        raise RayArgumentError(
            f"{OWNER}: train_fn={train_fn!r} takes {len(params)} required arguments; it must take none or one (config)."
        )
    return len(params) == 1


def _join(storage: str, name: str) -> str:
    return f"{storage.rstrip('/')}/{name}" if "://" in storage else os.path.join(storage, name)


def _start(
    loop: Callable[[dict[str, Any]], Any],
    config: dict[str, Any],
    *,
    num_workers: int,
    use_gpu: bool,
    resources_per_worker: Mapping[str, float] | None,
    max_failures: int,
    storage: str,
    name: str,
) -> Any:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    announce(
        "lplugins: Ray Train run %r: %d worker(s)%s, up to %s restart(s) after a worker failure, storage %s",
        name, num_workers, " with GPUs" if use_gpu else " on CPU",
        "unlimited" if max_failures == -1 else max_failures, _join(storage, name),
    )  # fmt: skip
    trainer = TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=num_workers,
            use_gpu=use_gpu,
            resources_per_worker=dict(resources_per_worker) if resources_per_worker is not None else None,
        ),
        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=max_failures)),
    )
    return trainer.fit()


def _worker(train_fn: Callable[..., Any], takes_config: bool, experiment: str, config: dict[str, Any]) -> Any:
    """What every Ray worker runs: remember the run directory, then the user's function, then a clean end.

    Ray ends its workers without ``atexit``: the watchdog's end (the uneven-batches check, this rank's stack
    file removed from ``<default_root_dir>/lplugins-stacks/``) runs here, after a function that returned.
    """
    from lplugins._coord import watchdog
    from lplugins.ray import _report

    _report.EXPERIMENT_DIR = experiment
    result = train_fn(config) if takes_config else train_fn()
    watchdog.finish()
    return result


def fit(
    model: Any,
    train_dataloaders: Any = None,
    val_dataloaders: Any = None,
    datamodule: Any = None,
    *,
    ckpt_path: str | None = "latest",
    trainer: Mapping[str, Any] | None = None,
    num_workers: int,
    use_gpu: bool = False,
    resources_per_worker: Mapping[str, float] | None = None,
    max_failures: int = 0,
    storage_path: str | os.PathLike[str] | None = None,
    name: str | None = None,
) -> Any:
    """``Trainer(**lplugins.compose(**trainer)).fit(model, ...)``, in ``num_workers`` Ray Train workers.

    The one call that scales an lplugins script out: the Trainer arguments stay what they were
    (strategy and callbacks by name), :func:`lplugins.ray.compose` fills in what Ray decides in each
    worker, and ``ckpt_path="latest"`` resumes a restarted worker group from the newest committed
    checkpoint.

    Args:
        model: A ``LightningModule`` (sent to every worker) or a function without arguments that builds one
            (called in every worker).
        train_dataloaders: As for ``Trainer.fit`` (sent to every worker).
        val_dataloaders: As for ``Trainer.fit``.
        datamodule: As for ``Trainer.fit``.
        ckpt_path: As for ``Trainer.fit``; ``"latest"`` (the default): the newest committed checkpoint of the
            ``durable_checkpoint``, a fresh start when there is none.
        trainer: Keyword arguments of :func:`lplugins.compose` (names allowed), less ``devices`` and
            ``num_nodes``. ``strategy`` defaults to ``"ray_ddp"``.
        num_workers: Number of training processes.
        use_gpu: One GPU per worker (unless ``resources_per_worker`` says otherwise).
        resources_per_worker: Ray resources per worker, e.g. ``{"CPU": 2, "GPU": 1}``.
        max_failures: Restarts after a worker failure (Ray's ``FailureConfig``); -1: no limit.
        storage_path: Where Ray keeps the run, and (by default) the checkpoints: a local path on one
            machine, a shared path or a URI on several. Default: ``~/ray_results``.
        name: The run's directory under ``storage_path`` (default: ``lplugins-<date>-<time>``).

    Returns:
        Ray's ``ray.train.Result``; ``return_value`` is ``{"global_step": ..., "metrics": {...}}`` of rank 0.

    Raises:
        RayUnavailableError: Ray is not installed.
        RayArgumentError: an argument is not allowed (before any worker starts).
        CompositionError: a Trainer argument lplugins.compose refuses (checked on the driver, CPU runs).
    """
    from lightning.pytorch import LightningModule

    storage, run_name = check_scaling(
        num_workers=num_workers,
        use_gpu=use_gpu,
        resources_per_worker=resources_per_worker,
        max_failures=max_failures,
        storage_path=storage_path,
        name=name,
    )
    if not isinstance(model, LightningModule) and not callable(model):
        raise RayArgumentError(
            f"{OWNER}: model={model!r} is not allowed; it must be a LightningModule or a function that builds one."
        )
    if ckpt_path is not None and not isinstance(ckpt_path, str):
        raise RayArgumentError(f"{OWNER}: ckpt_path={ckpt_path!r} is not allowed; it must be a str or None.")
    kwargs = check_trainer_kwargs(trainer, use_gpu)
    _names.require()
    if not use_gpu:  # every name and argument composed once on the driver, as the workers will
        from lplugins._composition.compose import compose as lplugins_compose

        lplugins_compose(**{**kwargs, "accelerator": "cpu"})
    spec = {
        "model": model,
        "fit": {"train_dataloaders": train_dataloaders, "val_dataloaders": val_dataloaders, "datamodule": datamodule},
        "ckpt_path": ckpt_path,
        "trainer": kwargs,
    }
    return _start(
        functools.partial(_worker, _fit_worker, True, _join(storage, run_name)),
        {"lplugins_fit": spec},
        num_workers=num_workers,
        use_gpu=use_gpu,
        resources_per_worker=resources_per_worker,
        max_failures=max_failures,
        storage=storage,
        name=run_name,
    )


def _fit_worker(config: dict[str, Any]) -> dict[str, Any]:
    from lightning.pytorch import LightningModule, Trainer

    from lplugins.ray._report import _metrics

    spec = config["lplugins_fit"]
    model = spec["model"] if isinstance(spec["model"], LightningModule) else spec["model"]()
    trainer = Trainer(**compose(**spec["trainer"]))
    trainer.fit(model, ckpt_path=spec["ckpt_path"], **spec["fit"])
    return {"global_step": trainer.global_step, "metrics": _metrics(trainer)}
