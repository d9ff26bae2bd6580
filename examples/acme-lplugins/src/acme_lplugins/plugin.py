"""acme's lplugins plugin: registered under the ``lplugins`` entry-point group."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lplugins
from lplugins.hookspecs import Register, RegisterPrecision


def _acme_ddp(**kwargs: Any) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(**kwargs)


def _acme_audit(**kwargs: Any) -> Any:
    from acme_lplugins.callbacks import AcmeAudit

    return AcmeAudit(**kwargs)


def _acme_double() -> Any:
    from lightning.pytorch.plugins.precision import DoublePrecision

    return DoublePrecision()


@lplugins.hookimpl
def lplugins_register_strategies(register: Register) -> None:
    register(
        "acme_ddp",
        _acme_ddp,
        description="DDP over gloo with acme's defaults",
        defaults={"process_group_backend": "gloo", "find_unused_parameters": False},
    )


@lplugins.hookimpl
def lplugins_register_callbacks(register: Register) -> None:
    register("acme_audit", _acme_audit, description="count steps; one audit line per fit on rank 0")


@lplugins.hookimpl
def lplugins_register_precisions(register: RegisterPrecision) -> None:
    register("acme-double", _acme_double, description="float64 everywhere", accelerators=("cpu", "cuda"))


@lplugins.hookimpl
def lplugins_trainer_callbacks(trainer_kwargs: Mapping[str, Any]) -> list[Any] | None:
    if os.environ.get("ACME_AUDIT", "1") == "0":
        return None
    path = os.environ.get("ACME_AUDIT_FILE")
    return [_acme_audit(path=path)]
