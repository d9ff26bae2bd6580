"""``DurableCheckpoint``: the checkpoint policy -- when to save, what to keep, resume and preemption, Lightning hooks.

How a save is written is the writers' business (:mod:`~lplugins.callbacks._writer`); see
:mod:`lplugins.callbacks` for the map of the package.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lplugins import _lightning
from lplugins._log import announce
from lplugins.callbacks import _rng
from lplugins.callbacks._claim import DirectoryClaim, claim_directory
from lplugins.callbacks._collective import any_rank, broadcast, gather, writable_on_every_rank
from lplugins.callbacks._config import CheckpointConfig, ConfigField, check_dirpath
from lplugins.callbacks._position import DataPosition
from lplugins.callbacks._preemption import PREEMPTED_EXIT_CODE, PreemptionSignals, slurm_requeue
from lplugins.callbacks._record import Record, now
from lplugins.callbacks._resume import LatestResolver, understand_ckpt_path
from lplugins.callbacks._retention import Ledger
from lplugins.callbacks._storage import canonical_dirpath
from lplugins.callbacks._storages import open_storage
from lplugins.callbacks._triggers import Due
from lplugins.callbacks._writer import CheckpointWriter, refuse_continuous
from lplugins.callbacks._writers import choose_writer

__all__ = ["DurableCheckpoint"]


class DurableCheckpoint(Checkpoint):
    """Atomic, durable, rank-safe checkpoints: any mix of triggers, keep-last-K and top-K, resume, preemption.

    Every save is taken by all ranks together at a step boundary; the file is written once (by global
    rank 0, or by each rank for sharded strategies), under a temporary name in ``dirpath``, ``fsync``-ed,
    renamed, and committed with a marker written last (see ``docs/checkpoint.md``). A crash at any
    instant leaves every previously committed checkpoint intact, and uncommitted leftovers are never
    picked for resume and are removed at the next start. Old checkpoints are deleted only after a
    newer one is committed.

    Resume with ``trainer.fit(model, ckpt_path="latest")`` (newest committed, loadable checkpoint in
    ``dirpath``; a fresh start when there is none; all ranks must resolve the same one), or with
    ``ckpt_path=latest_checkpoint(dirpath)``. Every load goes through ``torch.load(weights_only=True)``.

    Args:
        dirpath: Directory for checkpoints (local path or fsspec URL). Default:
            ``<trainer.default_root_dir>/checkpoints``.
        every_n_steps: Save every this many optimizer steps.
        every_n_seconds: Save at the first step boundary after this many seconds of training since the
            last save (rank 0's clock decides, for all ranks).
        every_n_epochs: Save at the end of every this many training epochs.
        save_on_train_end: Save when training ends (if the last step is not saved already).
        keep_last: Keep the newest this many checkpoints (``None``: keep all). At least 1.
        keep_top: Also keep the best this many by ``monitor`` (0: none).
        monitor: The logged metric ``keep_top`` ranks by.
        mode: ``"min"`` or ``"max"``: which values of ``monitor`` are better.
        async_save: Snapshot the state to CPU memory and write it on a background thread. The copies of
            the parameters and optimizer state (on CPU) are made while the next forward and backward
            run, and finished before the next optimizer step changes them (see ``docs/checkpoint.md``).
        continuous: Save continuously: with ``async_save``, a new save starts at the first step boundary
            after the previous one has committed and rested (``max_slowdown``; every rank agrees in the
            step's existing collective). Combines with the other triggers; needs ``async_save=True`` and a
            ``keep_last`` (see ``docs/checkpoint.md``, "Continuous checkpointing"). DeepSpeed writes its own shards
            synchronously and is refused at ``fit``; with FSDP2's ``save_distributed_checkpoint=True`` every rank
            writes its own shards in the background; FSDP2's default full-state file is written by rank 0 as DDP's.
        max_slowdown: With ``continuous``, the most throughput saving may cost (``0.03``: 3 %): the writing
            rank times its steps with and without a save in flight and rests between saves as long as that
            takes (said once on rank zero). ``None``: never rest.
        max_in_flight: With ``async_save``, the most saves queued or being written; a save beyond it
            waits for the oldest to finish.
        preemption_signals: Signals that trigger one coordinated save and a clean exit (any rank may
            receive them). Empty to disable. The previous handlers are restored when training ends.
            ``SIGKILL`` and ``SIGSTOP`` cannot be caught and are refused. With no interval, no
            ``save_on_train_end`` and no signal, the callback saves only on ``request_checkpoint`` (said
            at train start; a fit that saved nothing warns).
        preemption_exit_code: Exit code after a preemption save (``SystemExit`` on every rank);
            ``None`` stops training normally instead (``trainer.should_stop``) and sets ``preempted``.
        slurm_requeue: After a preemption save, run ``scontrol requeue $SLURM_JOB_ID`` from rank 0
            when running under SLURM.
        crc32: Compute the CRC32 of the whole checkpoint file while writing it (on a second thread,
            overlapped with the write; for a directory checkpoint, of each file at the commit) and keep
            it in the commit marker, where every resume checks it. torch's own per-record archive
            CRC32s are then not computed (``torch.load`` does not check them; torch's process-wide switch
            for them is off during the write); with ``False`` they are, and a resume checks those.
        verify: Every resumed byte is checked against the commit marker's CRC32s either way (a damaged
            checkpoint is skipped by ``"latest"`` and quarantined): ``"quick"`` checks while loading (on
            a second thread, no real cost), ``"deep"`` before loading (a second read; a strategy that
            loads into the model in place then never sees a damaged byte).
        filename: A Lightning-style name template, e.g. ``"{epoch}-{step}-{val_loss:.3f}"``: ``{epoch}`` (the
            0-based epoch of the saved step), ``{step}`` (the global step) and logged metrics (from
            ``trainer.callback_metrics``; ``nan`` when not logged yet), with format specs. ``.ckpt`` is
            appended, ``-vN`` before it when the name is taken. ``None``: ``step=000000012-epoch=0001.ckpt``.
            Names never decide which checkpoint is newest: the commit order does.
        auto_insert_metric_name: With ``filename``, write ``name=`` before each field
            (``epoch=3-step=100-val_loss=0.123.ckpt``), as Lightning's ``ModelCheckpoint`` does.
        take_over: One job writes a ``dirpath`` at a time: ``fit`` claims it (rank 0, before touching it) and
            refuses to start while another live job holds it (``CheckpointClaimError`` naming its host, pid
            and start time). A claim whose process is gone or whose heartbeat stopped is taken over on its own
            (said once); ``True`` takes over a live claim too (stop the other job first).

    Attributes:
        config: The arguments, checked and frozen (each is also readable as an attribute, e.g. ``every_n_steps``).
        preempted: True after a preemption signal led to a save (and, with ``preemption_exit_code=None``, a stop).
        save_stalls: Seconds the training thread spent on each save (the stall; for async saves, taking the
            snapshot plus waiting for its deferred copies before the next optimizer step).

    Raises:
        CheckpointClaimError: (an ``OSError``, at ``fit``) another live job holds ``dirpath`` (see ``take_over``).
        CheckpointConfigError: (a ``ValueError``) an interval, ``keep_last``, ``keep_top``, ``max_in_flight``,
            ``max_slowdown``, ``mode``, ``monitor``, ``verify``, ``filename``, ``dirpath`` (empty or not a path), a
            bool that is not a real ``bool``, or a signal is invalid or uncatchable (``SIGKILL``, ``SIGSTOP``);
            ``continuous=True`` without ``async_save=True`` or with ``keep_last=None``; at ``fit``,
            ``continuous=True`` with a strategy that writes its own checkpoints synchronously. The message names
            the argument.

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> ckpt = DurableCheckpoint(dirpath="ckpts", every_n_steps=100, keep_last=3)
        >>> trainer = Trainer(callbacks=[ckpt], max_steps=1, logger=False, enable_progress_bar=False)
        >>> # trainer.fit(model, ckpt_path="latest")  # resumes from ckpts/ when there is one
    """

    every_n_steps = ConfigField[int | None]()
    every_n_seconds = ConfigField[float | None]()
    every_n_epochs = ConfigField[int | None]()
    save_on_train_end = ConfigField[bool]()
    keep_last = ConfigField[int | None]()
    keep_top = ConfigField[int]()
    monitor = ConfigField[str | None]()
    mode = ConfigField[str]()
    async_save = ConfigField[bool]()
    continuous = ConfigField[bool]()
    max_slowdown = ConfigField[float | None]()
    max_in_flight = ConfigField[int]()
    preemption_signals = ConfigField[tuple[int, ...]]()
    preemption_exit_code = ConfigField[int | None]()
    slurm_requeue = ConfigField[bool]()
    verify = ConfigField[str]()
    crc32 = ConfigField[bool]()
    filename = ConfigField[str | None]()
    auto_insert_metric_name = ConfigField[bool]()
    take_over = ConfigField[bool]()

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        every_n_epochs: int | None = None,
        save_on_train_end: bool = True,
        keep_last: int | None = 3,
        keep_top: int = 0,
        monitor: str | None = None,
        mode: str = "min",
        async_save: bool = False,
        continuous: bool = False,
        max_slowdown: float | None = 0.03,
        max_in_flight: int = 1,
        preemption_signals: Sequence[str | int | signal.Signals] = ("SIGTERM", "SIGUSR1"),
        preemption_exit_code: int | None = PREEMPTED_EXIT_CODE,
        slurm_requeue: bool = False,
        verify: str = "quick",
        crc32: bool = True,
        filename: str | None = None,
        auto_insert_metric_name: bool = True,
        take_over: bool = False,
    ) -> None:
        self.config = CheckpointConfig(
            every_n_steps=every_n_steps, every_n_seconds=every_n_seconds, every_n_epochs=every_n_epochs,
            save_on_train_end=save_on_train_end, keep_last=keep_last, keep_top=keep_top, monitor=monitor, mode=mode,
            async_save=async_save, continuous=continuous, max_slowdown=max_slowdown, max_in_flight=max_in_flight,
            preemption_signals=preemption_signals, preemption_exit_code=preemption_exit_code,
            slurm_requeue=slurm_requeue, verify=verify, crc32=crc32,
            filename=filename, auto_insert_metric_name=auto_insert_metric_name, take_over=take_over,
        )  # fmt: skip
        self.dirpath = check_dirpath(dirpath)
        # the directory as one spelling: restarting with ``ckpts/`` for ``ckpts`` still restores this state
        self._state_key = _lightning.callback_state_key(self, dirpath=canonical_dirpath(self.dirpath))
        self.preempted = False
        self.save_stalls: list[float] = []
        self._ledger: Ledger | None = None
        self._writer: CheckpointWriter | None = None
        self._claim: DirectoryClaim | None = None  # rank 0's claim on dirpath, during fit
        self._resolver: LatestResolver | None = None
        self._signals = PreemptionSignals(self.config.preemption_signals)
        self._requested = False
        self._boundary_step = -1  # the global step of the last step boundary seen
        self._boundary_epoch = 0  # the 0-based epoch that step was taken in
        self._last_saved_step = -1  # the global step whose state is on disk already
        self._saving_step = -1  # the global step being saved (state_dict records it), -1 outside a save
        self._last_save_time = 0.0
        self._rng_states: list[dict[str, Any]] | None = None  # every rank's RNG states, during a save
        self._positions: list[dict[str, Any]] | None = None  # every rank's data position, during a save
        self._position = DataPosition()  # where in the epoch the data is: recorded, saved, replayed
        self._saves_before_fit = 0  # len(save_stalls) when this fit started training
        self._unlogged: set[str] = set()  # template metrics warned about as not logged

    # ---------------------------------------------------------------------------------- public API
    @property
    @override
    def state_key(self) -> str:
        # ``Trainer()`` reads this while it is being built: the one moment before ``fit`` parses its
        # ``ckpt_path`` where this callback can meet its Trainer (for ``ckpt_path="last"``)
        trainer = _lightning.trainer_being_built()
        if trainer is not None:
            understand_ckpt_path(trainer, DurableCheckpoint)
        return self._state_key

    @property
    def committed(self) -> list[str]:
        """Paths of the committed checkpoints this callback keeps, oldest first (rank 0's view)."""
        ledger = self._ledger
        return [ledger.storage.path(name) for name in ledger.names()] if ledger else []

    def request(self) -> None:
        """Ask for a checkpoint at the next step boundary. Safe from one rank only (no collective here)."""
        self._requested = True

    # ---------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        dirpath = self.dirpath or os.path.join(trainer.default_root_dir, "checkpoints")
        self.dirpath = dirpath
        storage = open_storage(dirpath)
        if self._ledger is None or stage == "fit":
            self._ledger = Ledger(storage, self.config.retention)
        if self._resolver is None or self._resolver.trainer is not trainer:
            self._resolver = LatestResolver(trainer, dirpath, deep=self.config.verify == "deep")
        self._resolver.forget = self._ledger.forget  # a checkpoint quarantined at load leaves the ledger
        self._resolver.install()
        understand_ckpt_path(trainer, DurableCheckpoint)  # for the next fit/validate/test (no-op if done in Trainer())
        if stage != "fit":
            return
        if self.config.continuous:
            refuse_continuous(trainer)  # before the directory is claimed
        writable_on_every_rank(trainer, storage)
        self._claim = claim_directory(trainer, storage, self.config.take_over)  # before touching the directory
        if trainer.is_global_zero:
            storage.clean_leftovers(self.config.names.pattern).announce(dirpath)
            self._ledger.open()  # retention deletes old checkpoints off the training thread
        trainer.strategy.barrier("DurableCheckpoint.setup")
        self._writer = choose_writer(trainer, self.config, self._ledger, self.dirpath)
        self._last_saved_step = -1
        self._last_save_time = time.monotonic()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning installs its SIGTERM handler after `setup`; ours replaces it for the run
        self._signals.install()
        self._last_save_time = time.monotonic()
        # The state restored (or the initial one) is a step boundary: the first micro-batches of the next
        # window run at the same global step and must not look like a new boundary (no save mid-window).
        self._position.on_train_start(trainer)  # after a mid-epoch restore: same samples, same order, same epoch
        self._boundary_step = trainer.global_step
        self._boundary_epoch = trainer.current_epoch
        self._saves_before_fit = len(self.save_stalls)
        if not self.config.automatic_triggers:
            announce(
                "lplugins: DurableCheckpoint(%s) has no automatic trigger (every_n_steps, every_n_seconds and"
                " every_n_epochs are None, save_on_train_end=False, preemption_signals=()): it saves only when"
                " request_checkpoint(trainer) is called.",
                self.dirpath,
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # before the fit loop builds the training dataloaders and their first iterators
        self._position.attach(trainer)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._position.detach()  # the user's DataLoaders and the strategy as they were
        if not self.config.automatic_triggers and len(self.save_stalls) == self._saves_before_fit:
            rank_zero_warn(
                f"DurableCheckpoint({self.dirpath}) saved nothing in this fit: it has no automatic trigger and"
                " request_checkpoint(trainer) was never called. Set every_n_steps/every_n_seconds/every_n_epochs"
                " or save_on_train_end=True to save without requests."
            )

    # ---------------------------------------------------------------------------------- triggers
    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._complete_snapshot()
        step = trainer.global_step
        if step == self._boundary_step:
            return  # not an optimizer-step boundary (gradient accumulation)
        self._boundary_step, self._boundary_epoch = step, trainer.current_epoch
        writer = self._writer
        mine = Due(
            requested=self._requested,
            preempt=self._signals.received is not None,
            failed=writer is not None and writer.failed(),
            stop=trainer.should_stop,
            busy=self.config.continuous and writer is not None and writer.busy(),
        )
        due = Due.agree(trainer, self.config, mine, self._last_save_time)
        trainer.should_stop = due.stop  # set on one rank (Lightning does not share it): all stop at this step
        self._requested = False
        if due.failed and writer is not None:
            writer.raise_failure()
        reasons = due.reasons(self.config, step)
        if reasons:
            self._save(trainer, "+".join(reasons))
        if due.preempt:
            self._preemption_exit(trainer)

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._complete_snapshot()  # the optimizer step is about to change what the async snapshot copies

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._complete_snapshot()  # callbacks may swap weights in for validation

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.should_stop = any_rank(trainer, trainer.should_stop)  # set on one rank outside a step boundary
        every = self.config.every_n_epochs
        if every is not None and (trainer.current_epoch + 1) % every == 0:
            self._save(trainer, "epoch")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._signals.restore()
        if self.config.save_on_train_end and not self.preempted:
            self._save(trainer, "train_end")
        self._finish(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()
        self._position.detach()  # on_fit_end does not run after an exception: the loaders as they were

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()
        if self._resolver is not None:
            self._resolver.uninstall()
        self._resolver = None

    # ---------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        # version 2 added "position" (every rank's data position; None outside this callback's saves)
        rng = self._rng_states if self._rng_states is not None else [_rng.capture()]
        return {"version": 2, "rng": rng, "boundary_step": self._saving_step, "position": self._positions}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Restored right away: the next user of the generators (a shuffling sampler's ``iter``, dropout)
        # then sees the state the interrupted run had when it saved.
        loaded_step = state_dict.get("boundary_step")
        if isinstance(loaded_step, int):
            self._last_saved_step = loaded_step  # this state is on disk already: do not save it again
        states = state_dict.get("rng")
        if states:
            _rng.restore_this_rank(states)
        # version 1 has no position: a mid-epoch resume of it continues as before (Lightning's fresh iterator)
        self._position.load(state_dict.get("position"), states)

    # ---------------------------------------------------------------------------------- saving
    def _save(self, trainer: Trainer, reason: str) -> None:
        assert self._ledger is not None and self._writer is not None, "DurableCheckpoint.setup() did not run"
        self._complete_snapshot()
        step, epoch = trainer.global_step, self._epoch_of(trainer)
        if step == self._last_saved_step:
            return  # every rank agrees: this state is saved already (or was loaded from a checkpoint)
        name = broadcast(trainer, self._free_name(trainer, step, epoch) if trainer.is_global_zero else None)
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        start = time.perf_counter()
        record = Record(
            name=name, global_step=step, epoch=epoch, time=now(), monitor=self.config.monitor,
            metric=self._metric(trainer), reason=reason,
        )  # fmt: skip
        # errors of a background write surface at the next step boundary, on every rank
        self._writer.save(trainer, self._dump(trainer, step), record)
        self.save_stalls.append(time.perf_counter() - start)

    def _epoch_of(self, trainer: Trainer) -> int:
        """The 0-based epoch the current global step was taken in (what every checkpoint name says).

        At the end of fit, ``trainer.current_epoch`` counts the epochs completed (a run stopped by
        ``max_steps`` inside epoch 0 reports 1); the epoch recorded at the last step boundary does not.
        """
        if trainer.global_step == self._boundary_step:
            return self._boundary_epoch
        return trainer.current_epoch

    def _dump(self, trainer: Trainer, step: int) -> dict[str, Any]:
        """The checkpoint dict, every rank's RNG states and data position in this callback's state (a collective)."""
        gathered = gather(trainer, (_rng.capture(), self._position.state(trainer)))
        self._rng_states = [rng for rng, _ in gathered]
        self._positions = [position for _, position in gathered]
        self._saving_step = step
        try:
            return _lightning.checkpoint_dict(trainer)
        finally:
            self._rng_states = self._positions = None
            self._saving_step = -1

    def _complete_snapshot(self) -> None:
        """Finish the deferred copies of the last async snapshot before anything changes the state."""
        waited = self._writer.complete_snapshot() if self._writer is not None else None
        if waited is not None and self.save_stalls:
            self.save_stalls[-1] += waited

    def _metric(self, trainer: Trainer, name: str | None = None) -> float | None:
        name = name or self.config.monitor
        if name is None:
            return None
        value = trainer.callback_metrics.get(name)
        if value is None:
            return None
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    def _free_name(self, trainer: Trainer, step: int, epoch: int) -> str:
        """The name of this save (rank 0): the template filled in, ``-vN`` if the name is taken."""
        assert self._ledger is not None
        names = self.config.names
        metrics = {m: v for m in names.metric_names if (v := self._metric(trainer, m)) is not None}
        for missing in sorted(set(names.metric_names) - set(metrics) - self._unlogged):
            self._unlogged.add(missing)
            rank_zero_warn(
                f"DurableCheckpoint(filename={names.template!r}): metric {missing!r} is not logged (yet) at step"
                f" {step}; its part of the name is 'nan' until it is."
            )
        return self._ledger.free_name(names.base(step, epoch, metrics))

    def _finish(self, trainer: Trainer) -> None:
        """Finish every save in flight; report a background failure on all ranks."""
        self._complete_snapshot()
        if self._writer is not None:
            self._writer.finish(trainer)

    def _close(self) -> None:
        """Stop the background threads (committing what was snapshotted) and restore the signal handlers."""
        try:
            self._signals.restore()
            self._complete_snapshot()
            if self._writer is not None:
                self._writer.close()
            if self._ledger is not None:
                self._ledger.close()
        finally:  # a failed fit releases the directory too
            if self._claim is not None:
                self._claim.release()
                self._claim = None

    # ---------------------------------------------------------------------------------- preemption
    def _preemption_exit(self, trainer: Trainer) -> None:
        self._finish(trainer)
        trainer.strategy.barrier("DurableCheckpoint.preemption")
        self.preempted = True
        self._signals.restore()
        if self.config.slurm_requeue and trainer.is_global_zero:
            slurm_requeue()
        rank_zero_info(f"DurableCheckpoint: preemption checkpoint saved at step {trainer.global_step}; stopping.")
        if self.config.preemption_exit_code is None:
            trainer.should_stop = True
            return
        raise SystemExit(self.config.preemption_exit_code)
