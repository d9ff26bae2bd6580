"""The built-in plugin ``ray``: Ray Train's Lightning strategies and cluster environment by name.

``ray_ddp``, ``ray_fsdp`` and ``ray_deepspeed`` (``ray.train.lightning``'s strategies), the cluster
environment ``ray`` (``RayLightningEnvironment``, detected inside a Ray Train worker) and the callback
``ray_report`` (every ``durable_checkpoint`` commit reported to Ray; added to every Trainer composed in
a Ray Train worker). Registered whether or not Ray is installed: without it the names are listed as
unavailable with the install command (``pip install "lplugins[ray]"``), and selecting one is an error
that says so. Loading this plugin imports neither Ray nor Lightning (the factories live in
:mod:`lplugins.ray._names` and import Ray when called).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lplugins._lightning import namespace as _namespace
from lplugins._log import announce
from lplugins.hookspecs import Register, RegisterClusterEnvironment, hookimpl


@hookimpl
def lplugins_register_strategies(register: Register) -> None:
    from lplugins.ray import _names

    for name, (_, _, text) in _names.STRATEGIES.items():
        register(name, getattr(_names, name), description=_names.description(text))


@hookimpl
def lplugins_register_cluster_environments(register: RegisterClusterEnvironment) -> None:
    from lplugins.ray import _names

    register(
        "ray",
        _names.ray_environment,
        description=_names.description("Ray Train's RayLightningEnvironment (ranks from Ray); detected in Ray workers"),
        detect=_names.in_ray_worker,
    )


@hookimpl
def lplugins_register_callbacks(register: Register) -> None:
    from lplugins.ray import _names

    register(
        "ray_report",
        _names.ray_report,
        description=_names.description(
            "report every durable_checkpoint commit to Ray Train (added by itself in a Ray Train worker)"
        ),
    )


@hookimpl
def lplugins_trainer_callbacks(trainer_kwargs: Mapping[str, Any]) -> list[Any] | None:
    from lplugins.ray import _names

    if not _names.in_ray_worker() or _namespace.current() != _names.ray_namespace():
        return None
    callbacks = trainer_kwargs.get("callbacks") or []
    if any(_is_report(cb) for cb in callbacks):
        return None  # the user added one
    if not any(_is_durable(cb) for cb in callbacks):
        announce(
            "lplugins: Trainer composed in a Ray Train worker without a durable_checkpoint: nothing is reported to "
            "Ray, and a restart after a worker failure starts from scratch. Add callbacks=['durable_checkpoint']."
        )
        return None
    return [_names.ray_report()]


def _is_durable(callback: Any) -> bool:
    if isinstance(callback, str):
        return callback == "durable_checkpoint"
    if isinstance(callback, Mapping):
        return callback.get("name") == "durable_checkpoint"
    # the namespace being composed for is Ray's (checked by the caller): its DurableCheckpoint class
    checkpoint = _namespace.module_for("lplugins.callbacks.checkpoint", _namespace.current())
    return isinstance(callback, checkpoint.DurableCheckpoint)


def _is_report(callback: Any) -> bool:
    if isinstance(callback, str):
        return callback == "ray_report"
    if isinstance(callback, Mapping):
        return callback.get("name") == "ray_report"
    from lplugins.ray._report import RayCheckpointReport  # only in a Ray worker, for Ray's namespace

    return isinstance(callback, RayCheckpointReport)
