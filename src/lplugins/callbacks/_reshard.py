"""Resuming on another world size: what happens to a checkpoint written by N ranks resumed on M, and what is refused.

The commit marker records the world size and the strategy class that wrote a checkpoint
(:class:`~lplugins.callbacks._record.Record`). Before a committed checkpoint is loaded,
:func:`check_resume` compares them with the run that loads it:

* a change of strategy *family* between DDP (and single device), FSDP2 and DeepSpeed is followed: a
  sharded directory of another family is converted once to one full checkpoint
  (:func:`needs_full_checkpoint`, :mod:`~lplugins.callbacks._portable`), a full file loads into any of
  them (DeepSpeed: :func:`lplugins._lightning.load_full_into_deepspeed`); a directory of a family
  lplugins cannot convert (FSDP1) is refused, on every rank, before anything is loaded
  (:class:`ReshardError`);
* after the load, :func:`describe_resume` says once, on rank zero, what happens to each part of the
  state on the new world size ("resuming a checkpoint written by 2 ranks on 3 ranks: ...").

The parts themselves are done where they live: the strategies reshard (FSDP2: torch distributed
checkpoint reads the slices each rank now owns; DeepSpeed: every rank reads the ZeRO partitions as one
full checkpoint and takes its own partition of it), :class:`~lplugins.callbacks._position.DataPosition`
converts or restarts the epoch in progress, and the accumulation scheduler re-derives its factor.
"""

from __future__ import annotations

import os
from typing import Any

from lplugins._lightning.converted import CONVERTED_SUFFIX
from lplugins._log import announce
from lplugins.callbacks._errors import CheckpointResumeError
from lplugins.callbacks._record import Record

# No Lightning import: this module is one for both Lightning namespaces (the trainer is duck-typed, strategies are
# told apart by class name), so ReshardError is one class for both.
Trainer = Any

__all__ = ["CONVERTIBLE", "ReshardError", "check_resume", "describe_resume", "family", "needs_full_checkpoint"]

#: Strategy families: checkpoints of one family share a layout.
UNSHARDED, FSDP2, FSDP1, DEEPSPEED = "unsharded (DDP, single device)", "FSDP2", "FSDP", "DeepSpeed"
_KNOWN = {
    "SingleDeviceStrategy": UNSHARDED,
    "DDPStrategy": UNSHARDED,
    "DDPSpawnStrategy": UNSHARDED,
    "FSDP2Strategy": FSDP2,
    "ModelParallelStrategy": FSDP2,
    "FSDPStrategy": FSDP1,
    "DeepSpeedStrategy": DEEPSPEED,
}


class ReshardError(CheckpointResumeError):
    """A checkpoint cannot be resumed on this world size or with this strategy (refused before loading it).

    Raised on every rank; ``ckpt_path="latest"`` does not fall back past it to an older checkpoint (they
    were written by the same run, and would be refused the same way).
    """


def family(strategy: str | type) -> str | None:
    """The family of a strategy (its class, or the class name a commit marker records); ``None``: unknown.

    >>> family("DDPStrategy"), family("DeepSpeedStrategy"), family("MyStrategy")
    ('unsharded (DDP, single device)', 'DeepSpeed', None)
    """
    if isinstance(strategy, type):
        for cls in strategy.__mro__:
            if cls.__name__ in _KNOWN:
                return _KNOWN[cls.__name__]
        return None
    if strategy in _KNOWN:
        return _KNOWN[strategy]
    # a subclass recorded by its own name (lplugins' own keep Lightning's names)
    for part, found in (("DeepSpeed", DEEPSPEED), ("FSDP2", FSDP2), ("FSDP", FSDP1), ("DDP", UNSHARDED)):
        if part in strategy:
            return found
    return None


#: The families whose layouts convert into each other (one full checkpoint as the common form).
CONVERTIBLE = (UNSHARDED, FSDP2, DEEPSPEED)


def needs_full_checkpoint(trainer: Trainer, record: Record) -> bool:
    """Whether ``record``'s directory must be converted to one full checkpoint for this run's strategy to load it
    (a sharded directory of another family than this run's: DeepSpeed into DDP or FSDP2, FSDP2 into DDP or
    DeepSpeed)."""
    saved, now = family(record.strategy) if record.strategy else None, family(type(trainer.strategy))
    return record.kind == "dir" and saved != now and saved in CONVERTIBLE and now in CONVERTIBLE


