"""The Lightning callback that applies a gradient-accumulation :class:`~lplugins.accumulation.Schedule`.

The callback holds the policy: it asks the schedule for each window's size, counts the window,
keeps that position in checkpoints and announces changes. How the window reaches the training loop
depends on the optimization mode and is left to a driver (:mod:`lplugins.accumulation._drivers`),
chosen once, at ``setup``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lplugins import _lightning
from lplugins._log import announce
from lplugins._validate import is_int, positive_int
from lplugins.accumulation._drivers import Driver, choose_driver
from lplugins.accumulation._schedules import Schedule, ScheduleContext, ScheduleError, schedule_from

if TYPE_CHECKING:
    import torch

#: Progress-bar keys (shown by Lightning's progress bars; not sent to loggers).
PBAR_FACTOR = "accum"
PBAR_GLOBAL_BATCH = "global_batch"
#: Logger metric names, written once per change, from rank zero.
METRIC_FACTOR = "accumulation/factor"
METRIC_GLOBAL_BATCH = "accumulation/global_batch"

_STATE_VERSION = 1


class AccumulationScheduler(Callback):
    """Apply a gradient-accumulation schedule at optimizer-step boundaries.

    A *window* is the run of micro-batches whose gradients make one optimizer step. The schedule is
    asked for the size ``k`` of a window when the window starts, so a change never takes effect
    inside a window. The loss of each micro-batch is divided by ``k`` (a window of ``k``
    micro-batches of size ``b`` gives the gradient of one batch of ``k * b``), gradients are zeroed
    at the start of a window only, DDP skips the gradient all-reduce on micro-batches that do not end
    a window, and LR schedulers with ``interval="step"`` step once per optimizer step. As in
    Lightning, the last window of an epoch ends with the epoch's last batch even if it is shorter
    (its loss is still divided by ``k``).

    Unlike ``Trainer(accumulate_grad_batches=k)`` and Lightning's ``GradientAccumulationScheduler``,
    the window is counted by this callback rather than by ``batch_idx % k``, so the factor may
    change in the middle of an epoch (step-keyed schedules, ramps) and resuming from a checkpoint
    continues the same windows. The callback's state (optimizer steps, samples, position in the
    window, world size) is saved in checkpoints.

    With manual optimization, call :meth:`backward` instead of ``self.manual_backward`` and step the
    optimizer when it returns ``True``.

    Args:
        schedule: A :class:`~lplugins.accumulation.Schedule`, or an epoch-keyed dict such as
            ``{0: 8, 5: 4, 10: 2}``.
        micro_batch_size: Samples per micro-batch on one process, for schedules that need it
            (default: the schedule's own, then the training DataLoader's ``batch_size``, then the
            size of the first batch).
        log_changes: Say the starting factor (with the schedule) and each change, with the effective
            global batch, once on global rank zero: on the ``"lplugins"`` logger (shown like
            Lightning's own messages) and to the Trainer's loggers.
        progress_bar: Show the factor (``accum``) and global batch in the progress bar.

    Raises:
        ScheduleError: ``schedule`` is not a schedule (at construction); before training: the
            Trainer also sets ``accumulate_grad_batches``, another accumulation callback is present,
            the strategy accumulates by itself (DeepSpeed), or the schedule cannot be met.

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> from lplugins.accumulation import AccumulationScheduler, StepSchedule
        >>> trainer = Trainer(callbacks=[AccumulationScheduler(StepSchedule({0: 8, 100: 4}))], logger=False)
    """

    def __init__(
        self,
        schedule: Schedule | Mapping[int, int],
        *,
        micro_batch_size: int | None = None,
        log_changes: bool = True,
        progress_bar: bool = True,
    ) -> None:
        super().__init__()
        self.schedule = schedule_from(schedule)
        self.micro_batch_size: int | None = positive_int(
            "micro_batch_size", micro_batch_size, optional=True, error=ScheduleError
        )
        self.log_changes = log_changes
        self.progress_bar = progress_bar
        # position in training (saved in checkpoints)
        self.steps = 0
        self.samples = 0
        self._pos = 0  # micro-batches already accumulated in the open window
        self._k = 1  # size of the open window
        self._boundary = False  # whether the current (or last) micro-batch ends its window by count
        self._world_size: int | None = None
        self._micro: int | None = None
        # run-time only
        self._loaded_world_size: int | None = None
        self._announced: int | None = None
        self._in_batch = False
        self._restored = False
        self._driver: Driver | None = None  # how the window reaches the loop; chosen in setup

    # ------------------------------------------------------------------ public
    @property
    def factor(self) -> int:
        """The size of the current window (micro-batches per optimizer step)."""
        return self._k

    @property
    def is_boundary(self) -> bool:
        """Whether the current micro-batch ends its window by count (the epoch's last batch also does)."""
        return self._boundary

    @property
    def global_batch_size(self) -> int | None:
        """The effective global batch of the current window, if the micro-batch size is known."""
        return self.schedule.global_batch_size(self._k, micro_batch_size=self._micro, world_size=self._world_size or 1)

    @staticmethod
    def of(trainer: pl.Trainer) -> AccumulationScheduler:
        """Return the trainer's ``AccumulationScheduler``.

        Raises:
            ScheduleError: the trainer has none.
        """
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, AccumulationScheduler):
                return cb
        raise ScheduleError("This Trainer has no lplugins AccumulationScheduler callback.")

    def estimated_stepping_batches(self, trainer: pl.Trainer) -> int | float:
        """The number of optimizer steps of the whole run under this schedule.

        ``trainer.estimated_stepping_batches`` assumes one constant ``accumulate_grad_batches``; use
        this instead, e.g. for ``OneCycleLR(total_steps=...)`` in ``configure_optimizers``. The
        schedule is played over ``max_epochs`` epochs of ``num_training_batches`` micro-batches
        (each epoch's last window ending with the epoch), from the start of training, and capped
        by ``max_steps``.

        Args:
            trainer: The Trainer (its train dataloader is loaded if needed, as Lightning does).

        Returns:
            The number of optimizer steps, or ``inf`` for endless training.

        Raises:
            ScheduleError: the schedule needs the micro-batch size and it is unknown.

        Example::

            def configure_optimizers(self):
                opt = torch.optim.SGD(self.parameters(), lr=0.1)
                total = AccumulationScheduler.of(self.trainer).estimated_stepping_batches(self.trainer)
                return [opt], [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)]
        """
        max_steps = trainer.max_steps
        if trainer.max_epochs is None or trainer.max_epochs == -1:
            return float("inf") if max_steps == -1 else max_steps
        if trainer.train_dataloader is None:
            _lightning.setup_train_data(trainer)
        per_epoch = trainer.num_training_batches
        if per_epoch == float("inf"):
            return float("inf") if max_steps == -1 else max_steps
        world = trainer.world_size
        micro = self._resolve_micro(trainer)
        if micro is None and self.schedule.needs_micro_batch_size:
            raise ScheduleError(
                f"{self.schedule!r} needs the micro-batch size to estimate the steps; pass micro_batch_size=...."
            )
        self.schedule.check(micro_batch_size=micro, world_size=world)
        steps = samples = 0
        for epoch in range(max(trainer.max_epochs, 1)):
            remaining = int(per_epoch)
            while remaining > 0:
                context = ScheduleContext(
                    epoch=epoch, step=steps, samples=samples, micro_batch_size=micro, world_size=world
                )
                window = min(self.schedule.factor(context), remaining)
                remaining -= window
                samples += window * (micro or 0) * world
                steps += 1
                if max_steps != -1 and steps >= max_steps:
                    return max_steps
        return steps

    def backward(self, pl_module: pl.LightningModule, loss: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        """Manual optimization: scaled backward, without gradient sync inside a window.

        Divides ``loss`` by the window size, calls ``pl_module.manual_backward`` (under the
        strategy's ``block_backward_sync`` unless the micro-batch ends the window) and returns
        whether the caller should now step the optimizer and zero the gradients.

        Args:
            pl_module: The LightningModule (``self`` in ``training_step``).
            loss: The micro-batch loss.
            *args: Passed to ``manual_backward``.
            **kwargs: Passed to ``manual_backward``.

        Returns:
            ``True`` when this micro-batch ends the window: call ``opt.step()`` and ``opt.zero_grad()``.

        Example::

            def training_step(self, batch, batch_idx):
                opt = self.optimizers()
                loss = self.compute_loss(batch)
                if AccumulationScheduler.of(self.trainer).backward(self, loss):
                    opt.step()
                    opt.zero_grad()
        """
        closes = self._closes_window(pl_module.trainer)
        self._require_driver().backward(pl_module, loss / self._k, closes, *args, **kwargs)
        return closes

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_trainer(trainer)
        self._driver = choose_driver(trainer, pl_module, self.schedule)
        self._trainer_ref = trainer
        self._restored = False
        self._loaded_world_size = None
        self._driver.setup(trainer, ends_window=lambda: self._boundary, opens_window=lambda: self._pos == 0)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        world = trainer.world_size
        if not self._restored and trainer.global_step != self.steps:
            # a fresh run (this callback object may have trained before), or a checkpoint without our state:
            # start from Lightning's step count
            self.steps, self.samples, self._pos = trainer.global_step, 0, 0
            self._announced = None
            if trainer.global_step:
                announce(
                    "lplugins: the checkpoint holds no accumulation-scheduler state; %r continues from optimizer "
                    "step %d (samples counted from 0).",
                    self.schedule,
                    trainer.global_step,
                )
        if self._loaded_world_size is not None and self._loaded_world_size != world:
            announce(
                "lplugins: world size changed from %d to %d since the checkpoint; the accumulation factor of %r is "
                "re-derived for %d processes (a constant global batch stays the same).",
                self._loaded_world_size,
                world,
                self.schedule,
                world,
            )
            self._pos = 0  # the open window (whose gradients the checkpoint does not hold) starts afresh
            self._announced = None  # say the factor for the new world size
        self._world_size = world
        self._micro = self._resolve_micro(trainer)
        if self._micro is not None or not self.schedule.needs_micro_batch_size:
            try:
                self.schedule.check(micro_batch_size=self._micro, world_size=world)
            except ScheduleError as err:
                if self._loaded_world_size is None or self._loaded_world_size == world:
                    raise
                raise ScheduleError(
                    f"Cannot resume a checkpoint written by {self._loaded_world_size} rank(s) on {world} rank(s)"
                    f" with {self.schedule!r}: {err} Resume on a world size that fits, or change the micro-batch"
                    " size (the global batch of the checkpoint's run is kept only if it divides)."
                ) from None
            if self._pos == 0:
                self._factor_now(trainer)  # fail now, not at the first window
        if self._pos > 0:
            self._require_driver().apply_factor(trainer, self._k)
            self._announced = self._k
            if self.log_changes:  # resumed inside a window: say what applies until it closes
                announce(
                    "lplugins: gradient accumulation (%r): resuming inside a window of %d micro-batches per "
                    "optimizer step (%d already accumulated before the checkpoint).",
                    self.schedule,
                    self._k,
                    self._pos,
                )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        driver = self._require_driver()
        if self._pos == 0:
            if self._micro is None and self.schedule.needs_micro_batch_size:
                self._micro = self._infer_micro(batch)
                self.schedule.check(micro_batch_size=self._micro, world_size=self._world_size or 1)
            k = self._factor_now(trainer)
            self._k = k
            driver.apply_factor(trainer, k)
            if k != self._announced:
                self._announce(trainer, k)
        self._boundary = driver.begin_batch(trainer, by_count=self._pos + 1 >= self._k)
        self._in_batch = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._require_driver().end_batch(self._k)
        self.steps, self.samples, self._pos = self._advanced(trainer)
        self._in_batch = False

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning ends every window with the epoch (its last batch steps); a window cut short by
        # `on_train_batch_start` returning -1 is dropped, as Lightning does.
        self._pos = 0

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self._driver is not None:
            self._driver.teardown(trainer)
        trainer.accumulate_grad_batches = 1
        self._in_batch = False

    def loop_counters(self) -> dict[str, int]:
        """The schedule's position in steps, which a replica group rejoining an ``ft_ddp`` job takes over."""
        return {"steps": int(self.steps), "samples": int(self.samples)}

    def load_loop_counters(self, counters: dict[str, int]) -> None:
        """Take a peer's :meth:`loop_counters` (the same point of the same step)."""
        self.steps, self.samples = int(counters["steps"]), int(counters["samples"])

    @override
    def state_dict(self) -> dict[str, Any]:
        steps, samples, pos = (self.steps, self.samples, self._pos)
        if self._in_batch and self._trainer_ref is not None:
            # saved from on_train_batch_end (before ours ran): Lightning treats this batch as done on resume
            steps, samples, pos = self._advanced(self._trainer_ref)
        return {
            "version": _STATE_VERSION,
            "schedule": repr(self.schedule),
            "steps": steps,
            "samples": samples,
            "window_pos": pos,
            "window_factor": self._k,
            "boundary": self._boundary,
            "world_size": self._world_size,
            "micro_batch_size": self._micro,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict["steps"])
        self.samples = int(state_dict["samples"])
        self._pos = int(state_dict["window_pos"])
        self._k = int(state_dict["window_factor"])
        self._boundary = bool(state_dict["boundary"])
        self._loaded_world_size = state_dict.get("world_size")
        self._restored = True
        if self._pos == 0:
            self._announced = None

    # ------------------------------------------------------------------ internals
    _trainer_ref: pl.Trainer | None = None

    def _require_driver(self) -> Driver:
        if self._driver is None:
            raise ScheduleError("The AccumulationScheduler is not set up yet; trainer.fit() sets it up.")
        return self._driver

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        if trainer.accumulate_grad_batches != 1:
            raise ScheduleError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and the lplugins accumulation "
                f"schedule {self.schedule!r} both set gradient accumulation; remove accumulate_grad_batches from "
                "the Trainer (or pass the schedule as accumulate_grad_batches to lplugins.compose)."
            )
        others = [
            type(cb).__name__
            for cb in trainer.callbacks  # type: ignore[attr-defined]
            if cb is not self and isinstance(cb, (GradientAccumulationScheduler, AccumulationScheduler))
        ]
        if others:
            raise ScheduleError(
                f"Another gradient-accumulation callback ({', '.join(others)}) is attached next to the lplugins "
                "AccumulationScheduler; keep one."
            )

    def _closes_window(self, trainer: pl.Trainer) -> bool:
        # Lightning's rule: a window ends by count, or with the epoch's last batch
        return self._boundary or _lightning.is_last_batch_of_epoch(trainer)

    def _advanced(self, trainer: pl.Trainer) -> tuple[int, int, int]:
        per_micro_step = (self._micro or 0) * (self._world_size or 1)
        if self._closes_window(trainer):
            return self.steps + 1, self.samples + per_micro_step, 0
        return self.steps, self.samples + per_micro_step, self._pos + 1

    def _context(self, trainer: pl.Trainer) -> ScheduleContext:
        return ScheduleContext(
            epoch=trainer.current_epoch,
            step=self.steps,
            samples=self.samples,
            micro_batch_size=self._micro,
            world_size=self._world_size or trainer.world_size,
        )

    def _factor_now(self, trainer: pl.Trainer) -> int:
        k = self.schedule.factor(self._context(trainer))
        if not is_int(k) or k < 1:
            raise ScheduleError(f"{self.schedule!r} returned factor {k!r}; a factor must be an int >= 1.")
        return k

    def _resolve_micro(self, trainer: pl.Trainer) -> int | None:
        own = getattr(self.schedule, "micro_batch_size", None)
        if isinstance(own, int):
            return own
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        loader = trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None)
        return batch_size if isinstance(batch_size, int) and batch_size > 0 else None

    @staticmethod
    def _infer_micro(batch: Any) -> int:
        from lightning.pytorch.utilities.data import extract_batch_size

        try:
            return int(extract_batch_size(batch))
        except Exception as exc:
            raise ScheduleError(
                "The accumulation schedule needs the micro-batch size and it could not be read from the batch; "
                "pass micro_batch_size=... to the schedule or the AccumulationScheduler."
            ) from exc

    def _announce(self, trainer: pl.Trainer, k: int) -> None:
        previous, self._announced = self._announced, k
        gbs = self.global_batch_size
        if self.progress_bar:  # written once per change, not logged per step (see set_progress_bar_values)
            shown = {PBAR_FACTOR: k} if gbs is None else {PBAR_FACTOR: k, PBAR_GLOBAL_BATCH: gbs}
            _lightning.set_progress_bar_values(trainer, shown)
        if not self.log_changes:
            return
        first = previous is None
        announce(
            "lplugins: gradient accumulation %s%d micro-batch(es) per optimizer step%s (from optimizer step %d, "
            "epoch %d)%s",
            f"per {self.schedule!r}: " if first else "now ",
            k,
            "" if gbs is None else f", effective global batch {gbs}",
            self.steps,
            trainer.current_epoch,
            "" if first else f"; was {previous}",
        )
        if not trainer.is_global_zero:
            return
        metrics = {METRIC_FACTOR: float(k)}
        if gbs is not None:
            metrics[METRIC_GLOBAL_BATCH] = float(gbs)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=_lightning.logging_step(trainer))
