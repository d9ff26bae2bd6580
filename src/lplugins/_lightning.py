"""Every access lplugins makes to Lightning's (and DeepSpeed's) private internals, in one place.

Lightning's public API does not offer everything lplugins needs (reordering callbacks the way
``Trainer()`` does, reading the path ``fit`` will restore from, deciding accumulation windows from
outside the loop...). Each such access lives in this module and nowhere else, as a small function
with a name that says what it does, and each private name it touches is declared in
:data:`PRIVATES` with the Lightning versions it was checked against.

``tests/test_lightning_internals.py`` resolves every entry of :data:`PRIVATES` against the
installed Lightning and fails, naming the attribute, when a release renames or removes one; a
second test greps the rest of ``src/lplugins`` for private Lightning names. CI runs those tests on
the oldest and the newest supported Lightning.

To add an access: write a function here, declare what it touches with :func:`_private`, and call
the function from the module that needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["CHECKED_VERSIONS", "PRIVATES", "Private"]

#: The Lightning versions every entry of :data:`PRIVATES` was checked against (CI: oldest and newest).
CHECKED_VERSIONS = "2.6.0 - 2.6.6"


@dataclass(frozen=True)
class Private:
    """One private name lplugins relies on.

    Attributes:
        where: Where the name lives. For ``kind="class"``: the dotted import path of a class or
            module (``"lightning.pytorch.trainer.connectors.callback_connector._CallbackConnector"``);
            the name must be an attribute of it. For ``kind="trainer"``: a path from a freshly built
            ``Trainer`` (``"trainer.fit_loop.epoch_loop"``); the name must be an attribute of the
            object it leads to. For ``kind="init"``: the dotted path of a class whose ``__init__``
            sets the attribute (``deepspeed.runtime.engine.DeepSpeedEngine``); checked in its source.
        name: The private attribute, method or module-level name.
        kind: How the test checks it (see ``where``).
        why: What lplugins uses it for, in a few words.
    """

    where: str
    name: str
    kind: Literal["class", "trainer", "init"] = "class"
    why: str = ""


#: Every private name used below; the internals test checks each against the installed versions.
PRIVATES: list[Private] = []


def _private(where: str, name: str, kind: Literal["class", "trainer", "init"] = "class", why: str = "") -> Private:
    entry = Private(where, name, kind, why)
    PRIVATES.append(entry)
    return entry


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
    """
    if "load_checkpoint" in vars(strategy):
        return False
    wrapped = wrap(strategy.load_checkpoint)
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


def hide_lightning_info(message: str) -> Callable[[], None]:
    """Keep Lightning from logging exactly ``message`` (a filter on its logger); returns the undo."""
    import logging

    def drop(record: logging.LogRecord) -> bool:
        return record.getMessage() != message

    logger = logging.getLogger(_LIGHTNING_INFO_LOGGER)
    logger.addFilter(drop)
    return lambda: logger.removeFilter(drop)


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


# ------------------------------------------------------------------ strategies, precision, rank zero
# (owned by lplugins.strategies, lplugins.precision, lplugins.rankzero)

_DEEPSPEED = "lightning.pytorch.strategies.deepspeed.DeepSpeedStrategy"
_private(_DEEPSPEED, "_setup_model_and_optimizer", "class", "overridden: deepspeed.initialize with a CPU device rank")
_private(_DEEPSPEED, "_initialize_deepspeed_inference", "class", "overridden: the same for validate/test/predict")
_private(_DEEPSPEED, "_format_batch_size_and_grad_accum_config", "class", "overridden: fill 'auto' from the Trainer")
_private(_DEEPSPEED, "_init_deepspeed_distributed", "class", "the process group, on CPU (gloo) too")
_private(_DEEPSPEED, "_auto_select_batch_size", "class", "the train dataloader's batch size, for 'auto'")
_private(_DEEPSPEED, "_timeout", "init", "the process-group timeout, in repr")
_private("lightning.pytorch.core.module.LightningModule", "_trainer", "init", "the Trainer, None when not attached")
_private(
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy",
    "_data_parallel_size",
    "init",
    "FSDP2 shards over every rank, not over nodes",
)


class DeepSpeedHooksMixin:
    """Put before Lightning's ``DeepSpeedStrategy`` in a subclass's bases: its private steps call
    :meth:`initialize_engine`, :meth:`initialize_inference_engine` and :meth:`fill_config`, which the
    subclass implements."""

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        return self.initialize_engine(model, optimizer, lr_scheduler)

    def _initialize_deepspeed_inference(self, model: Any) -> None:
        self.initialize_inference_engine(model)

    def _format_batch_size_and_grad_accum_config(self) -> None:
        self.fill_config()

    def initialize_engine(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        """``deepspeed.initialize`` for training; return ``(engine, optimizer)``."""
        raise NotImplementedError

    def initialize_inference_engine(self, model: Any) -> None:
        """``deepspeed.initialize`` for validate/test/predict; set ``self.model`` to the engine."""
        raise NotImplementedError

    def fill_config(self) -> None:
        """Complete ``self.config`` (batch size, accumulation...) from the Trainer, at setup."""
        raise NotImplementedError


def init_deepspeed_distributed(strategy: Any) -> None:
    """Initialise the process group the way Lightning's ``DeepSpeedStrategy`` does (gloo on a CPU root device)."""
    strategy._init_deepspeed_distributed()


def deepspeed_auto_batch_size(strategy: Any) -> int:
    """The micro-batch size Lightning's ``DeepSpeedStrategy`` reads from the train dataloader (1 if unknown)."""
    return int(strategy._auto_select_batch_size())


def strategy_timeout(strategy: Any) -> Any:
    """The process-group timeout a Lightning strategy was built with (a ``timedelta`` or ``None``)."""
    return strategy._timeout


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or ``None`` (``module.trainer`` raises then)."""
    return module._trainer


def shard_over_all_ranks(strategy: Any) -> None:
    """Make a ``ModelParallelStrategy`` built with ``data_parallel_size="auto"`` shard over every rank."""
    if strategy._data_parallel_size == "auto":
        strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes
