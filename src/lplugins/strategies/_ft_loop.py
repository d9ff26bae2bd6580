"""Where a replica group's training loop stands, sent with the state a rejoining group receives.

A group restarted into a running job gets the model and optimizer state of a peer (``ft_ddp``); without
the loop's position its Lightning loop would count from 0 again: ``trainer.global_step``, ``max_steps``,
``log_every_n_steps``, and step-keyed accumulation schedules (``{"name": "step", ...}``, ramps) would
then differ between the groups. The peer's counters are read and applied here, in the middle of the
optimizer step where torchft delivers the state (after Lightning counted the step as started, before
it counts it as done), so both groups end the step with the same counts.
"""

from __future__ import annotations

from typing import Any

from lplugins._lightning.accumulation import logging_step, optimizer_step_progress, set_logging_step

__all__ = ["progress", "restore"]


def _step_keyed(trainer: Any) -> list[Any]:
    """The callbacks whose position is counted in steps and travels with the peer's state.

    A callback opts in with ``loop_counters() -> dict[str, int]`` and ``load_loop_counters(dict)``
    (lplugins' ``AccumulationScheduler`` does); the strategy does not import the accumulation package.
    """
    return [cb for cb in trainer.callbacks if callable(getattr(cb, "load_loop_counters", None))]


def progress(trainer: Any) -> dict[str, Any]:
    """The loop counters a rejoining group takes over: Lightning's optimizer steps, step-keyed callbacks'.

    Returns:
        ``{"global_step": int, "batches_that_stepped": int, "callbacks": [dict[str, int], ...]}``.
    """
    return {
        "global_step": int(optimizer_step_progress(trainer).completed),
        "batches_that_stepped": logging_step(trainer),
        "callbacks": [cb.loop_counters() for cb in _step_keyed(trainer)],
    }


def restore(trainer: Any, state: dict[str, Any]) -> None:
    """Move this group's loop counters to a peer's (``progress``), taken at the same point of the same step."""
    total = optimizer_step_progress(trainer)
    shift = int(state["global_step"]) - int(total.completed)
    total.ready += shift
    total.completed += shift
    if hasattr(total, "started"):
        total.started += shift
    if hasattr(total, "processed"):
        total.processed += shift
    set_logging_step(trainer, int(state["batches_that_stepped"]))
    for callback, counters in zip(_step_keyed(trainer), state.get("callbacks", []), strict=False):
        callback.load_loop_counters(counters)
