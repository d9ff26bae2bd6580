"""Private Lightning accesses for gradient-accumulation schedules: the epoch loop's "step now?" and
"zero the gradients now?" decisions, replaced while a schedule runs; the step Lightning logs at; the
progress bar's values; the setup of the training data for a step estimate."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lplugins._lightning.registry import CHECKED_VERSIONS, _private

if TYPE_CHECKING:
    import lightning.pytorch as pl


# ------------------------------------------------------------------ accumulation
# (owned by lplugins.accumulation)

_EPOCH_LOOP = "trainer.fit_loop.epoch_loop"
_AUTOMATIC = "trainer.fit_loop.epoch_loop.automatic_optimization"
_private(_EPOCH_LOOP, "_accumulated_batches_reached", "trainer", "'step now?': replaced while a schedule runs")
_private(_AUTOMATIC, "_make_zero_grad_fn", "trainer", "'zero the gradients now?': replaced while a schedule runs")
_private(_AUTOMATIC, "_skip_backward", "trainer", "no zero_grad before a skipped backward, as in Lightning")
_private(_AUTOMATIC, "_on_before_zero_grad", "trainer", "Lightning's own zero_grad, hooks included")
_private(_AUTOMATIC, "_optimizer_zero_grad", "trainer", "Lightning's own zero_grad, hooks included")
_private(_EPOCH_LOOP, "_num_ready_batches_reached", "trainer", "whether this batch ends the epoch (and its window)")
_private(_EPOCH_LOOP, "_batches_that_stepped", "trainer", "the step Lightning logs metrics at")
_private("trainer", "_logger_connector", "trainer", "holds the dict the progress bars read")
_private("trainer._logger_connector", "_progress_bar_metrics", "trainer", "a progress-bar value set once per change")
_private(
    "deepspeed.runtime.engine.DeepSpeedEngine",
    "_is_gradient_accumulation_boundary",
    "init",
    "give the accumulation boundary back to the engine's own counting",
)


def override_accumulation_windows(
    trainer: pl.Trainer,
    *,
    ends_window: Callable[[], bool],
    opens_window: Callable[[], bool],
    error: type[Exception],
) -> Callable[[], None]:
    """Let the caller decide where accumulation windows end in Lightning's automatic-optimization loop.

    Lightning decides "step now" with ``batch_progress.current.ready % accumulate_grad_batches`` and
    "zero the gradients" with ``batch_idx % accumulate_grad_batches``; both are only right for a
    factor that is constant over the epoch. Two instance attributes replace them: the optimizer
    steps after a micro-batch when ``ends_window()``, and the gradients are zeroed before a
    micro-batch when ``opens_window()`` (unless its backward is skipped).

    Args:
        trainer: The Trainer, during ``setup`` of fit.
        ends_window: Whether the current micro-batch ends its window.
        opens_window: Whether the current micro-batch opens a window.
        error: The exception class to raise when this Lightning lacks the methods.

    Returns:
        A function that gives Lightning its own methods back.

    Raises:
        Exception: (``error``) this Lightning has no such methods.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    auto = epoch_loop.automatic_optimization
    for obj, name in ((epoch_loop, "_accumulated_batches_reached"), (auto, "_make_zero_grad_fn")):
        if not callable(getattr(type(obj), name, None)):
            from importlib.metadata import version

            raise error(
                f"lplugins needs Lightning's {type(obj).__name__}.{name} to apply an accumulation schedule; this "
                f"Lightning ({version('lightning')}) has none (lplugins is checked with {CHECKED_VERSIONS})."
            )

    def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Callable[[], None] | None:
        if auto._skip_backward or not opens_window():
            return None

        def zero_grad_fn() -> None:
            auto._on_before_zero_grad(optimizer)
            auto._optimizer_zero_grad(batch_idx, optimizer)

        return zero_grad_fn

    epoch_loop.__dict__["_accumulated_batches_reached"] = ends_window
    auto.__dict__["_make_zero_grad_fn"] = make_zero_grad_fn

    def restore() -> None:
        epoch_loop.__dict__.pop("_accumulated_batches_reached", None)
        auto.__dict__.pop("_make_zero_grad_fn", None)

    return restore


def is_last_batch_of_epoch(trainer: pl.Trainer) -> bool:
    """Whether the current training batch is the epoch's last (Lightning ends the open window with it)."""
    return bool(trainer.fit_loop.epoch_loop._num_ready_batches_reached())


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs metrics at: optimizer steps taken, across epochs and resumes."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def optimizer_step_progress(trainer: pl.Trainer) -> Any:
    """Lightning's count of optimizer steps (``ready``/``started``/``processed``/``completed``);
    ``trainer.global_step`` is its ``completed``."""
    loop = trainer.fit_loop.epoch_loop
    module = trainer.lightning_module
    if module is None or module.automatic_optimization:
        return loop.automatic_optimization.optim_progress.optimizer.step.total
    return loop.manual_optimization.optim_step_progress.total


def set_logging_step(trainer: pl.Trainer, step: int) -> None:
    """Move the step Lightning logs metrics at (see :func:`logging_step`)."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = int(step)


def set_progress_bar_values(trainer: pl.Trainer, values: dict[str, Any]) -> None:
    """Write values into the dict the progress bars read, without logging a metric.

    ``pl_module.log(..., prog_bar=True)`` would do the same but puts a metric in Lightning's result
    collection, which then costs a conversion on every micro-batch (measured: ~5% per step on a
    small model).
    """
    pbar = getattr(getattr(trainer, "_logger_connector", None), "_progress_bar_metrics", None)
    if isinstance(pbar, dict):
        pbar.update(values)


def reset_deepspeed_accumulation_boundary(engine: Any) -> None:
    """Give the gradient-accumulation boundary back to the DeepSpeed engine's own counting."""
    engine._is_gradient_accumulation_boundary = None


_private("trainer.fit_loop", "setup_data", "trainer", "a step estimate before fit has set up the training data")


def setup_train_data(trainer: pl.Trainer) -> None:
    """Set up the training dataloader now (what ``fit`` does at its start), for an estimate before it."""
    trainer.fit_loop.setup_data()
