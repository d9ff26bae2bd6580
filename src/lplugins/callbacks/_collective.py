"""The few collectives checkpointing needs, through the trainer's strategy, and cross-rank agreement on errors.

Every function here is called by all ranks together (or is a no-op in a single process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lplugins.callbacks._errors import CheckpointDirectoryError, CheckpointResumeError
from lplugins.callbacks._storage import Storage

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "agree_on_failure",
    "agree_on_path",
    "gather_failures",
    "any_rank",
    "broadcast",
    "gather",
    "is_distributed",
    "reduce_max",
    "writable_on_every_rank",
]


def is_distributed(trainer: Trainer) -> bool:
    """Whether there are other ranks to talk to."""
    return trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def reduce_max(trainer: Trainer, values: list[int]) -> list[int]:
    """Element-wise max over all ranks (one small all-reduce); the values themselves when single-process."""
    if not is_distributed(trainer):
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=trainer.strategy.root_device)
    # raw torch.distributed: this runs at every optimizer step, and Lightning's strategy.reduce puts a
    # barrier before its all-reduce (two collectives per step instead of one)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def any_rank(trainer: Trainer, flag: bool) -> bool:
    """Whether ``flag`` is true on any rank."""
    return bool(reduce_max(trainer, [int(flag)])[0])


def gather(trainer: Trainer, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not is_distributed(trainer):
        return [obj]
    # raw torch.distributed: a strategy's all_gather takes tensors only, and these are Python objects
    out: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast(trainer: Trainer, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not is_distributed(trainer):
        return obj
    return trainer.strategy.broadcast(obj, src=0)


def agree_on_path(trainer: Trainer, path: str | None) -> None:
    """Check that every rank resolved the same checkpoint.

    Raises:
        CheckpointResumeError: they did not (the message lists each rank's path).
    """
    paths = gather(trainer, path)
    if len(set(paths)) > 1:
        listing = ", ".join(f"rank {rank}: {p!r}" for rank, p in enumerate(paths))
        raise CheckpointResumeError(
            f"Ranks resolved different checkpoints to resume from ({listing}). The checkpoint directory must be"
            " shared by all ranks (or pass the same explicit ckpt_path everywhere)."
        )


def writable_on_every_rank(trainer: Trainer, storage: Storage) -> None:
    """Create the directory and write a probe file there on every rank; all raise if any rank cannot.

    Raises:
        CheckpointDirectoryError: some rank cannot write there (the message names each such rank's error).
    """
    error: str | None = None
    try:
        storage.probe_writable()
    except OSError as err:
        error = f"{type(err).__name__}: {err}"
    bad = [(rank, e) for rank, e in enumerate(gather(trainer, error)) if e]
    if bad:
        details = "; ".join(f"rank {rank}: {e}" for rank, e in bad)
        raise CheckpointDirectoryError(
            f"DurableCheckpoint cannot write to dirpath={storage.dirpath!r} ({details}). Give a writable directory."
        )


def gather_failures(trainer: Trainer, error: BaseException | None, where: str) -> list[tuple[int, str]]:
    """Every rank's failure at ``where``, as ``[(rank, "Type: message"), ...]`` (empty: no rank failed).

    Called by all ranks together; never raises for a failure (the caller decides, e.g. to fall back).

    Note:
        Interim implementation (a gather); to be replaced by an out-of-band agreement that cannot pair
        with a strategy's own collectives.
    """
    text = None if error is None else f"{type(error).__name__}: {error}"
    return [(rank, t) for rank, t in enumerate(gather(trainer, text)) if t is not None]


def agree_on_failure(trainer: Trainer, error: BaseException | None, where: str) -> None:
    """Every rank learns whether any rank failed at ``where``; if one did, every rank raises.

    A rank that failed raises its own ``error``; the others raise
    :class:`~lplugins.callbacks.CheckpointWriteError` carrying the failing ranks' real errors (rank and
    message). Returns on every rank when no rank failed.

    Note:
        Interim implementation (a gather); to be replaced by an out-of-band agreement that cannot pair
        with a strategy's own collectives.
    """
    from lplugins.callbacks._errors import CheckpointWriteError

    failures = gather_failures(trainer, error, where)
    if not failures:
        return
    if error is not None:
        raise error
    details = "; ".join(f"rank {rank}: {t}" for rank, t in failures)
    raise CheckpointWriteError(f"{where} failed on another rank ({details}).")
