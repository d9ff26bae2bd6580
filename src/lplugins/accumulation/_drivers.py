"""How an accumulation window reaches the training loop: one small driver per optimization mode.

:class:`~lplugins.accumulation.AccumulationScheduler` owns the policy: the schedule, the window it
counts, its state in checkpoints and the logging. A driver only applies the window to the run, and
:func:`choose_driver` picks one once, at ``setup``:

=====================  =====================================================================
driver                 when
=====================  =====================================================================
:class:`Automatic`     automatic optimization: Lightning's loop steps when the window ends
:class:`Manual`        manual optimization: ``AccumulationScheduler.backward`` does the work
:class:`DeepSpeed`     the strategy accumulates by itself (DeepSpeed's engine)
=====================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies import DeepSpeedStrategy, ParallelStrategy

from lplugins import _lightning
from lplugins.accumulation._schedules import Schedule, ScheduleError

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch

__all__ = ["Automatic", "Driver", "DeepSpeed", "Manual", "choose_driver"]


class Driver:
    """The interface between the scheduler's window and the training loop (default: do nothing).

    The scheduler calls :meth:`setup` once, :meth:`apply_factor` whenever a window opens (and when
    training resumes inside one), :meth:`begin_batch` / :meth:`end_batch` around each micro-batch
    and :meth:`teardown` at the end of fit.
    """

    def setup(self, trainer: pl.Trainer, *, ends_window: Callable[[], bool], opens_window: Callable[[], bool]) -> None:
        """Prepare the run; ``ends_window()`` / ``opens_window()`` read the scheduler's window."""

    def apply_factor(self, trainer: pl.Trainer, factor: int) -> None:
        """Tell the loop (or the strategy) the size of the open window."""

    def begin_batch(self, trainer: pl.Trainer, by_count: bool) -> bool:
        """Return whether the micro-batch starting now ends its window (``by_count``: it does by count)."""
        return by_count

    def end_batch(self, factor: int) -> None:
        """Check the micro-batch that just ended (``factor``: the size of its window)."""

    def backward(
        self, pl_module: pl.LightningModule, loss: torch.Tensor, closes: bool, *args: Any, **kwargs: Any
    ) -> None:
        """``manual_backward`` of an already scaled loss, without gradient sync unless it ``closes`` the window."""
        strategy = pl_module.trainer.strategy
        if not closes and isinstance(strategy, ParallelStrategy):
            with strategy.block_backward_sync():
                pl_module.manual_backward(loss, *args, **kwargs)
        else:
            pl_module.manual_backward(loss, *args, **kwargs)

    def teardown(self, trainer: pl.Trainer) -> None:
        """Undo what :meth:`setup` and :meth:`apply_factor` changed."""


class Automatic(Driver):
    """Automatic optimization: Lightning's loop steps and zeroes the gradients where the window says.

    Lightning divides the loss by ``trainer.accumulate_grad_batches``, which is set to the window size.
    """

    def __init__(self) -> None:
        self._restore: Callable[[], None] | None = None

    def setup(self, trainer: pl.Trainer, *, ends_window: Callable[[], bool], opens_window: Callable[[], bool]) -> None:
        self._restore = _lightning.override_accumulation_windows(
            trainer, ends_window=ends_window, opens_window=opens_window, error=ScheduleError
        )

    def apply_factor(self, trainer: pl.Trainer, factor: int) -> None:
        trainer.accumulate_grad_batches = factor

    def teardown(self, trainer: pl.Trainer) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None