def check_resume(trainer: Trainer, record: Record, path: str) -> None:
    """Refuse, before loading ``record``, a strategy change its layout cannot follow.

    Between the single device, DDP, FSDP2 and DeepSpeed (any ZeRO stage), any checkpoint resumes with any of
    them on any world size (converted when the layouts differ: :func:`needs_full_checkpoint`). A directory
    written by another strategy family (FSDP1) is refused, and so is a full file of another family holding
    several optimizers' state into FSDP2 (Lightning keys each by the model's parameter order).

    Raises:
        ReshardError: the checkpoint's layout cannot be loaded by this run's strategy (the message names both
            layouts and what to do).
    """
    saved, now = family(record.strategy) if record.strategy else None, family(type(trainer.strategy))
    optimizers = len(getattr(trainer.strategy, "optimizers", None) or [])
    if now == FSDP2 and saved not in (FSDP2, None) and record.kind != "dir" and optimizers > 1:
        raise ReshardError(
            f"Cannot resume {path} with {type(trainer.strategy).__name__} ({now}) on {trainer.world_size} rank(s): it"
            f" is one full checkpoint file written by {record.strategy} ({saved}) on {record.world_size or '?'}"
            f" rank(s) with the state of {optimizers} optimizers, and Lightning's FSDP2 load of a full file matches"
            " every optimizer's state to the model's parameters in order, right for one optimizer only. Resume it"
            f" with the {saved} strategy it was written with (any number of ranks); an FSDP2 run with several"
            " optimizers resumes its own sharded checkpoints on any number of ranks, and from them DDP too."
        )
    if saved is None or now is None or saved == now or record.kind != "dir":
        return
    if saved in CONVERTIBLE and now in CONVERTIBLE:
        return
    raise ReshardError(
        f"Cannot resume {path} with {type(trainer.strategy).__name__} ({now}) on {trainer.world_size} rank(s): it"
        f" was written by {record.strategy} ({saved}) on {record.world_size or '?'} rank(s), as a sharded directory"
        f" lplugins cannot convert to {now}'s layout. Resume it with the {saved} strategy it was written with (any"
        " number of ranks), or have that strategy write one full checkpoint file, which every strategy loads."
    )


def describe_resume(trainer: Trainer, record: Record, path: str) -> None:
    """Say once, on rank zero, what happens to the state of a checkpoint written on another world size."""
    world = trainer.world_size
    saved = record.world_size
    now = family(type(trainer.strategy))
    before = family(record.strategy) if record.strategy else None
    crossed = before is not None and now is not None and before != now
    if (not saved or saved == world) and not crossed:
        return
    name = type(trainer.strategy).__name__
    if crossed and record.kind == "dir":
        how = (
            f"the {before} directory was converted once to one full checkpoint (kept next to it, in"
            f" {os.path.basename(path.rstrip('/'))}{CONVERTED_SUFFIX}, reused by the next resume and removed with"
            f" the checkpoint) and loaded by {name} over {world} rank(s): fp32 weights and optimizer state exactly"
            " as saved"
        )
    elif crossed and now == DEEPSPEED:
        how = (
            f"each parameter's fp32 value and optimizer state were put into the DeepSpeed partitions of {world}"
            " rank(s), exactly as saved"
        )
    elif now == DEEPSPEED:
        how = (
            f"every rank read the ZeRO partitions of the {saved or '?'} rank(s) (each rank's file once, each parameter"
            " cut out where DeepSpeed recorded it; the checkpoint itself is unchanged) and took its partition of each"
            f" parameter over {world} rank(s): fp32 weights and optimizer state exactly as saved"
        )
    elif now == FSDP2 and record.kind == "dir":
        how = f"the sharded checkpoint (torch distributed checkpoint) was resharded on load over {world} rank(s)"
    elif now == FSDP2:
        how = f"the full checkpoint file was sharded over {world} rank(s) on load"
    elif now == UNSHARDED:
        how = "model and optimizer state are whole in it and were loaded as they are"
    else:
        how = f"{name} loaded it (lplugins does not know how it handles another world size)"
    announce(
        "lplugins: resuming a checkpoint written by %s rank(s) on %d rank(s): %s (%s -> %s); global_step, epoch"
        " and LR schedulers continue; the RNG states of the saving ranks are not restored; what happens to an"
        " epoch in progress and to gradient accumulation is said next (when there is one).",
        saved or "?", world, how, record.strategy or "unknown strategy", name,
    )  # fmt: skip
