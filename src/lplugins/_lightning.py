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

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    ``wrap`` receives the strategy's load made weights-only (:func:`load_weights_only`): it takes
    ``(checkpoint_path, weights_only=None)`` and honours ``weights_only=False``.
    """
    if "load_checkpoint" in vars(strategy):
        return False
    original = strategy.load_checkpoint

    def weights_only_load(checkpoint_path: Any, weights_only: bool | None = None) -> Any:
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


# ------------------------------------------------------------------ elastic process groups
# (owned by lplugins.strategies._elastic: the default group through a per-attempt store under torchrun)

_private("lightning.fabric.utilities.distributed", "_init_dist_connection", "class", "init the group with a store")
_private("lightning.pytorch.strategies.DDPStrategy", "_get_process_group_backend", "class", "the backend to init")
_private("lightning.pytorch.strategies.ModelParallelStrategy", "_get_process_group_backend", "class", "the same")


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Lightning's process-group initialisation (its log lines, ``MASTER_*``, NCCL's exit hook), with
    ``kwargs`` (e.g. ``store=``) passed on to ``torch.distributed.init_process_group``."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(cluster_environment, backend, **kwargs)


def process_group_backend(strategy: Any) -> str:
    """The backend a DDP / ModelParallel / DeepSpeed strategy initialises its process group with."""
    return str(strategy._get_process_group_backend())


# ------------------------------------------------------------------ strategy loads, weights-only
# (owned by lplugins.strategies; DurableCheckpoint's resolver reaches it through wrap_strategy_load)

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_private(_DCP_METADATA, "_MEM_FORMAT_ENCODING", "class", "an enum a DCP .metadata file holds: allow-listed")
_private("torch.distributed.checkpoint.filesystem", "_StorageInfo", "class", "DCP .metadata: allow-listed")
_private("torch.serialization", "_get_layout", "class", "how torch pickles a layout (DCP .metadata): allow-listed")
_private("lightning.fabric.utilities.load", "_METADATA_FILENAME", "class", "meta.pt: a sharded checkpoint's rest")

#: The DeepSpeed types a ZeRO-2/ZeRO-3 checkpoint holds (found by saving them on CPU), allowed in its
#: weights-only loads; ``docs/strategies.md`` says why each is safe.
DEEPSPEED_SAFE_TYPES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

#: What the ``.metadata`` pickle of a torch distributed checkpoint may hold (plus torch's dtypes), read
#: with a restricted unpickler instead of torch's plain ``pickle.load``.
DCP_METADATA_TYPES = (
    *(
        f"{_DCP_METADATA}.{name}"
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size",
    "torch.serialization._get_layout",
    "pathlib.Path",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
    "collections.OrderedDict",
    "builtins.set",
    "builtins.frozenset",
)

_private(
    "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector",
    "_restore_modules_and_callbacks",
    "class",
    "called without fit's weights_only for strategies that restore after setup: read from Trainer._run's frame",
)

#: Set on a strategy while :func:`load_weights_only` runs its load (an inner call passes through).
_LOADING = "_lplugins_weights_only_load"


def running_weights_only(depth: int = 32) -> bool | None:
    """The ``weights_only`` given to the running ``trainer.fit`` (``validate``, ...), or ``None``.

    Lightning 2.6 drops it for strategies that restore after setup (DeepSpeed, FSDP, ModelParallel):
    ``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it, so their
    ``load_checkpoint`` always gets ``None``. It is read from ``Trainer._run``'s frame up the stack.
    """
    import sys

    from lightning.pytorch import Trainer

    frame = sys._getframe(1)
    for _ in range(depth):
        if frame.f_code.co_name == "_run" and isinstance(frame.f_locals.get("self"), Trainer):
            value = frame.f_locals.get("weights_only")
            return value if isinstance(value, bool) else None
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


def load_weights_only(strategy: Any, load: Callable[..., Any], checkpoint_path: Any, weights_only: bool | None) -> Any:
    """Run ``load`` (a strategy's own ``load_checkpoint``) with every file it reads read weights-only.

    * DeepSpeed: every ``*.pt`` file of the checkpoint's tag directory is first read weights-only
      (memory-mapped, with :data:`DEEPSPEED_SAFE_TYPES` allowed) on every rank, so that all ranks refuse
      the same checkpoint before any state is touched; then DeepSpeed's checkpoint engine reads each
      file weights-only too.
    * ``ModelParallelStrategy`` (FSDP2): a full checkpoint file is read weights-only; a sharded
      directory (torch distributed checkpoint) is loaded here, with its ``.metadata`` read by a
      restricted unpickler (:data:`DCP_METADATA_TYPES`) and its non-tensor items weights-only.
    * Any other strategy: ``load`` with ``weights_only=True``.

    ``weights_only=None`` means the value given to the running ``trainer.fit`` (see
    :func:`running_weights_only`), and ``True`` if none was. ``weights_only=False`` runs ``load`` with full
    unpickling, for a file the user trusts, after one warning on rank zero naming it.

    Raises:
        UnsafeCheckpointError: a file holds a type outside the allow-list (the message names both);
            nothing in it was executed, and the strategy can load another checkpoint next.
    """
    if getattr(strategy, _LOADING, False):  # an lplugins strategy's own guard inside the resolver's
        return load(checkpoint_path, weights_only=weights_only)
    if weights_only is None:
        weights_only = running_weights_only()
    setattr(strategy, _LOADING, True)
    try:
        if weights_only is False:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                f"lplugins: loading {os.fspath(checkpoint_path)!r} with weights_only=False, as asked: every object"
                " pickled in it is unpickled in full, which can run code. Do this only for a checkpoint you trust."
            )
            return load(checkpoint_path, weights_only=False)
        from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

        if isinstance(strategy, DeepSpeedStrategy):
            return _deepspeed_load(strategy, load, checkpoint_path)
        if isinstance(strategy, ModelParallelStrategy):
            return _model_parallel_load(strategy, load, checkpoint_path)
        with _refusing(checkpoint_path):
            return load(checkpoint_path, weights_only=True)
    finally:
        delattr(strategy, _LOADING)


def _deepspeed_load(strategy: Any, load: Callable[..., Any], checkpoint_path: Any) -> Any:
    if strategy.load_full_weights and strategy.zero_stage_3:  # one file, read through the CheckpointIO
        with _safe_globals(DEEPSPEED_SAFE_TYPES), _refusing(checkpoint_path):
            return load(checkpoint_path, weights_only=True)
    for file in _deepspeed_files(os.fspath(checkpoint_path)):
        weights_only_file(file, DEEPSPEED_SAFE_TYPES, mmap=True)
    engine = getattr(strategy.deepspeed_engine, "checkpoint_engine", None)
    if engine is None:
        return load(checkpoint_path, weights_only=True)

    def engine_load(path: str, map_location: Any = None) -> Any:
        return weights_only_file(path, DEEPSPEED_SAFE_TYPES, map_location=map_location)

    previous = vars(engine).get("load")
    engine.load = engine_load  # on the instance: every engine (torch, fast, decoupled) saves with torch.save
    try:
        return load(checkpoint_path, weights_only=True)
    finally:
        if previous is None:
            del engine.load
        else:
            engine.load = previous


def _deepspeed_files(path: str) -> list[str]:
    """The files DeepSpeed reads to resume from ``path``: the ``*.pt`` files of its tag directory."""
    import glob

    if not os.path.isdir(path):
        return []  # Lightning refuses it with its own message
    latest = os.path.join(path, "latest")
    tag_dir = path
    if os.path.isfile(latest):
        with open(latest) as f:
            candidate = os.path.join(path, f.read().strip())
        if os.path.isdir(candidate):
            tag_dir = candidate
    return sorted(glob.glob(os.path.join(glob.escape(tag_dir), "**", "*.pt"), recursive=True))


def _model_parallel_load(strategy: Any, load: Callable[..., Any], checkpoint_path: Any) -> Any:
    from pathlib import Path

    path = Path(strategy.broadcast(checkpoint_path))  # Lightning loads rank 0's path
    if not path.is_dir():
        with _refusing(path):
            return load(path, weights_only=True)
    return _load_sharded(strategy, path)


def _load_sharded(strategy: Any, path: Any) -> dict[str, Any]:
    """Lightning's ``ModelParallelStrategy`` load of a sharded directory, with nothing unpickled in full."""
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.utilities.load import _METADATA_FILENAME
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    # the two pickles first, so that a refused checkpoint changes nothing
    checkpoint: dict[str, Any] = weights_only_file(path / _METADATA_FILENAME, ())
    metadata = _restricted_unpickle(path / ".metadata", DCP_METADATA_TYPES)
    reader_cls, planner_cls = _dcp_weights_only_classes()
    module = strategy.model
    module_state = {"state_dict": get_model_state_dict(module)}
    _dcp_load(dcp, module_state, reader_cls(path, metadata), planner_cls(path))
    module.load_state_dict(module_state["state_dict"], strict=strategy.lightning_module.strict_loading)
    for idx, optimizer in enumerate(strategy.optimizers):
        key = f"optimizer_{idx}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        _dcp_load(dcp, optimizer_state, reader_cls(path, metadata), planner_cls(path))
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key], options=options)
    return checkpoint


