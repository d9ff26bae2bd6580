"""Private Lightning accesses of lplugins' strategies: DeepSpeed on CPU (engine set-up, the process group,
"auto" batch sizes), the process-group timeout and backend, a LightningModule's trainer, elastic
process groups."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lplugins._lightning.registry import _private

if TYPE_CHECKING:
    import lightning.pytorch as pl


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
