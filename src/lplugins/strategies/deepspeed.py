"""A DeepSpeed strategy that also runs on CPU (gloo), with a validated config and the lplugins timeout.

Lightning's ``DeepSpeedStrategy`` refuses every accelerator but CUDA, yet DeepSpeed runs ZeRO on
its CPU accelerator with the gloo backend. This subclass:

* accepts ``accelerator="cpu"``: it skips the CUDA-only check and the device-index validation,
  selects DeepSpeed's CPU accelerator, initialises the process group with gloo, and passes the
  local rank where Lightning passes ``root_device.index`` (``None`` on CPU) as ``device_rank``;
* behaves as Lightning's strategy on CUDA, except under gradient accumulation, where Lightning's
  makes each optimizer step with ``1/k`` of the gradient and this one does not (see :meth:`backward`);
* validates the DeepSpeed config (dict or JSON path) when it is built, fills ``"auto"`` values
  from the Trainer, and refuses a config that contradicts the Trainer (see
  :mod:`lplugins.strategies._ds_config`);
* takes its process-group timeout from :func:`lplugins.strategies.timeout.resolve_timeout`.

Where Lightning's strategy has no public hook, its private steps are reached through
:class:`lplugins._lightning.DeepSpeedHooksMixin`, which calls :meth:`DeepSpeedStrategy.initialize_engine`,
:meth:`DeepSpeedStrategy.initialize_inference_engine` and :meth:`DeepSpeedStrategy.fill_config`.

Importing this module imports Lightning, not DeepSpeed; DeepSpeed is imported when the strategy is
built.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from os import PathLike
from typing import TYPE_CHECKING, Any

from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lplugins import _lightning
from lplugins._errors import LPluginsError
from lplugins._lightning.converted import FULL_CHECKPOINT, commit_in_background
from lplugins._lightning.portable import (
    DEEPSPEED_DIR,
    FULL_FILE,
    convert_to_universal,
    deepspeed_stage,
    full_from_zero,
    saved_dp_world_size,
)
from lplugins._lightning.zero_shards import LOSS_SCALE_KEY, compact
from lplugins._validate import is_int, positive_int
from lplugins.strategies import _elastic
from lplugins.strategies._ds_config import (
    DeepSpeedConfigError,
    TrainerFacts,
    check_against_trainer,
    fill_auto,
    load_config,
    validate_config,
)
from lplugins.strategies._ds_cpu import check_cpu_precision, use_cpu_accelerator
from lplugins.strategies.timeout import resolve_timeout

if TYPE_CHECKING:
    import deepspeed
    from torch import Tensor
    from torch.nn import Module
    from torch.optim import Optimizer

log = logging.getLogger("lplugins")

__all__ = [
    "DeepSpeedEngineNotReady",
    "DeepSpeedReshardError",
    "DeepSpeedStrategy",
    "convert_to_universal",
    "saved_dp_world_size",
]


class DeepSpeedEngineNotReady(LPluginsError, RuntimeError):
    """The DeepSpeed engine was asked for before ``trainer.fit`` set it up."""


class DeepSpeedStrategy(_lightning.DeepSpeedHooksMixin, _LightningDeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy``, usable with ``accelerator="cpu"`` (gloo) as well as CUDA.

    Every argument of ``lightning.pytorch.strategies.DeepSpeedStrategy`` is accepted. Differences:

    Args:
        config: A DeepSpeed config dict, or the path of a JSON file. It is validated now; ``"auto"``
            values (micro-batch size, accumulation, train batch size, clipping, fp16/bf16
            ``enabled``) are filled from the Trainer at setup. Unlike Lightning,
            ``gradient_accumulation_steps`` may be given (``"auto"``, or equal to the Trainer's).
        timeout: Process-group timeout in seconds or as a ``timedelta``; default
            ``LPLUGINS_PG_TIMEOUT``, then 30 minutes.
        **kwargs: Passed to Lightning's ``DeepSpeedStrategy``.

    Raises:
        DeepSpeedConfigError: the config is invalid (unknown key, bad value, unreadable file).
        LPluginsError: the timeout is not a positive number of seconds.

    The DeepSpeed engine is ``strategy.deepspeed_engine`` once the Trainer has set up; use
    :meth:`set_gradient_accumulation_steps` to change accumulation during training.

    Resuming reads every file of the checkpoint weights-only (torch's allow-list plus the few DeepSpeed
    types a ZeRO checkpoint holds), on every rank, before anything is loaded: a checkpoint with any other
    type raises ``lplugins.callbacks.UnsafeCheckpointError`` naming the file and the type, and nothing in it
    runs. ``trainer.fit(..., weights_only=False)`` loads a checkpoint you trust with DeepSpeed's full
    unpickling (one warning on rank zero). See ``docs/strategies.md``.
    """

    def __init__(
        self,
        *,
        config: Mapping[str, Any] | str | PathLike[str] | None = None,
        timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        loaded: dict[str, Any] | None = None
        if config is not None:
            loaded = load_config(config)
            validate_config(loaded)
        super().__init__(config=loaded, timeout=resolve_timeout(timeout), **kwargs)
        if loaded is None and isinstance(self.config, dict):
            validate_config(self.config)  # also covers a config from the PL_DEEPSPEED_CONFIG_PATH variable
        self.filled_config_notes: list[str] = []

    # ------------------------------------------------------------------ CPU support
    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    @override
    def setup_environment(self) -> None:
        if not self._on_cpu:
            super().setup_environment()  # Lightning's CUDA check applies
            return
        use_cpu_accelerator()
        check_cpu_precision(self.precision_plugin.precision)  # on every rank, before the process group
        DDPStrategy.setup_environment(self)  # skip Lightning's CUDA-only check

    @override
    def setup_distributed(self) -> None:
        # under torchrun: store keys of this attempt's own; deepspeed.init_distributed then finds the group made
        _elastic.init_process_group(self)
        if not self._on_cpu:
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        _lightning.init_deepspeed_distributed(self)  # gloo: DDPStrategy picks it for a CPU root device

    def _device_rank(self) -> int:
        index = self.root_device.index
        return self.local_rank if index is None else int(index)

    @override
    def initialize_engine(
        self,
        model: Module,
        optimizer: Optimizer | None,
        lr_scheduler: Any = None,
    ) -> tuple[deepspeed.DeepSpeedEngine, Optimizer]:
        """``deepspeed.initialize`` for training, with the local rank as device rank on CPU."""
        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    @override
    def initialize_inference_engine(self, model: Module) -> None:
        """``deepspeed.initialize`` for validate/test/predict, with the local rank as device rank on CPU."""
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        assert isinstance(self.config, dict)
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config.get("zero_allow_untested_optimizer", True)
            inference_config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        engine, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
        self.model = engine

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Backward through the engine, dividing the loss for accumulation once, not twice.

        Lightning's ``DeepSpeedStrategy`` sets the engine's ``gradient_accumulation_steps`` to
        ``accumulate_grad_batches=k`` and lets the engine decide when to step (Lightning calls
        ``engine.step()`` after every micro-batch; the engine steps the optimizer on every ``k``-th).
        Lightning's loop still divides each micro-batch's loss by ``k``, and ``engine.backward``
        divides it by ``k`` again, so each micro-batch adds ``1/k**2`` of its gradient instead of
        ``1/k``, and a window of ``k`` micro-batches adds up to ``1/k`` of the mean gradient: an SGD
        step ``k`` times too small (measured: 0.250 of the correct step at ``k=4``, 0.500 at ``k=2``).
        When Lightning has divided, the engine is told not to (``scale_wrt_gas=False``).
        """
        module = self.lightning_module
        if module is not None and module.trainer.accumulate_grad_batches > 1:
            kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ------------------------------------------------------------------ resume
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's DeepSpeed load, with every file read weights-only unless ``weights_only=False``.

        Raises:
            UnsafeCheckpointError: a file of the checkpoint holds a type outside the allow-list (named).
        """
        checkpoint: dict[str, Any] = _lightning.load_weights_only(
            self, self._load_any_world_size, checkpoint_path, weights_only
        )
        return checkpoint

    def _load_any_world_size(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load; any other layout read as one full checkpoint and put into this engine.

        * A ZeRO checkpoint of another data-parallel world size or another stage: every rank reads the shard files
          once, in its own process (:func:`lplugins._lightning.zero_shards.full_from_zero`: each parameter's fp32
          value and optimizer state cut out of the saved partitions, no universal conversion, no rank waiting for
          another), and puts them into this engine's partitions (below); rank zero then keeps the result beside
          the checkpoint (``<checkpoint>.converted/full.ckpt``, committed with its manifest on a background
          thread: the resumes that load a file, DDP, FSDP2 and ``lplugins checkpoint export``, reuse it).
        * One full checkpoint file (single device, DDP, FSDP2's full file, a stock ``ModelCheckpoint`` file, or
          the conversion of an FSDP2 sharded directory): each parameter's fp32 value and optimizer moments go
          into this engine's partitions (:func:`lplugins._lightning.load_full_into_deepspeed`).

        ``validate``/``test``/``predict`` load no optimizer state and go through DeepSpeed's own load, as does a
        ZeRO-3 strategy with ``load_full_weights=True``.

        Raises:
            DeepSpeedReshardError: on every rank, when reading the checkpoint fails (each rank's error in the
                message) or its state does not fit this model and optimizer (before anything is loaded).
        """
        from lightning.pytorch.trainer.states import TrainerFn

        load = super().load_checkpoint
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        if not fitting or (self.load_full_weights and self.zero_stage_3):
            return load(checkpoint_path, weights_only)  # validate/test/predict load no optimizer state: as before
        path = os.fspath(checkpoint_path).rstrip("/")
        if os.path.isfile(path):
            if weights_only is False:  # trusted, as asked (load_weights_only warned, naming it)
                import torch

                return self._load_full(path, torch.load(path, map_location="cpu", weights_only=False), FULL_FILE)
            return self._load_full(path, _lightning.weights_only_file(path, ()), FULL_FILE)
        saved = saved_dp_world_size(path)
        if saved is None:
            return load(checkpoint_path, weights_only)
        stage = deepspeed_stage(path)
        now = (self.config or {}).get("zero_optimization", {}).get("stage") if isinstance(self.config, dict) else None
        crosses = stage is not None and now is not None and stage != now  # ZeRO-1 <-> 2 <-> 3: through a full one
        if saved == self.world_size and not crosses:
            return load(checkpoint_path, weights_only)
        return self._load_full(path, self._read_zero(path, saved), f"{DEEPSPEED_DIR} (ZeRO-{stage}, {saved} rank(s))")

    def _read_zero(self, path: str, saved: int) -> dict[str, Any]:
        """The ZeRO checkpoint ``path`` as one full checkpoint, read on every rank; rank zero keeps it beside it."""
        import time

        start = time.perf_counter()
        error: str | None = None
        try:
            checkpoint = full_from_zero(path)
        except Exception as err:  # said on every rank below
            error, checkpoint = f"{type(err).__name__}: {err}", {}
        if not self.reduce_boolean_decision(error is None, all=True):
            raise DeepSpeedReshardError(
                f"Cannot resume DeepSpeed checkpoint {path} (saved by {saved} data-parallel rank(s)) on"
                f" {self.world_size}: reading its ZeRO partitions failed ({error or 'on another rank'}). Resume it on"
                f" {saved} rank(s) with the ZeRO stage it was written with."
            )
        if self.is_global_zero:
            snapshot = compact(checkpoint, tensors=False)  # Lightning changes its dicts as it restores them
            commit_in_background(path, FULL_CHECKPOINT, lambda tmp: _save(compact(snapshot), tmp))
            rank_zero_info(
                f"lplugins: DeepSpeed checkpoint {path} was saved by {saved} data-parallel rank(s); read as one full"
                f" checkpoint in {time.perf_counter() - start:.2f}s to load on {self.world_size} (kept beside it for"
                f" the next resume in another layout: {os.path.basename(path)}.converted/{FULL_CHECKPOINT})"
            )
        return checkpoint

    def _load_full(self, path: str, checkpoint: dict[str, Any], source: str) -> dict[str, Any]:
        """Put a full checkpoint into the engine; a state that does not fit is refused before anything is set."""
        stage = (self.config or {}).get("zero_optimization", {}).get("stage") if isinstance(self.config, dict) else "?"
        try:
            if self.deepspeed_engine.fp16_enabled() and _lightning.torch_loss_scale(checkpoint):
                raise _lightning.LayoutError(
                    "it holds the loss scale of torch's GradScaler (precision '16-mixed'), which DeepSpeed's fp16 loss"
                    " scaler cannot take: resuming would restart the loss scale (steps skipped, not the run saved)."
                    " Resume it with precision 'bf16-mixed' or '32-true' (the fp32 state moves exactly)"
                )
            rest: dict[str, Any] = _lightning.load_full_into_deepspeed(self, checkpoint)
            _lightning.restore_loss_scale(self.deepspeed_engine, rest.pop(LOSS_SCALE_KEY, None))
        except _lightning.LayoutError as err:
            raise DeepSpeedReshardError(
                f"Cannot resume {path} ({source}) with DeepSpeed ZeRO-{stage} on {self.world_size} rank(s): {err}."
                " Resume it with the strategy that wrote it (DDP, single device and FSDP2 load any optimizer"
                " state whole, on any number of ranks), or start a new run from its weights"
                " (lplugins checkpoint export)."
            ) from None
        rank_zero_info(
            f"lplugins: {path} ({source}) put into DeepSpeed ZeRO-{stage} on {self.world_size} rank(s): each"
            " parameter's fp32 value and optimizer state, partitioned for this run"
        )
        return rest

    # ------------------------------------------------------------------ config
    @override
    def fill_config(self) -> None:
        """Check the config against the Trainer and fill its ``"auto"`` values (at setup)."""
        assert isinstance(self.config, dict)
        module = self.lightning_module
        if module is None:
            return
        trainer = module.trainer
        facts = TrainerFacts(
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            precision=str(self.precision_plugin.precision),
            micro_batch_size=_lightning.deepspeed_auto_batch_size(self),
            world_size=self.world_size,
        )
        self.config, self.filled_config_notes = fill_auto(self.config, facts)
        zero = self.config.get("zero_optimization") or {}
        offloads = any(
            (zero.get(k) or {}).get("device", "none") != "none" for k in ("offload_optimizer", "offload_param")
        )
        if self._on_cpu and offloads and "zero_force_ds_cpu_optimizer" not in self.config:
            # DeepSpeed wants its DeepSpeedCPUAdam with offload, for speed on GPUs; with the CPU accelerator
            # there is no device-to-host traffic to save, so the model's own optimizer is allowed
            self.config["zero_force_ds_cpu_optimizer"] = False
            self.filled_config_notes.append("zero_force_ds_cpu_optimizer = False (offload with accelerator='cpu')")
        for note in self.filled_config_notes:
            rank_zero_info(f"lplugins: DeepSpeed config {note}")

    def check_trainer_kwargs(self, trainer_kwargs: Mapping[str, Any]) -> None:
        """Check the config against Trainer keyword arguments, before the Trainer is built.

        Called by the named lplugins strategies when :func:`lplugins.compose` builds them.

        Raises:
            DeepSpeedConfigError: the config contradicts the Trainer arguments.
        """
        assert isinstance(self.config, dict)
        ga = trainer_kwargs.get("accumulate_grad_batches", 1)
        precision = trainer_kwargs.get("precision")
        if trainer_kwargs.get("accelerator") == "cpu":
            check_cpu_precision(precision)
        check_against_trainer(
            self.config,
            TrainerFacts(
                accumulate_grad_batches=ga if is_int(ga) else None,
                gradient_clip_val=trainer_kwargs.get("gradient_clip_val"),
                gradient_clip_algorithm=trainer_kwargs.get("gradient_clip_algorithm"),
                precision=str(precision) if isinstance(precision, (str, int)) else None,
            ),
        )

    # ------------------------------------------------------------------ run-time accumulation
    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Change DeepSpeed's gradient-accumulation steps during training.

        Call it at an accumulation boundary (e.g. in ``on_train_batch_start`` when
        ``trainer.fit_loop`` is at a step boundary). The engine's ``train_batch_size`` is updated
        to ``micro-batch x steps x world size``, and the Trainer's ``accumulate_grad_batches`` is
        set to ``steps`` so that Lightning's loop steps at the same boundaries. The loss is divided
        by ``steps`` once either way: by Lightning when ``trainer.accumulate_grad_batches > 1``
        (the engine is then told not to), else by the engine (see :meth:`backward`); a callback
        may set ``trainer.accumulate_grad_batches = 1`` afterwards and count windows itself, as
        ``lplugins.accumulation.AccumulationScheduler`` does.

        Args:
            steps: The new number of micro-batches per optimizer step (>= 1).

        Raises:
            DeepSpeedConfigError: ``steps`` is not a positive int (also a ``ValueError``).
            DeepSpeedEngineNotReady: the engine does not exist yet, before ``trainer.fit`` has set it up
                (also a ``RuntimeError``).
        """
        positive_int("steps", steps, error=DeepSpeedConfigError, owner="set_gradient_accumulation_steps")
        engine: Any = self.model
        if engine is None or not hasattr(engine, "set_train_batch_size"):
            raise DeepSpeedEngineNotReady("The DeepSpeed engine is not set up yet; call this during trainer.fit().")
        micro = engine.train_micro_batch_size_per_gpu()
        engine.set_train_batch_size(micro * steps * self.world_size)
        if isinstance(self.config, dict):
            self.config["gradient_accumulation_steps"] = steps
            self.config["train_batch_size"] = micro * steps * self.world_size
        module = self.lightning_module
        trainer = _lightning.attached_trainer(module) if module is not None else None
        if trainer is not None:
            trainer.accumulate_grad_batches = steps

    def __repr__(self) -> str:
        stage = (self.config or {}).get("zero_optimization", {}).get("stage") if isinstance(self.config, dict) else None
        return f"lplugins.strategies.DeepSpeedStrategy(stage={stage}, timeout={_lightning.strategy_timeout(self)})"


class DeepSpeedReshardError(LPluginsError, RuntimeError):
    """A ZeRO checkpoint of another data-parallel world size could not be converted to load on this one."""


def _save(checkpoint: dict[str, Any], out: str) -> None:
    import torch

    torch.save(checkpoint, out)


def config_for_stage(
    config: Mapping[str, Any] | str | PathLike[str], name: str, stage: int, options: Mapping[str, Any]
) -> dict[str, Any]:
    """Reconcile a user config with a named strategy's ZeRO stage.

    A config without ``zero_optimization`` gets the named strategy's stage (and its offload
    settings); a config that names a different stage is refused rather than overridden.

    Raises:
        DeepSpeedConfigError: the config's stage differs from the strategy name's.
    """
    loaded = load_config(config)
    validate_config(loaded)
    zero = loaded.get("zero_optimization")
    if zero is None:
        zero = {"stage": stage}
        if options.get("offload_optimizer"):
            zero["offload_optimizer"] = {"device": "cpu"}
        if options.get("offload_parameters"):
            zero["offload_param"] = {"device": "cpu"}
        loaded["zero_optimization"] = zero
    elif zero.get("stage", 0) != stage:
        raise DeepSpeedConfigError(
            f"Strategy {name!r} is ZeRO stage {stage}, but its config sets 'zero_optimization.stage' to "
            f"{zero.get('stage', 0)}. Use the strategy named for stage {zero.get('stage', 0)} "
            f"(e.g. 'deepspeed_stage_{zero.get('stage', 0)}_cpu'), or change the config."
        )
    # As Lightning does for the configs it generates: any torch optimizer is allowed with ZeRO unless the
    # config says otherwise (DeepSpeed's own default refuses non-Adam optimizers only at setup, mid-``fit``).
    loaded.setdefault("zero_allow_untested_optimizer", True)
    return loaded
