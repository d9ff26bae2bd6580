"""torchft for the ``ft_*`` strategies: is it installed, where is the lighthouse, which replica is this.

Nothing here imports torch, Lightning or torchft at module level: the built-in ``strategies`` plugin
registers ``ft_ddp`` whether or not torchft is installed, and ``lplugins list`` says why it is
unavailable without it. Every check runs when a strategy is built (when the Trainer is composed), so a
bad setting fails before training with an error naming the setting and the command that fixes it.

==========================  ==========================================================================
``TORCHFT_LIGHTHOUSE``      the lighthouse's URL, e.g. ``http://127.0.0.1:29510`` (torchft's own name)
``REPLICA_GROUP_ID``        this process's replica group, ``0 .. NUM_REPLICA_GROUPS - 1``
``NUM_REPLICA_GROUPS``      how many replica groups the job has
``LPLUGINS_FT_MIN_REPLICAS``  the fewest replica groups a step may commit with (default 1)
``LPLUGINS_FT_HEARTBEAT_MS``  milliseconds between a group's heartbeats to the lighthouse (default 100)
==========================  ==========================================================================

``lplugins ft run`` sets all five for the processes it starts.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from lplugins._errors import CompositionError

__all__ = [
    "INSTALL",
    "FTConfigError",
    "FTUnavailableError",
    "ReplicaConfig",
    "check_lighthouse",
    "check_trainer_kwargs",
    "heartbeat_interval",
    "missing",
    "parse_lighthouse",
    "reduce_dtype",
    "replica_config",
    "require",
]

#: How to get torchft (the ``ft`` extra pins the tested range).
INSTALL = 'pip install "lplugins[ft]"'

LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"
REPLICA_ID_VAR = "REPLICA_GROUP_ID"
NUM_REPLICAS_VAR = "NUM_REPLICA_GROUPS"
MIN_REPLICAS_VAR = "LPLUGINS_FT_MIN_REPLICAS"
HEARTBEAT_VAR = "LPLUGINS_FT_HEARTBEAT_MS"

#: The command that starts a lighthouse and the replica groups (docs/ft.md).
RUN_HINT = "lplugins ft run --replicas N -- python train.py"


class FTUnavailableError(CompositionError):
    """An ``ft_*`` strategy was selected but torchft is not installed (the message says what to install)."""


class FTConfigError(CompositionError):
    """A fault-tolerance setting is wrong: the lighthouse, the replica count or the replica id.

    Raised when the strategy is built, before training; the message names the setting (argument and
    environment variable) and the command that fixes it.
    """


def missing() -> str | None:
    """Why the ``ft_*`` names cannot be used here (``None``: they can); without importing torchft."""
    try:
        found = importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"torchft is not installed ({INSTALL})"


def description(text: str) -> str:
    """``text`` for ``lplugins list``, prefixed with why it is unavailable when torchft is missing."""
    reason = missing()
    return text if reason is None else f"unavailable: {reason}; {text}"


def require(name: str = "ft_ddp") -> None:
    """Raise :class:`FTUnavailableError` unless torchft can be imported.

    Raises:
        FTUnavailableError: torchft is not installed.
    """
    reason = missing()
    if reason is not None:
        raise FTUnavailableError(
            f"strategy {name!r} needs torchft, the PyTorch fault-tolerance engine: {reason}. Install it with: {INSTALL}"
        )


def parse_lighthouse(address: str, *, setting: str = "lighthouse") -> tuple[str, int]:
    """``http://host:port`` (or ``host:port``) -> ``(host, port)``.

    Raises:
        FTConfigError: the address has no host or no valid port.
    """
    text = address.strip()
    parts = urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.scheme not in ("http", "https"):
        raise FTConfigError(
            f"{setting}={address!r} is not a lighthouse address: use http://HOST:PORT, e.g. "
            "http://127.0.0.1:29510 (what `lplugins ft lighthouse` prints)."
        )
    return parts.hostname, port


def check_lighthouse(address: str, *, setting: str = "lighthouse", timeout: float = 3.0) -> None:
    """Connect to the lighthouse once (TCP), so an unreachable one fails before training.

    Raises:
        FTConfigError: the address is malformed or nothing answers there within ``timeout`` seconds.
    """
    host, port = parse_lighthouse(address, setting=setting)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as err:
        raise FTConfigError(
            f"{setting}={address!r}: no torchft lighthouse answers there ({err.__class__.__name__}: {err}). "
            f"Start one with `lplugins ft lighthouse --min-replicas 1 --port {port}` (or `torchft_lighthouse`), "
            f"or start the lighthouse and the replicas together with `{RUN_HINT}`."
        ) from err


def heartbeat_interval(value: Any) -> Any:
    """``value`` (seconds or a timedelta), else ``LPLUGINS_FT_HEARTBEAT_MS`` in seconds, else 0.1 (torchft's).

    Raises:
        FTConfigError: ``LPLUGINS_FT_HEARTBEAT_MS`` is not a positive integer.
    """
    if value is not None:
        return value
    raw = os.environ.get(HEARTBEAT_VAR, "").strip()
    if not raw:
        return 0.1
    if not raw.isdigit() or int(raw) < 1:
        raise FTConfigError(f"{HEARTBEAT_VAR}={raw!r} must be a positive integer (milliseconds).")
    return int(raw) / 1000


def reduce_dtype(value: Any) -> Any:
    """``None``, or the floating-point ``torch.dtype`` named by ``value`` (``"float64"``, ``torch.float64``).

    Raises:
        FTConfigError: ``value`` does not name a floating-point dtype.
    """
    if value is None:
        return None
    import torch

    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise FTConfigError(
            f"reduce_dtype={value!r} is not a floating-point dtype: use None (the gradients' own) or 'float64'."
        )
    return dtype


@dataclass(frozen=True)
class ReplicaConfig:
    """Where this process stands in a fault-tolerant job.

    Attributes:
        lighthouse: The lighthouse's URL (``http://host:port``).
        replica_id: This replica group's index, ``0 .. num_replica_groups - 1``.
        num_replica_groups: How many replica groups the job has.
        min_replicas: The fewest replica groups a step may commit with.
    """

    lighthouse: str
    replica_id: int
    num_replica_groups: int
    min_replicas: int


def _int_setting(value: int | str | None, arg: str, var: str) -> int | None:
    if value is None:
        raw = os.environ.get(var)
        if raw is None or not raw.strip():
            return None
        value = raw
        where = f"{var}={raw!r}"
    else:
        where = f"{arg}={value!r}"
    if isinstance(value, bool):
        raise FTConfigError(f"{where} is not an integer.")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise FTConfigError(f"{where} is not an integer.") from None


def replica_config(
    *,
    lighthouse: str | None = None,
    replica_id: int | None = None,
    num_replica_groups: int | None = None,
    min_replicas: int | None = None,
    check_reachable: bool = True,
) -> ReplicaConfig:
    """Resolve the arguments (else the environment ``lplugins ft run`` sets) and check them.

    Raises:
        FTConfigError: a setting is missing, out of range, or the lighthouse does not answer.
    """
    address = lighthouse if lighthouse is not None else os.environ.get(LIGHTHOUSE_VAR)
    if not address:
        raise FTConfigError(
            f"No torchft lighthouse: pass lighthouse='http://HOST:PORT' or set {LIGHTHOUSE_VAR}. "
            f"Start the lighthouse and the replica groups with `{RUN_HINT}` (it sets {LIGHTHOUSE_VAR}, "
            f"{REPLICA_ID_VAR} and {NUM_REPLICAS_VAR}), or one lighthouse with `lplugins ft lighthouse`."
        )
    where = "lighthouse" if lighthouse is not None else LIGHTHOUSE_VAR
    parse_lighthouse(address, setting=where)
    rid = _int_setting(replica_id, "replica_id", REPLICA_ID_VAR)
    total = _int_setting(num_replica_groups, "num_replica_groups", NUM_REPLICAS_VAR)
    if rid is None or total is None:
        unset = [n for n, v in ((REPLICA_ID_VAR, rid), (NUM_REPLICAS_VAR, total)) if v is None]
        raise FTConfigError(
            f"{' and '.join(unset)} not set: each replica group needs its id and the number of groups "
            f"(replica_id=..., num_replica_groups=..., or the environment). `{RUN_HINT}` sets them."
        )
    if total < 1:
        raise FTConfigError(f"num_replica_groups={total} ({NUM_REPLICAS_VAR}): the job needs at least 1 replica group.")
    if not 0 <= rid < total:
        raise FTConfigError(
            f"replica_id={rid} ({REPLICA_ID_VAR}) is out of range for num_replica_groups={total} "
            f"({NUM_REPLICAS_VAR}): allowed 0..{total - 1}. Each replica group needs a distinct id; "
            f"`{RUN_HINT}` numbers them."
        )
    minimum = _int_setting(min_replicas, "min_replicas", MIN_REPLICAS_VAR)
    minimum = 1 if minimum is None else minimum
    if not 1 <= minimum <= total:
        raise FTConfigError(
            f"min_replicas={minimum} ({MIN_REPLICAS_VAR}) must be between 1 and num_replica_groups={total}: "
            "a step commits only with at least min_replicas replica groups, so more than the job has never "
            f"commits. Lower min_replicas or start more groups (`{RUN_HINT}`)."
        )
    if check_reachable:
        check_lighthouse(address, setting=where)
    return ReplicaConfig(address, rid, total, minimum)


#: Why ``ft_hsdp`` is refused (docs/ft.md, "Limits").
HSDP_REFUSAL = (
    "strategy 'ft_hsdp' (FSDP2/HSDP inside a torchft replica group) is not available: torchft 0.2 shards "
    "inside a replica group through a CUDA device mesh (its FSDP path is tested on CUDA with NCCL only), "
    "and lplugins does not provide it yet. On CPU use strategy='ft_ddp' (one process per replica group); "
    "for sharding without fault tolerance use 'fsdp2'."
)


def check_trainer_kwargs(name: str, trainer_kwargs: Mapping[str, Any]) -> None:
    """Refuse Trainer arguments ``name`` cannot run with: not CPU, or more than one process per replica group.

    Raises:
        FTConfigError: ``accelerator`` is not CPU, or ``devices``/``num_nodes`` ask for more than one process.
    """
    accelerator = trainer_kwargs.get("accelerator")
    if accelerator not in (None, "auto", "cpu"):
        raise FTConfigError(
            f"strategy {name!r} runs on CPU (gloo) in this release; got accelerator={accelerator!r}. "
            "Use accelerator='cpu'."
        )
    devices = trainer_kwargs.get("devices")
    if devices not in (None, "auto", 1, "1") and devices != [0]:
        raise FTConfigError(
            f"strategy {name!r} runs one process per replica group; got devices={devices!r}. Use devices=1 and "
            f"start more replica groups instead: `{RUN_HINT}`."
        )
    num_nodes = trainer_kwargs.get("num_nodes")
    if num_nodes not in (None, 1):
        raise FTConfigError(
            f"strategy {name!r} runs one process per replica group; got num_nodes={num_nodes!r}. Use num_nodes=1 "
            "and run `lplugins ft run --lighthouse http://HOST:PORT --first-replica K ...` on each host."
        )
