"""The data position of a checkpoint lplugins did not write (a stock ``ModelCheckpoint`` file), from its counters.

Such a file holds Lightning's loop counters -- the epoch, and how many of its batches were trained -- but not
the random state that epoch's sample order was drawn from. Lightning resumes it with a fresh iterator: the
epoch's first batches are trained again and its last ones never (its own warning says "unreliable results").

The epoch can still be continued exactly when every training loader's order is fixed by the epoch number
alone: a ``SequentialSampler``, or a ``DistributedSampler`` (its seed plus ``set_epoch``: the sampler Lightning
puts in every loader under a multi-process strategy, shuffled or not). Then the trained batches are skipped as
indices, as for lplugins' own checkpoints (:mod:`lplugins.callbacks._position`). Otherwise :func:`record`
returns why not, for the one line that says the rest of the epoch comes from a fresh iterator.

A ``ModelCheckpoint`` file does not say on how many ranks it was written. From its second epoch on, the
batches of the epochs before (in its counters) tell whether this run's epochs have the same length
(:func:`why_other_geometry`); in its first epoch, the file is taken to come from this world size.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

__all__ = ["record", "why_order_unknown", "why_other_geometry"]


def why_order_unknown(index_sampler: Any) -> str | None:
    """Why the order ``index_sampler`` gives an epoch may differ after a restart, or ``None`` when it cannot.

    Args:
        index_sampler: A loader's ``batch_sampler`` (a ``BatchSampler`` over its sampler) or its ``sampler``.
    """
    sampler = index_sampler
    if type(sampler).__iter__ is BatchSampler.__iter__:  # batching does not change the order
        sampler = sampler.sampler
    kind = type(sampler)
    if kind.__iter__ in (SequentialSampler.__iter__, DistributedSampler.__iter__):
        return None
    if kind.__iter__ is RandomSampler.__iter__:
        source = "its own generator" if getattr(sampler, "generator", None) is not None else "torch's global generator"
        return (
            f"its RandomSampler drew the epoch's order from the state of {source} at the epoch's start, which a"
            " checkpoint without lplugins' data position does not hold"
        )
    return f"its sampler is a {kind.__name__}, whose order lplugins cannot know is the same after a restart"


def why_other_geometry(before: int, epoch: int, total: float) -> str | None:
    """Why the epochs the checkpoint counts are not this run's epochs, or ``None`` when they may be.

    Args:
        before: The batches the checkpoint's run trained before the current epoch (per rank).
        epoch: The current epoch.
        total: This run's batches per epoch (per rank; ``inf`` when unknown).
    """
    if total == float("inf") or before == epoch * int(total):
        return None
    return (
        f"the checkpoint's run trained {before} batches in its {epoch} epoch(s) before this one, not"
        f" {epoch} x {int(total)}: it had another number of batches per epoch (another world size, batch size or"
        " data set), so where its epoch stopped is not known here"
    )


def record(index_sampler: Any, epoch: int) -> dict[str, Any]:
    """A loader's record for the replay plan: a fixed order to skip into, or why the epoch restarts."""
    why = why_order_unknown(index_sampler)
    if why is not None:
        return {"kind": "none", "why": why}
    return {"kind": "sampler", "epoch": epoch, "rng": None, "generators": []}
