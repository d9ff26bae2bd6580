"""Private Lightning accesses for composing a Trainer and for checkpointing: callback order, precisions,
LightningCLI's Trainer, the path ``fit`` restores from, the checkpoint dict, Lightning's own messages, and the
data position of an epoch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from lplugins._lightning.registry import _private

if TYPE_CHECKING:
    import lightning.pytorch as pl


# ------------------------------------------------------------------ composition and the Trainer
# (owned by the compose / manager / LightningCLI code)

_CALLBACK_CONNECTOR = "lightning.pytorch.trainer.connectors.callback_connector._CallbackConnector"
_private(_CALLBACK_CONNECTOR, "_reorder_callbacks", "class", "attach(): order callbacks as Trainer() does")
_private("lightning.fabric.plugins.precision.deepspeed", "_PRECISION_INPUT", "class", "DeepSpeed's precisions")
_private("lightning.fabric.plugins.precision.fsdp", "_PRECISION_INPUT", "class", "FSDP's precisions")
_private("lightning.fabric.connector", "_convert_precision_to_unified_args", "class", "'16' means '16-mixed'")
_private("lightning.pytorch.cli.LightningCLI", "_instantiate_trainer", "class", "compose the CLI's Trainer kwargs")
_private("lightning.pytorch.cli.LightningCLI", "_get", "class", "read a config section of the running subcommand")


def reorder_callbacks(callbacks: list[pl.Callback]) -> list[pl.Callback]:
    """Order callbacks as ``Trainer()`` does: tuner callbacks first, checkpoint callbacks last."""
    from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector

    return list(_CallbackConnector._reorder_callbacks(callbacks))


def strategy_precisions(family: Literal["deepspeed", "fsdp"]) -> tuple[str, ...]:
    """The precision strings the precision plugin of Lightning's DeepSpeed or FSDP strategy accepts."""
    from typing import get_args

    if family == "deepspeed":
        from lightning.fabric.plugins.precision.deepspeed import _PRECISION_INPUT
    else:
        from lightning.fabric.plugins.precision.fsdp import _PRECISION_INPUT
    return tuple(get_args(_PRECISION_INPUT))


def unified_precision(precision: str | int) -> str:
    """Lightning's current spelling of a precision input (``16`` -> ``"16-mixed"``), without its warnings."""
    import warnings

    from lightning.fabric.connector import _convert_precision_to_unified_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning warns about the old spellings ('bf16', 16); we only normalise
        return str(_convert_precision_to_unified_args(precision))  # type: ignore[arg-type]


class InstantiateTrainerMixin:
    """Put before Lightning's ``LightningCLI`` in a subclass's bases: the keyword arguments of the
    Trainer it builds pass through :meth:`trainer_kwargs` first."""

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[pl.Callback]) -> pl.Trainer:
        cli: Any = super()
        return cli._instantiate_trainer(self.trainer_kwargs(config), callbacks)

    def trainer_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments to build the Trainer with, from those of the config (unchanged here)."""
        return config

    def config_section(self, key: str) -> Any:
        """The value of ``key`` in the config of the subcommand being run (``None`` if absent)."""
        cli: Any = self
        return cli._get(cli.config_init, key, default=None)


# ------------------------------------------------------------------ checkpointing
# (owned by lplugins.callbacks)

_private("trainer", "_checkpoint_connector", "trainer", "its dump_checkpoint; holds the path fit restores")
_private("trainer._checkpoint_connector", "_ckpt_path", "trainer", "trainer.ckpt_path reports what 'latest' became")
_private("lightning.pytorch.callbacks.Callback", "_generate_state_key", "class", "state key that names the dirpath")

#: Marks a ``load_checkpoint`` that :func:`wrap_strategy_load` put on a strategy instance.
_WRAPPED_LOAD = "_lplugins_resolving"


def checkpoint_dict(trainer: pl.Trainer) -> dict[str, Any]:
    """The checkpoint dict ``trainer.save_checkpoint`` would write (every rank calls it; it may gather)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def set_ckpt_path(trainer: pl.Trainer, path: str | None) -> None:
    """Make ``trainer.ckpt_path`` report the checkpoint ``"latest"`` resolved to (None: a fresh start)."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is not None and hasattr(connector, "_ckpt_path"):
        connector._ckpt_path = path


def callback_state_key(callback: pl.Callback, **kwargs: Any) -> str:
    """The state key Lightning's own checkpoint callbacks use: the class name and ``kwargs``."""
    return callback._generate_state_key(**kwargs)


