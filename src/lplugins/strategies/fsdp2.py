"""FSDP2 (``fully_shard``) that shards a model by itself and runs on CPU (gloo) as well as CUDA.

Lightning's ``FSDPStrategy`` is FSDP1, which refuses a CPU accelerator ("requires a GPU accelerator";
torch's FSDP1 itself says "FSDP needs a non-CPU accelerator device"). torch's FSDP2, ``fully_shard``
over a device mesh, runs over gloo on CPU. Lightning reaches it through ``ModelParallelStrategy``,
which makes every LightningModule write a ``configure_model`` that calls ``fully_shard``. This
strategy is that ``ModelParallelStrategy`` with pure data-parallel sharding (no tensor parallelism)
that shards the model itself when the module has no ``configure_model``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lplugins import _lightning
from lplugins._errors import LPluginsError
from lplugins.strategies import _elastic
from lplugins.strategies.timeout import resolve_timeout

__all__ = ["FSDP2Strategy"]


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallelism with torch's FSDP2, on CPU (gloo) or CUDA (NCCL).

    Parameters, gradients and optimizer state are sharded over all ranks (``data_parallel_size`` is
    the world size; no tensor parallelism). A LightningModule that overrides ``configure_model`` shards
    itself, as with Lightning's ``ModelParallelStrategy`` (``self.device_mesh["data_parallel"]``);
    otherwise the strategy applies ``fully_shard`` to each unit (see ``shard``) and then to the
    whole module, before the optimizers are created.

    Args:
        shard: Module classes that get their own ``fully_shard`` unit (e.g. your transformer block).
            Default: every child of an ``nn.ModuleList`` or ``nn.Sequential`` that has parameters
            (the usual stack of layers). Submodules outside those units that hold parameters
            themselves become units too; parameters of the LightningModule itself are gathered
            around its ``*_step`` methods.
        reshard_after_forward: Free the gathered parameters after each unit's forward (less memory,
            one more all-gather in backward).
        save_distributed_checkpoint: ``False`` (default): one full checkpoint file, written by rank 0
            (loadable anywhere, also without this strategy). ``True``: a directory with each rank's
            shards (torch distributed checkpoint), faster for large models.
        timeout: Process-group timeout in seconds or a ``timedelta``; default ``LPLUGINS_PG_TIMEOUT``,
            then 30 minutes.
        **kwargs: Passed to Lightning's ``ModelParallelStrategy`` (e.g. ``process_group_backend``).

    Resuming reads the checkpoint weights-only, the ``.metadata`` of a sharded one included (torch reads it
    with plain ``pickle``; here a restricted unpickler allows only its metadata classes): a checkpoint with
    any other type raises ``lplugins.callbacks.UnsafeCheckpointError`` naming the file and the type.
    ``trainer.fit(..., weights_only=False)`` loads a checkpoint you trust in full (one warning on rank zero).

    Raises:
        LPluginsError: ``shard`` is not a sequence of ``nn.Module`` subclasses, or the timeout is invalid.

    Examples:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy())  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        shard: Sequence[type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = False,
        timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        if shard is not None and (
            isinstance(shard, (str, bytes))
            or not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in shard)
        ):
            raise LPluginsError(f"FSDP2Strategy(shard=...) takes nn.Module subclasses, got {shard!r}")
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            timeout=resolve_timeout(timeout),
            **kwargs,
        )
        self.shard = tuple(shard) if shard is not None else None
        self.reshard_after_forward = reshard_after_forward
        #: A full-state checkpoint is the gathered state saved as one file by rank 0, exactly as a plain
        #: ``torch.save`` there (``DurableCheckpoint`` may then write it itself, in the background).
        self.writes_one_file_on_rank_zero = not save_distributed_checkpoint
        #: A sharded checkpoint is Lightning's DCP directory (each rank's shards, ``meta.pt`` beside them):
        #: ``DurableCheckpoint(async_save=True)`` may have every rank write its own shards in the background.
        self.saves_dcp_shards = save_distributed_checkpoint

    def setup_environment(self) -> None:
        _lightning.shard_over_all_ranks(self)  # Lightning's "auto" shards over nodes only
        _elastic.init_process_group(self)  # under torchrun: store keys of this attempt's own
        super().setup_environment()

    def setup(self, trainer: Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        if is_overridden("configure_model", module):
            super().setup(trainer)
            return
        from torch.distributed.fsdp import FSDPModule

        if isinstance(module, FSDPModule):  # sharded by an earlier fit/validate (fully_shard applies once)
            units = getattr(self, "sharded_units", 0)
        else:
            units = shard_model(module, self.device_mesh["data_parallel"], self.shard, self.reshard_after_forward)
        # Lightning's ModelParallelStrategy insists on a configure_model; the sharding is done (above)
        module.configure_model = _sharded_by_strategy  # type: ignore[method-assign]
        try:
            super().setup(trainer)
        finally:
            del module.configure_model
        self.sharded_units = units

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load, weights-only unless ``weights_only=False``; a sharded checkpoint's ``.metadata`` too.

        Raises:
            UnsafeCheckpointError: the checkpoint holds a type outside the allow-list (file and type named).
        """
        stateless = _stateless_optimizers(checkpoint_path, len(self.optimizers))
        optimizers = self.optimizers
        if stateless:  # Lightning and torch cannot load an empty full optimizer state: the groups are set below
            self.optimizers = []
        try:
            checkpoint: dict[str, Any] = _lightning.load_weights_only(
                self, super().load_checkpoint, checkpoint_path, weights_only
            )
        finally:
            self.optimizers = optimizers
        saved_states = checkpoint.get("optimizer_states", []) if stateless else []
        for optimizer, saved in zip(optimizers, saved_states, strict=False):
            for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
                group.update({key: value for key, value in saved_group.items() if key != "params"})
        return checkpoint


