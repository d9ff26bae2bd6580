"""Where this process stands: its global rank, before and after the process group exists."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

#: Environment variables that hold the global rank, in the order they are trusted (the same order
#: as Lightning's ``rank_zero_only``: torchrun, SLURM, LSF).
GLOBAL_RANK_VARS: tuple[str, ...] = ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


@dataclass(frozen=True)
class RankInfo:
    """This process's rank and where it was read from.

    Attributes:
        global_rank: The rank among all processes (0 for a single process).
        world_size: The number of processes, when known (1 otherwise).
        source: ``"process_group"``, the environment variable it came from, or ``"default"``.
    """

    global_rank: int
    world_size: int
    source: str


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _process_group_rank() -> tuple[int, int] | None:
    # torch.distributed cannot be initialised unless it has been imported: never import torch here.
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except (RuntimeError, ValueError):  # pragma: no cover - a group being torn down
        return None
    return None


def rank_info() -> RankInfo:
    """Return this process's :class:`RankInfo`.

    Once ``torch.distributed`` is initialised its rank is used. Before that, the environment is read
    as the launchers set it: ``RANK`` (torchrun), ``SLURM_PROCID`` (SLURM), ``JSM_NAMESPACE_RANK``
    (LSF), and finally ``LOCAL_RANK`` with ``NODE_RANK``/``GROUP_RANK`` (Lightning's own launcher,
    which sets only those; a node's main process has only ``NODE_RANK``). Without ``LOCAL_WORLD_SIZE``
    the rank computed on a node other than 0 is only guaranteed to be non-zero, not exact.

    Returns:
        The rank, the world size and where they came from.

    Examples:
        >>> rank_info().global_rank >= 0
        True
    """
    group = _process_group_rank()
    if group is not None:
        return RankInfo(group[0], group[1], "process_group")
    world = _env_int("WORLD_SIZE") or _env_int("SLURM_NTASKS") or 1
    for name in GLOBAL_RANK_VARS:
        value = _env_int(name)
        if value is not None:
            return RankInfo(value, world, name)
    local = _env_int("LOCAL_RANK")
    node = _env_int("NODE_RANK") or _env_int("GROUP_RANK") or 0
    if local is not None or node:
        # Lightning's launcher: LOCAL_RANK in its children; a node's main process has only NODE_RANK
        local = local or 0
        per_node = _env_int("LOCAL_WORLD_SIZE") or local + 1
        return RankInfo(node * per_node + local, world, "LOCAL_RANK" if "LOCAL_RANK" in os.environ else "NODE_RANK")
    return RankInfo(0, 1, "default")


def global_rank() -> int:
    """This process's global rank (see :func:`rank_info` for where it is read from).

    Examples:
        >>> isinstance(global_rank(), int)
        True
    """
    group = _process_group_rank()
    if group is not None:
        return group[0]
    return rank_info().global_rank


def is_global_zero() -> bool:
    """Whether this process is global rank 0 (also true in a plain single-process run)."""
    return global_rank() == 0