def wrap_strategy_load(strategy: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``strategy.load_checkpoint`` on the instance by ``wrap(original)``; ``False`` if it was replaced already.

    For strategies that load their checkpoints themselves (DeepSpeed, FSDP2), bypassing ``CheckpointIO``.
    ``wrap`` receives the strategy's load made weights-only (:func:`load_weights_only`): it takes
    ``(checkpoint_path, weights_only=None)`` and honours ``weights_only=False``.
    """
    if "load_checkpoint" in vars(strategy):
        return False
    original = strategy.load_checkpoint

    def weights_only_load(checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        from lplugins._lightning.loading import load_weights_only

        return load_weights_only(strategy, original, checkpoint_path, weights_only)

    wrapped = wrap(weights_only_load)
    setattr(wrapped, _WRAPPED_LOAD, True)
    strategy.load_checkpoint = wrapped
    return True


def unwrap_strategy_load(strategy: Any) -> None:
    """Undo :func:`wrap_strategy_load` (a ``load_checkpoint`` set on the instance by anyone else stays)."""
    if getattr(vars(strategy).get("load_checkpoint"), _WRAPPED_LOAD, False):
        del strategy.load_checkpoint


_private("trainer._checkpoint_connector", "_select_ckpt_path", "trainer", "ckpt_path='last'/'latest' read before fit")
_private(
    "lightning.pytorch.trainer.connectors.callback_connector",
    "_validate_callbacks_list",
    "class",
    "reads each stateful callback's state_key inside Trainer(): where DurableCheckpoint meets its Trainer",
)


class _SelectCkptPath:
    """Lightning's ``_select_ckpt_path`` of one connector, with ``ckpt_path`` passed through ``translate`` first.

    A picklable object (``ddp_spawn`` pickles the Trainer); ``translate`` must be picklable too.
    """

    def __init__(self, trainer: pl.Trainer, translate: Callable[[pl.Trainer, Any, Any], Any]) -> None:
        self.trainer = trainer
        self.translate = translate

    def __call__(self, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        connector = self.trainer._checkpoint_connector
        ckpt_path = self.translate(self.trainer, state_fn, ckpt_path)
        return type(connector)._select_ckpt_path(connector, state_fn, ckpt_path, *args, **kwargs)


def translate_ckpt_path(trainer: pl.Trainer, translate: Callable[[pl.Trainer, Any, Any], Any]) -> bool:
    """Pass the ``ckpt_path`` of this trainer's ``fit``/``validate``/... through ``translate(trainer, fn, path)``.

    Lightning turns ``"last"``/``"best"`` into paths in ``_select_ckpt_path`` before any callback hook
    runs. The wrapper is set on this trainer's connector instance only; ``False`` if one is there already.
    """
    connector = trainer._checkpoint_connector
    if isinstance(vars(connector).get("_select_ckpt_path"), _SelectCkptPath):
        return False
    setattr(connector, "_select_ckpt_path", _SelectCkptPath(trainer, translate))  # noqa: B010 (over the method)
    return True


def trainer_being_built(depth: int = 16) -> pl.Trainer | None:
    """The ``Trainer`` whose ``__init__`` is running further up the call stack, or ``None``.

    Lightning gives a callback no hook between ``Trainer(callbacks=[...])`` and ``fit`` parsing its
    ``ckpt_path``; but ``Trainer()`` reads every stateful callback's ``state_key``
    (``_validate_callbacks_list``), so a callback can meet its Trainer there.
    """
    import sys

    from lightning.pytorch import Trainer

    frame = sys._getframe(1)
    for _ in range(depth):
        if frame.f_code.co_name == "__init__":
            obj = frame.f_locals.get("self")
            if isinstance(obj, Trainer):
                return obj if hasattr(obj, "_checkpoint_connector") else None
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


#: The logger Lightning's ``rank_zero_info`` writes to.
_LIGHTNING_INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"


#: Lightning's tip printed by every ``Trainer()`` (2.6.x); the demo keeps it off its output.
LITLOGGER_TIP = (
    "💡 Tip: For seamless cloud logging and experiment tracking,"
    " try installing [litlogger](https://pypi.org/project/litlogger/) to enable LitLogger,"
    " which logs metrics and artifacts automatically to the Lightning Experiments platform."
)


#: The start of Lightning's warning after a mid-epoch restore (2.6.x), wrong when lplugins restored the position.
NOT_RESUMABLE_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


def hide_lightning_warning(message_start: str) -> Callable[[], None]:
    """Keep Lightning from warning a message that starts with ``message_start``; returns the undo.

    A ``warnings`` filter, removed again by the undo (so it never hides the same warning in a later fit
    where it applies).
    """
    import re
    import warnings

    warnings.filterwarnings("ignore", message=re.escape(message_start))
    entry = warnings.filters[0]

    def undo() -> None:
        with contextlib.suppress(ValueError):
            warnings.filters.remove(entry)  # type: ignore[attr-defined]  # a list at runtime
            mutated = getattr(warnings, "_filters_mutated", None)  # CPython: drop the per-module caches
            if mutated is not None:
                mutated()

    return undo


def hide_lightning_info(message: str) -> Callable[[], None]:
    """Keep Lightning from logging exactly ``message`` (a filter on its logger); returns the undo."""
    import logging

    def drop(record: logging.LogRecord) -> bool:
        return record.getMessage() != message

    # Lightning's rank_zero_info logs through lightning_utilities' module-level ``log``, which each Lightning
    # package re-points at its own logger when imported: after `import pytorch_lightning`, lightning.pytorch's
    # messages go to pytorch_lightning's logger. Filter every one of them (names split so that the
    # pytorch_lightning twin of this module, made by rewriting the package names, keeps all four).
    import lightning_utilities.core.rank_zero as rank_zero_module

    names = {
        _LIGHTNING_INFO_LOGGER,
        "lightning" + ".pytorch.utilities.rank_zero",
        "lightning" + ".fabric.utilities.rank_zero",
        "pytorch_lightning.utilities.rank_zero",
        "lightning_fabric.utilities.rank_zero",
        rank_zero_module.log.name,
    }
    loggers = [logging.getLogger(name) for name in sorted(names)]
    for logger in loggers:
        logger.addFilter(drop)

    def undo() -> None:
        for logger in loggers:
            logger.removeFilter(drop)

    return undo


# ------------------------------------------------------------------ data position
# (owned by lplugins.callbacks._position: exact resume mid-epoch)
#
# No private name: the training DataLoaders are reached through the strategy's public
# ``process_dataloader``, which Lightning calls on each one (after injecting its DistributedSampler)
# before it creates the first iterator, and the trained-batch count through the public
# ``trainer.fit_loop.epoch_loop.batch_progress``. Overriding a method on one instance is what this
# module is for.

#: Marks a ``process_dataloader`` that :func:`wrap_process_dataloader` put on a strategy instance.
_WRAPPED_PROCESS = "_lplugins_positioning"


def wrap_process_dataloader(strategy: Any, wrap: Callable[[Any], Any]) -> Callable[[], None]:
    """Pass every dataloader ``strategy.process_dataloader`` returns through ``wrap``; returns the undo.

    Lightning calls it for each train, val and test dataloader it prepares, right before iterating it.
    """
    original = strategy.process_dataloader

    def process_dataloader(dataloader: Any) -> Any:
        return wrap(original(dataloader))

    setattr(process_dataloader, _WRAPPED_PROCESS, True)
    previous = vars(strategy).get("process_dataloader")
    strategy.process_dataloader = process_dataloader

    def undo() -> None:
        if vars(strategy).get("process_dataloader") is process_dataloader:
            if previous is None:
                del strategy.process_dataloader
            else:
                strategy.process_dataloader = previous

    return undo


def batches_trained_in_epoch(trainer: pl.Trainer) -> int:
    """How many batches of the current epoch the fit loop has taken (what it restores mid-epoch)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def batches_resumed_in_epoch(trainer: pl.Trainer) -> tuple[int, int]:
    """After a restore, before the epoch loop resumes: the batches of the current epoch, and of the whole run,
    that were trained, counted as Lightning counts them when it resumes (``_TrainingEpochLoop.reset``).

    A save in ``on_train_batch_end`` has the batch processed but not yet completed (it counts); a save taken
    while a batch was being trained (``OnExceptionCheckpoint``, a save in ``on_train_batch_start``) has it
    started but not processed (it does not: Lightning trains it again).
    """
    progress: Any = trainer.fit_loop.epoch_loop.batch_progress
    total = progress.total
    at_batch_end = total.started == total.ready and total.processed == total.started == total.completed + 1
    extra = 1 if at_batch_end else 0
    return int(progress.current.completed) + extra, int(total.completed) + extra


def shift_epochs(trainer: pl.Trainer, delta: int) -> None:
    """Move the fit loop's epoch count (``trainer.current_epoch``) by ``delta``, before the fit loop advances.

    After a resume from a save that Lightning took when ``max_steps`` stopped a run mid-epoch: Lightning counted
    that epoch as finished in the checkpoint, so the rest of it would be numbered one higher than in the run
    that never stopped. The public ``epoch_progress`` counters, current and total.
    """
    progress: Any = trainer.fit_loop.epoch_progress
    for tracker in (progress.current, progress.total):
        tracker.ready += delta
        tracker.started += delta
        tracker.processed += delta
        tracker.completed += delta


def shift_batches_trained_in_epoch(trainer: pl.Trainer, delta: int) -> None:
    """Move the fit loop's count of the epoch in progress by ``delta`` batches (a resume on another world size).

    The public ``batch_progress`` counters of the current epoch, before the epoch loop resumes from them;
    the totals (all epochs, which Lightning reads to tell where the save was taken) are left alone.
    """
    current: Any = trainer.fit_loop.epoch_loop.batch_progress.current  # a _ProcessedTracker
    current.ready += delta
    current.started += delta
    current.processed += delta
    current.completed += delta