class Manual(Driver):
    """Manual optimization: the user's ``training_step`` calls ``AccumulationScheduler.backward``."""

    def __init__(self) -> None:
        self._backward_called = False

    def begin_batch(self, trainer: pl.Trainer, by_count: bool) -> bool:
        self._backward_called = False
        return by_count

    def backward(
        self, pl_module: pl.LightningModule, loss: torch.Tensor, closes: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._backward_called = True
        super().backward(pl_module, loss, closes, *args, **kwargs)

    def end_batch(self, factor: int) -> None:
        if not self._backward_called and factor > 1:
            raise ScheduleError(
                "With manual optimization, lplugins cannot accumulate gradients for you: call "
                "`AccumulationScheduler.of(self.trainer).backward(self, loss)` instead of `self.manual_backward(loss)` "
                "in training_step, and step/zero the optimizer only when it returns True."
            )


class DeepSpeed(Automatic):
    """DeepSpeed: its engine divides the loss and decides when to step; the window is handed to it.

    Lightning's loop still steps where the window ends (as :class:`Automatic`), but with
    ``trainer.accumulate_grad_batches = 1``: the engine divides the loss by its own
    ``gradient_accumulation_steps``, which is set to the window size, and is told explicitly whether
    each micro-batch ends the window (the epoch's last batch included).
    """

    def apply_factor(self, trainer: pl.Trainer, factor: int) -> None:
        strategy: Any = trainer.strategy
        engine = strategy.model
        if engine.gradient_accumulation_steps() != factor:
            setter = getattr(strategy, "set_gradient_accumulation_steps", None)
            if callable(setter):
                setter(factor)
            else:
                engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * factor * strategy.world_size)
        # the engine scales the loss by 1/factor already; Lightning must not divide it again
        trainer.accumulate_grad_batches = 1

    def begin_batch(self, trainer: pl.Trainer, by_count: bool) -> bool:
        # Lightning leaves the epoch's last batch to the engine: it must be said explicitly
        boundary = by_count or _lightning.is_last_batch_of_epoch(trainer)
        engine: Any = trainer.strategy.model
        engine.set_gradient_accumulation_boundary(boundary)
        return boundary

    def teardown(self, trainer: pl.Trainer) -> None:
        super().teardown(trainer)
        engine = trainer.strategy.model
        if engine is not None and hasattr(engine, "set_gradient_accumulation_boundary"):
            _lightning.reset_deepspeed_accumulation_boundary(engine)


def choose_driver(trainer: pl.Trainer, pl_module: pl.LightningModule, schedule: Schedule) -> Driver:
    """The driver for this run.

    Raises:
        ScheduleError: the strategy accumulates by itself and is not DeepSpeed, DeepSpeed with manual
            optimization, or a DeepSpeed config that fixes the accumulation.
    """
    strategy = trainer.strategy
    if strategy.handles_gradient_accumulation:
        _check_deepspeed(strategy, pl_module, schedule)
        return DeepSpeed()
    if not pl_module.automatic_optimization:
        return Manual()
    return Automatic()


def _check_deepspeed(strategy: Any, pl_module: pl.LightningModule, schedule: Schedule) -> None:
    if not isinstance(strategy, DeepSpeedStrategy):  # importable without DeepSpeed installed
        raise ScheduleError(
            f"The strategy {type(strategy).__name__} accumulates gradients itself and lplugins does not know "
            "how to change its accumulation at run time; use a DDP or DeepSpeed strategy, or a constant "
            "Trainer(accumulate_grad_batches=k)."
        )
    if not pl_module.automatic_optimization:
        raise ScheduleError(
            "An accumulation schedule with DeepSpeed needs automatic optimization: DeepSpeed's engine owns "
            "the backward pass and the step, so AccumulationScheduler.backward() cannot drive it."
        )
    config = getattr(strategy, "config", None)
    if isinstance(config, Mapping):
        for key in ("gradient_accumulation_steps", "train_batch_size"):
            value = config.get(key)
            if value is not None and value != "auto":
                raise ScheduleError(
                    f"The DeepSpeed config sets {key}={value!r}, but the accumulation schedule "
                    f"{schedule!r} changes it during training; lplugins will not override your config "
                    f"silently. Remove '{key}' from the DeepSpeed config (or set it to 'auto'), or drop the "
                    "schedule and keep a fixed accumulation."
                )