def _dcp_load(dcp: Any, state: dict[str, Any], reader: Any, planner: Any) -> None:
    """``torch.distributed.checkpoint.load``; a refusal on any rank is raised as itself on every rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    from lplugins._errors import UnsafeCheckpointError

    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointException as err:
        for failure, _ in err.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise UnsafeCheckpointError(str(failure)) from err
        raise


def _dcp_weights_only_classes() -> tuple[Any, Any]:
    """torch's ``FileSystemReader`` given metadata read safely, and a load planner that reads items weights-only."""
    import io

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def __init__(self, path: Any, metadata: Any) -> None:
            super().__init__(path)
            self.checked_metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise FileNotFoundError("lplugins reads the checkpoint's global .metadata only")
            metadata = self.checked_metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def __init__(self, path: Any) -> None:
            super().__init__()
            self.path = path

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            import torch

            with _refusing(f"{os.fspath(self.path)} (item {read_item.dest_index.fqn})"):
                torch.load(value, weights_only=True)
            # accepted weights-only: the default planner's full unpickling of the same bytes (in memory) builds
            # the same plain objects, through the same allowed globals only
            value.seek(0)
            super().load_bytes(read_item, value)

    return Reader, Planner


def weights_only_file(path: Any, allowed: tuple[str, ...], map_location: Any = None, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with the types named in ``allowed`` (``"module.Name"``) allowed.

    Raises:
        UnsafeCheckpointError: the file holds another type (named, with the file).
    """
    import torch

    with _safe_globals(allowed), _refusing(path):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError as err:
            if not mmap or "mmap" not in str(err):
                raise
            return torch.load(path, map_location=map_location, weights_only=True)  # a legacy (not zip) file


@contextmanager
def _safe_globals(names: tuple[str, ...]) -> Iterator[None]:
    """torch's ``safe_globals`` for types named ``"module.Name"`` (a module that is not installed is skipped)."""
    import torch

    with torch.serialization.safe_globals([obj for obj in map(_resolve_global, names) if obj is not None]):
        yield


def _resolve_global(name: str) -> Any:
    import importlib

    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


@contextmanager
def _refusing(path: Any) -> Iterator[None]:
    """Turn a weights-only refusal while reading ``path`` into :class:`~lplugins._errors.UnsafeCheckpointError`."""
    import pickle

    try:
        yield
    except pickle.UnpicklingError as err:
        raise unsafe_checkpoint_error(path, err) from err


def unsafe_checkpoint_error(path: Any, err: BaseException) -> Exception:
    """The :class:`~lplugins._errors.UnsafeCheckpointError` for a refused read of ``path``."""
    import re

    from lplugins._errors import UnsafeCheckpointError

    text = str(err)
    found = re.search(r"disallowed type ([\w.]+)", text) or re.search(r"GLOBAL ([\w.]+)", text)
    named = found.group(1) if found else None
    if named is not None and "." not in named:
        named = f"builtins.{named}"  # torch names a builtin without its module ("GLOBAL exec")
    names = _unsafe_globals(path) or ([named] if named else [])
    if names:
        what = f"the type{'s' if len(names) > 1 else ''} {', '.join(names)}, which a weights-only load does not allow"
    else:
        lines = [line for line in text.splitlines() if "WeightsUnpickler error" in line] or text.splitlines()[:1]
        what = f"content a weights-only load does not allow ({lines[0].strip() if lines else type(err).__name__})"
    return UnsafeCheckpointError(
        f"Refusing to load checkpoint file {os.fspath(path) if not isinstance(path, str) else path!r}: it holds"
        f" {what}; nothing in it was executed. If you wrote this checkpoint and trust it, load it with"
        " trainer.fit(model, ckpt_path=..., weights_only=False) (see docs/strategies.md)."
    )


def _unsafe_globals(path: Any) -> list[str]:
    """The disallowed globals a torch checkpoint file names, fully qualified (``[]`` if it cannot tell)."""
    import torch

    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path)) if os.path.isfile(path) else []
    except Exception:  # not a zip checkpoint: torch's message is used
        return []


def _restricted_unpickle(path: Any, allowed: tuple[str, ...]) -> Any:
    """Unpickle ``path`` with only ``allowed`` globals (``"module.Name"``) and torch's dtypes."""
    import pickle

    import torch

    names = set(allowed)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            full = f"{module}.{name}"
            if full in names or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                obj = _resolve_global(full)
                if obj is not None:
                    return obj
            raise pickle.UnpicklingError(f"disallowed type {full}")

    with open(path, "rb") as f, _refusing(path):
        return Unpickler(f).load()
