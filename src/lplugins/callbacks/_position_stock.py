"""The data position of a checkpoint lplugins did not write (a stock ``ModelCheckpoint`` file), from its counters.

Such a file holds Lightning's loop counters -- the epoch, and how many of its batches were trained -- but not
the random state that epoch's sample order was drawn from. Lightning resumes it with a fresh iterator: the
epoch's first batches are trained again and its last ones never (its own warning says "unreliable results").

The epoch can still be continued exactly when every training loader's order is fixed by the epoch number
alone: a ``SequentialSampler``, or a ``DistributedSampler`` (its seed plus ``set_epoch``: the sampler Lightning
puts in every loader under a multi-process strategy, shuffled or not). Then the trained batches are skipped as
indices, as for lplugins' own checkpoints (:mod:`lplugins.callbacks._position`). Otherwise :func:`record`
returns why not, for the one line that says the rest of the epoch comes from a fresh iterator.

The checkpoint is taken to come from a run on this world size (a ``ModelCheckpoint`` file does not say).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

__all__ = ["record", "why_order_unknown"]


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


def record(index_sampler: Any, epoch: int) -> dict[str, Any]:
    """A loader's record for the replay plan: a fixed order to skip into, or why the epoch restarts."""
    why = why_order_unknown(index_sampler)
    if why is not None:
        return {"kind": "none", "why": why}
    return {"kind": "sampler", "epoch": epoch, "rng": None, "generators": []}
