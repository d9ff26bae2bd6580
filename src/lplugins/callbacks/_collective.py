"""The few collectives checkpointing needs, through the trainer's strategy, and cross-rank agreement on errors.

Every function here is called by all ranks together (or is a no-op in a single process).

The agreement on errors (:func:`gather_failures`, :func:`agree_on_failure`) is not a collective: it
goes through the process group's store (:func:`lplugins._coord.board.agree`), so it cannot pair with a
collective a strategy runs inside its own save (DeepSpeed's final barrier), and a rank stuck in one
is answered for by its watchdog: the failing rank's real error is raised on every rank in seconds.
A collective here that fails (a peer process ended) carries the other ranks' errors as notes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lplugins._coord import board as _board
from lplugins._coord import watchdog as _watchdog
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
    try:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    except RuntimeError as err:  # a peer ended: say why, if it said
        raise _watchdog.note_peer_failures(err)  # noqa: B904 -- the same exception, with notes
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
    try:
        torch.distributed.all_gather_object(out, obj)
    except RuntimeError as err:
        raise _watchdog.note_peer_failures(err)  # noqa: B904 -- the same exception, with notes
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
    Out of band (the process group's store): it cannot pair with a strategy's own collectives.

    Raises:
        RuntimeError: the other ranks cannot be reached (rank 0's process ended), with their known errors.
    """
    agreement = _agree(trainer, error, where)
    silent = [(r, "no answer: the rank stopped responding (its process ended?)") for r in agreement.missing]
    return sorted(agreement.failures + silent)


def agree_on_failure(trainer: Trainer, error: BaseException | None, where: str) -> None:
    """Every rank learns whether any rank failed at ``where``; if one did, every rank raises.

    The rank that failed first raises its own ``error`` (with a note naming the other ranks' errors,
    and the ranks that were stuck in a collective and stop when this process does). Every other rank
    raises :class:`~lplugins.callbacks.CheckpointWriteError` naming the first failing rank and its real
    error (``from`` its own error, if it had one). Returns on every rank when no rank failed.

    Raises:
        CheckpointWriteError: another rank failed first.
        BaseException: ``error``, when this rank failed first.
    """
    from lplugins.callbacks._errors import CheckpointWriteError

    agreement = _agree(trainer, error, where)
    rank = trainer.global_rank
    if not agreement.failures:
        if agreement.missing and error is None:
            ranks = ", ".join(map(str, agreement.missing))
            raise CheckpointWriteError(
                f"{where}: rank(s) {ranks} stopped answering (their process ended, or they are stuck); see their log."
            )
        return
    others = [(r, t) for r, t in agreement.failures if r != rank]
    if error is not None and agreement.first in (None, rank):
        if others:
            _board.add_note(
                error, f"lplugins: {where} also failed on " + "; ".join(f"rank {r}: {t}" for r, t in others)
            )
        for r, what in agreement.blocked:
            _board.add_note(error, f"lplugins: rank {r} waits in {what}; it stops when this process ends.")
        for r in agreement.missing:
            _board.add_note(error, f"lplugins: rank {r} did not answer within {_watchdog.bound() or 30:g}s.")
        raise error
    first = next(((r, t) for r, t in agreement.failures if r == agreement.first), agreement.failures[0])
    mine = f" On rank {rank} it then failed too: {_text(error)}." if error is not None else ""
    raise CheckpointWriteError(f"{where} failed on rank {first[0]}: {first[1]}.{mine}") from error


def _text(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else 'no message'}"


def _agree(trainer: Trainer, error: BaseException | None, where: str) -> _board.Agreement:
    text = None if error is None else _text(error)
    if not is_distributed(trainer):
        return _board.Agreement(failures=[(0, text)] if text else [], first=0 if text else None)
    return _board.agree(text, where)