def _stateless_optimizers(path: Any, count: int) -> bool:
    """Whether ``path`` is a full checkpoint file whose ``count`` optimizer states hold no per-parameter state
    (plain SGD): ``set_optimizer_state_dict`` needs a tensor to broadcast from rank 0, and Lightning's re-keying
    indexes the first entry, so such a state would fail to load (only its hyperparameters are restored then).
    Read memory-mapped: no tensor data is read here."""
    if not count or not os.path.isfile(path):
        return False
    try:
        states = torch.load(path, mmap=True, map_location="cpu", weights_only=True).get("optimizer_states", [])
    except Exception:  # unreadable or unsafe: the strategy's own load says why
        return False
    return len(states) == count and all(not state.get("state") for state in states)


def _sharded_by_strategy() -> None:
    """The module was sharded by ``FSDP2Strategy``."""


def shard_model(
    module: nn.Module,
    mesh: Any,
    unit_types: tuple[type[nn.Module], ...] | None = None,
    reshard_after_forward: bool = True,
) -> int:
    """Apply ``fully_shard`` to each unit of ``module``, then to ``module``; return the number of units.

    Args:
        module: The model (a LightningModule, or any ``nn.Module``).
        mesh: The 1-D device mesh to shard over.
        unit_types: Module classes that become units; ``None``: the parameterised children of every
            ``nn.ModuleList`` / ``nn.Sequential``. Either way, every other submodule that holds
            parameters itself becomes a unit as well.
        reshard_after_forward: Passed to ``fully_shard``.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    units: list[nn.Module] = []
    if unit_types is not None:
        units = [m for m in module.modules() if m is not module and isinstance(m, unit_types)]
    else:
        for container in module.modules():
            if isinstance(container, (nn.ModuleList, nn.Sequential)):
                units.extend(child for child in container if any(True for _ in child.parameters()))
    # every other submodule that holds parameters of its own is a unit too: its parameters are then
    # gathered by its own forward, whatever method of the root calls it
    units.extend(m for m in module.modules() if m is not module and len(m._parameters) > 0)
    covered: set[int] = set()  # modules inside a unit already sharded (units come outermost first)
    count = 0
    for unit in units:
        if id(unit) in covered:
            continue
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
        covered.update(id(m) for m in unit.modules())
        count += 1
    # the root keeps its own parameters gathered from forward to backward (they are needed again at
    # once, and a *_step that calls self(...) must still see them afterwards)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)
    if isinstance(module, LightningModule):
        # Lightning calls the *_step methods, not forward: parameters the root holds itself are gathered there
        for method in ("training_step", "validation_step", "test_step", "predict_step"):
            register_fsdp_forward_method(module, method)
    return count
