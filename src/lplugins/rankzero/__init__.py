"""Rank-zero-safe logging and the deadlock guard.

* :func:`get_logger` returns a :class:`RankLogger`: records carry the global rank and are emitted on
  rank 0 only, unless a call (or the logger) asks for every rank, which prefixes ``[rank N]``.
* :func:`rank_zero_print` and :func:`rank_zero_warn`: ``print`` and ``warnings.warn`` once per job.
* :func:`rank_zero_block` / :func:`rank_zero_only`: inside, collectives raise
  :class:`CollectiveInRankZeroBlockError` instead of deadlocking.

All of it works before the process group exists (the rank is read from the launcher's environment:
``RANK``, ``SLURM_PROCID``, ``LOCAL_RANK``/``NODE_RANK``) and after.

Importing this package imports neither torch nor Lightning; the standard ``logging`` module is not
shadowed (this package is ``lplugins.rankzero``).
"""

from __future__ import annotations

from lplugins.rankzero._guard import (
    CollectiveInRankZeroBlockError,
    RankZeroBlock,
    in_rank_zero_block,
    rank_zero_block,
    rank_zero_only,
)
from lplugins.rankzero._logger import (
    RankLogger,
    RankZeroFilter,
    get_logger,
    rank_prefix,
    rank_zero_print,
    rank_zero_warn,
)
from lplugins.rankzero._rank import RankInfo, global_rank, is_global_zero, rank_info

__all__ = [
    "CollectiveInRankZeroBlockError",
    "RankInfo",
    "RankLogger",
    "RankZeroBlock",
    "RankZeroFilter",
    "get_logger",
    "global_rank",
    "in_rank_zero_block",
    "is_global_zero",
    "rank_info",
    "rank_prefix",
    "rank_zero_block",
    "rank_zero_only",
    "rank_zero_print",
    "rank_zero_warn",
]
