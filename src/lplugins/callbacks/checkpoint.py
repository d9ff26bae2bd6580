"""``DurableCheckpoint``: atomic, durable, rank-safe checkpoints: triggers, retention, resume, preemption."""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lplugins.callbacks._async import BufferPool, DeferredCopy, Writer, snapshot
from lplugins.callbacks._resume import LATEST, NoCheckpoint, SafeResumeIO, latest_checkpoint
from lplugins.callbacks._storage import COMMIT_SUFFIX, TMP_PREFIX, Record, Storage, checkpoint_name, now, order

log = logging.getLogger("lplugins")

#: The exit code of a process that saved and stopped because of a preemption signal
#: (``EX_TEMPFAIL`` from ``sysexits.h``: "temporary failure, retry"). Schedulers and wrappers can
#: requeue on it; a finished run exits 0.
PREEMPTED_EXIT_CODE = 75

_HANDLER = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, I/O error, ...). The checkpoints committed before are intact."""


class CheckpointDirectoryError(OSError):
    """The checkpoint directory cannot be created or written; raised at setup, before any training."""


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
        max_in_flight: With ``async_save``, the most saves queued or being written; a save beyond it
            waits for the oldest to finish.
        preemption_signals: Signals that trigger one coordinated save and a clean exit (any rank may
            receive them). Empty to disable. The previous handlers are restored when training ends.
        preemption_exit_code: Exit code after a preemption save (``SystemExit`` on every rank);
            ``None`` stops training normally instead (``trainer.should_stop``) and sets ``preempted``.
        slurm_requeue: After a preemption save, run ``scontrol requeue $SLURM_JOB_ID`` from rank 0
            when running under SLURM.
        crc32: Compute the CRC32 of the whole checkpoint file while writing it (on a second thread,
            overlapped with the write) and keep it in the commit marker, where ``verify="deep"`` checks
            it. torch's own per-record archive CRC32s are not computed either way (``torch.load`` does
            not check them); torch's process-wide switch for them is off during the write.
        verify: ``"quick"`` (size and archive directory) or ``"deep"`` (every byte against the CRC32)
            check of a candidate when resolving ``"latest"``.

    Raises:
        ValueError: an interval, ``keep_last``, ``keep_top``, ``max_in_flight``, ``mode``,
            ``monitor``, ``verify`` or a signal is invalid (the message names the argument).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> ckpt = DurableCheckpoint(dirpath="ckpts", every_n_steps=100, keep_last=3)
        >>> trainer = Trainer(callbacks=[ckpt], max_steps=1, logger=False, enable_progress_bar=False)
        >>> # trainer.fit(model, ckpt_path="latest")  # resumes from ckpts/ when there is one
    """

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
        max_in_flight: int = 1,
        preemption_signals: Sequence[str | int | signal.Signals] = ("SIGTERM", "SIGUSR1"),
        preemption_exit_code: int | None = PREEMPTED_EXIT_CODE,
        slurm_requeue: bool = False,
        verify: str = "quick",
        crc32: bool = True,
    ) -> None:
        _positive_int("every_n_steps", every_n_steps, optional=True)
        _positive_int("every_n_epochs", every_n_epochs, optional=True)
        if every_n_seconds is not None and (
            isinstance(every_n_seconds, bool)
            or not isinstance(every_n_seconds, (int, float))
            or not math.isfinite(every_n_seconds)
            or every_n_seconds <= 0
        ):
            raise ValueError(f"every_n_seconds must be a positive number of seconds or None, got {every_n_seconds!r}")
        _positive_int("keep_last", keep_last, optional=True)
        if isinstance(keep_top, bool) or not isinstance(keep_top, int) or keep_top < 0:
            raise ValueError(f"keep_top must be an integer >= 0, got {keep_top!r}")
        if keep_top and not monitor:
            raise ValueError(f"keep_top={keep_top} needs monitor=<name of a logged metric>")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ValueError(f"monitor must be a metric name (a non-empty string) or None, got {monitor!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        _positive_int("max_in_flight", max_in_flight)
        if verify not in ("quick", "deep"):
            raise ValueError(f"verify must be 'quick' or 'deep', got {verify!r}")
        if not crc32 and verify == "deep":
            raise ValueError("crc32=False writes no checksums, so verify='deep' cannot check them; use verify='quick'")
        if preemption_exit_code is not None and (
            isinstance(preemption_exit_code, bool)
            or not isinstance(preemption_exit_code, int)
            or not 0 <= preemption_exit_code <= 255
        ):
            raise ValueError(f"preemption_exit_code must be an int in 0..255 or None, got {preemption_exit_code!r}")
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self._state_key = self._generate_state_key(dirpath=self.dirpath)
        self.every_n_steps = every_n_steps
        self.every_n_seconds = every_n_seconds
        self.every_n_epochs = every_n_epochs
        self.save_on_train_end = save_on_train_end
        self.keep_last = keep_last
        self.keep_top = keep_top
        self.monitor = monitor
        self.mode = mode
        self.async_save = async_save
        self.max_in_flight = max_in_flight
        self.preemption_signals = tuple(_parse_signal(s) for s in preemption_signals)
        self.preemption_exit_code = preemption_exit_code
        self.slurm_requeue = slurm_requeue
        self.verify = verify
        self.crc32 = crc32

        #: True after a preemption signal led to a save (and, with ``preemption_exit_code=None``, a stop).
        self.preempted = False
        #: Seconds the training thread spent on each save (the stall; for async saves, taking the
        #: snapshot plus waiting for its deferred copies before the next optimizer step).
        self.save_stalls: list[float] = []
        self._storage: Storage | None = None
        self._records: list[Record] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._writer: Writer | None = None
        self._deleter: Writer | None = None
        self._pool: BufferPool | None = None
        self._copy: DeferredCopy | None = None
        self._copy_stall = -1
        self._eager_snapshots = False
        self._writes_itself = True
        self._async_active = False
        self._requested = False
        self._signal_received: int | None = None
        self._previous_handlers: dict[int, _HANDLER] = {}
        self._boundary_step = -1
        self._last_saved_step = -1
        self._saving_step = -1
        self._last_save_time = 0.0
        self._io: SafeResumeIO | None = None
        self._rng_states: list[dict[str, Any]] | None = None

    # ---------------------------------------------------------------------------------- public API
    @property
    @override
    def state_key(self) -> str:
        return self._state_key

    @property
    def committed(self) -> list[str]:
        """Paths of the committed checkpoints this callback keeps, oldest first (rank 0's view)."""
        storage = self._storage
        with self._lock:
            return [storage.path(r.name) for r in self._records] if storage else []

    def request(self) -> None:
        """Ask for a checkpoint at the next step boundary. Safe from one rank only (no collective here)."""
        self._requested = True

    # ---------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        dirpath = self.dirpath or os.path.join(trainer.default_root_dir, "checkpoints")
        self.dirpath = dirpath
        storage = Storage(dirpath)
        self._storage = storage
        inner = trainer.strategy.checkpoint_io
        if not isinstance(inner, SafeResumeIO):
            self._io = SafeResumeIO(
                inner,
                dirpath,
                lambda path: _agree_on_path(trainer, path),
                deep=self.verify == "deep",
                on_resolved=lambda path: _set_ckpt_path(trainer, path),
            )
            trainer.strategy.checkpoint_io = self._io
        if _loads_itself(trainer) and "load_checkpoint" not in vars(trainer.strategy):
            # e.g. DeepSpeed loads its directory itself, bypassing CheckpointIO: resolve "latest" in front of it
            setattr(trainer.strategy, "load_checkpoint", _resolving_load(trainer, dirpath, self.verify == "deep"))  # noqa: B010
        if stage != "fit":
            return
        error: str | None = None
        try:
            storage.probe_writable()
        except OSError as err:
            error = f"{type(err).__name__}: {err}"
        errors = _gather(trainer, error)
        bad = [(rank, e) for rank, e in enumerate(errors) if e]
        if bad:
            details = "; ".join(f"rank {rank}: {e}" for rank, e in bad)
            raise CheckpointDirectoryError(
                f"DurableCheckpoint cannot write to dirpath={dirpath!r} ({details}). Give a writable directory."
            )
        if trainer.is_global_zero:
            removed = storage.clean_leftovers()
            if removed:
                rank_zero_info(f"DurableCheckpoint: removed {len(removed)} uncommitted leftover(s) in {dirpath}")
            with self._lock:
                self._records = storage.find_committed()
                self._seq = max((r.seq for r in self._records), default=0)
        trainer.strategy.barrier("DurableCheckpoint.setup")
        self._writes_itself = _writes_itself(trainer)
        if self.async_save and not self._writes_itself:
            rank_zero_warn(
                f"DurableCheckpoint(async_save=True): {type(trainer.strategy).__name__} writes its own checkpoints;"
                " saving synchronously."
            )
        self._async_active = self.async_save and self._writes_itself
        if self._async_active and trainer.is_global_zero:
            self._writer = Writer(self.max_in_flight)
            self._pool = BufferPool(1)
        if trainer.is_global_zero:
            self._deleter = Writer(_DELETES_IN_FLIGHT)  # retention deletes old checkpoints off the training thread
        self._eager_snapshots = False
        self._boundary_step = -1
        self._last_saved_step = -1
        self._last_save_time = time.monotonic()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning installs its SIGTERM handler after `setup`; ours replaces it for the run
        self._install_signal_handlers()
        self._last_save_time = time.monotonic()

    # ---------------------------------------------------------------------------------- triggers
    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._complete_snapshot()
        step = trainer.global_step
        if step == self._boundary_step:
            return  # not an optimizer-step boundary (gradient accumulation)
        self._boundary_step = step
        time_due = bool(
            trainer.is_global_zero
            and self.every_n_seconds is not None
            and time.monotonic() - self._last_save_time >= self.every_n_seconds
        )
        failed = self._writer is not None and self._writer.failed
        flags = _reduce_max(
            trainer, [int(self._requested), int(self._signal_received is not None), int(failed), int(time_due)]
        )
        requested, preempt, background_failed, time_due = (bool(f) for f in flags)
        self._requested = False
        if background_failed:
            self._raise_background_error(trainer)
        reasons = []
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            reasons.append("step")
        if time_due:
            reasons.append("time")
        if requested:
            reasons.append("request")
        if preempt:
            reasons.append("preemption")
        if reasons:
            self._save(trainer, "+".join(reasons))
        if preempt:
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
        if self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer, "epoch")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_signal_handlers()
        if self.save_on_train_end and not self.preempted:
            self._save(trainer, "train_end")
        self._finish(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore_signal_handlers()
        self._complete_snapshot()
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()  # commit what was already snapshotted; errors were or will be reported
        self._close_deleter()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_signal_handlers()
        self._complete_snapshot()
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()
        self._close_deleter()
        self._pool = None  # the CPU copies of the state
        if self._io is not None and trainer.strategy.checkpoint_io is self._io:
            trainer.strategy.checkpoint_io = self._io.inner
        self._io = None
        if getattr(vars(trainer.strategy).get("load_checkpoint"), "_lplugins_resolving", False):
            delattr(trainer.strategy, "load_checkpoint")

    # ---------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        rng = self._rng_states if self._rng_states is not None else [_get_rng()]
        return {"version": 1, "rng": rng, "boundary_step": self._saving_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Restored right away: the next user of the generators (a shuffling sampler's ``iter``, dropout)
        # then sees the state the interrupted run had when it saved.
        loaded_step = state_dict.get("boundary_step")
        if isinstance(loaded_step, int):
            self._last_saved_step = loaded_step  # this state is on disk already: do not save it again
        states = state_dict.get("rng")
        if not states:
            return
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if dist else (0, 1)
        if len(states) != world:
            rank_zero_warn(
                f"DurableCheckpoint: the checkpoint holds the RNG states of {len(states)} rank(s) but this run has"
                f" {world}; the random number generators are not restored."
            )
            return
        _set_rng(states[rank])

    # ---------------------------------------------------------------------------------- saving
    def _save(self, trainer: Trainer, reason: str) -> None:
        assert self._storage is not None, "DurableCheckpoint.setup() did not run"
        self._complete_snapshot()
        step, epoch = trainer.global_step, trainer.current_epoch
        if step == self._last_saved_step:
            return  # every rank agrees: this state is saved already (or was loaded from a checkpoint)
        name = _broadcast(trainer, self._free_name(step, epoch) if trainer.is_global_zero else None)
        self._last_saved_step = step
        self._last_save_time = time.monotonic()
        start = time.perf_counter()
        record = Record(
            name=name, global_step=step, epoch=epoch, time=now(), monitor=self.monitor,
            metric=self._metric(trainer), reason=reason,
        )  # fmt: skip
        self._rng_states = _gather(trainer, _get_rng())
        self._saving_step = step
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self._rng_states = None
            self._saving_step = -1
        if self._writes_itself and self._async_active:
            # errors of the background write surface at the next step boundary, on every rank
            if self._writer is not None and self._pool is not None:
                used: list[torch.Tensor] = []
                pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
                stable = frozenset() if self._eager_snapshots else _stable_storages(trainer)
                data = snapshot(checkpoint, self._pool.take(), used, defer=stable, deferred=pairs)
                del checkpoint
                pool = self._pool
                copy = DeferredCopy(pairs)

                def job() -> None:
                    try:
                        if copy.result():
                            self._write_file(record, data)
                    finally:
                        data.clear()
                        pool.give(used)

                self._copy, self._copy_stall = copy, len(self.save_stalls)
                self._writer.submit(job)
        elif self._writes_itself:
            error: BaseException | None = None
            if trainer.is_global_zero:
                try:
                    self._write_file(record, checkpoint)
                except BaseException as err:
                    error = err
            self._agree_or_raise(trainer, error, record)
        else:
            self._save_through_strategy(trainer, checkpoint, record)
        self.save_stalls.append(time.perf_counter() - start)

    def _complete_snapshot(self) -> None:
        """Finish the deferred copies of the last async snapshot before anything changes the state."""
        copy, self._copy = self._copy, None
        if copy is None:
            return
        waited, intact = copy.complete()
        if 0 <= self._copy_stall < len(self.save_stalls):
            self.save_stalls[self._copy_stall] += waited
        if not intact and not self._eager_snapshots:
            self._eager_snapshots = True
            rank_zero_warn(
                "DurableCheckpoint(async_save=True): parameters or optimizer state changed in place before the"
                " optimizer step that followed a save (outside optimizer.step()); that checkpoint was dropped,"
                " and from now on snapshots are copied before training goes on."
            )

    def _close_deleter(self) -> None:
        if self._deleter is not None:
            deleter, self._deleter = self._deleter, None
            deleter.close()

    def _free_name(self, step: int, epoch: int) -> str:
        """A checkpoint name for this state that nothing in the directory uses (rank 0)."""
        assert self._storage is not None
        entries = set(self._storage.listdir())
        version = 0
        while (name := checkpoint_name(step, epoch, version)) in entries or name + COMMIT_SUFFIX in entries:
            version += 1
        return name

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def _write_file(self, record: Record, checkpoint: dict[str, Any]) -> None:
        storage = self._storage
        assert storage is not None
        path = storage.path(record.name)
        try:
            record.crc32 = storage.write_stream(
                record.name, lambda stream: _torch_save(checkpoint, stream), self.crc32, _cpu_storages(checkpoint)
            )
            record.zip_crc = not _can_skip_zip_crc()
            record.size = storage.size(record.name)
            record.time, record.seq = now(), self._next_seq()
            storage.commit(record)
        except Exception as err:  # OSError, or torch's RuntimeError from a failed stream write
            storage.remove(record.name)  # the rename happened but the marker did not: leftover, not visible
            raise self._write_error(path, err) from err
        self._committed(record)

    def _save_through_strategy(self, trainer: Trainer, checkpoint: dict[str, Any], record: Record) -> None:
        storage = self._storage
        assert storage is not None
        tmp = TMP_PREFIX + record.name  # the same name on every rank: the strategy writes its shards into it
        error: BaseException | None = None
        try:
            trainer.strategy.save_checkpoint(checkpoint, storage.path(tmp))
            if storage.exists(tmp):
                storage.fsync_tree(tmp)  # every rank syncs what it wrote (its shards, on a shared filesystem)
        except Exception as err:
            error = self._write_error(storage.path(record.name), err)
        self._agree_or_raise(trainer, error, record, cleanup=tmp)
        if trainer.is_global_zero:
            try:
                if storage.isdir(tmp):
                    record.kind, record.files = "dir", storage.tree_sizes(tmp)
                else:
                    record.size = storage.size(tmp)
                storage.rename(tmp, record.name, sync_dir=False)
                record.time, record.seq = now(), self._next_seq()
                storage.commit(record)
            except Exception as err:
                storage.remove(tmp)
                storage.remove(record.name)
                error = self._write_error(storage.path(record.name), err)
        self._agree_or_raise(trainer, error, record)
        if trainer.is_global_zero:
            self._committed(record)

    def _committed(self, record: Record) -> None:
        """Record a commit, then apply retention (only now may older checkpoints go)."""
        storage = self._storage
        assert storage is not None
        with self._lock:
            self._records.append(record)
            self._records.sort(key=order)
            keep = self._to_keep(self._records)
            doomed = [r for r in self._records if r.name not in keep]
            self._records = [r for r in self._records if r.name in keep]
        deleter = self._deleter
        for r in doomed:
            if deleter is None:
                storage.delete(r.name)
            else:
                deleter.submit(functools.partial(_delete_quietly, storage, r.name))

    def _to_keep(self, records: list[Record]) -> set[str]:
        keep = {records[-1].name}
        keep |= {r.name for r in (records if self.keep_last is None else records[-self.keep_last :])}
        if self.keep_top:
            scored = [
                r for r in records if r.metric is not None and r.monitor == self.monitor and not math.isnan(r.metric)
            ]
            sign = 1.0 if self.mode == "min" else -1.0
            scored.sort(key=lambda r: sign * float(r.metric or 0.0))
            keep |= {r.name for r in scored[: self.keep_top]}
        return keep

    def _metric(self, trainer: Trainer) -> float | None:
        if self.monitor is None:
            return None
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return None
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    def _write_error(self, path: str, err: Exception) -> CheckpointWriteError:
        with self._lock:
            intact = [r.name for r in self._records]
        reason = getattr(err, "strerror", None) or (str(err).splitlines()[-1] if str(err) else "no message")
        error = CheckpointWriteError(
            f"Writing checkpoint {path} failed ({type(err).__name__}: {reason}). The previous checkpoints are"
            f" intact: {intact or 'none'}"
        )
        return error

    def _agree_or_raise(
        self, trainer: Trainer, error: BaseException | None, record: Record, cleanup: str | None = None
    ) -> None:
        """All ranks learn whether any rank failed; all raise together (no rank is left in a collective)."""
        failed = _reduce_max(trainer, [int(error is not None)])[0]
        if not failed:
            return
        if cleanup is not None and trainer.is_global_zero and self._storage is not None:
            self._storage.remove(cleanup)
        if error is not None:
            raise error
        raise CheckpointWriteError(f"Saving checkpoint {record.name} failed on another rank (see its error).")

    def _raise_background_error(self, trainer: Trainer) -> None:
        if self._writer is not None and self._writer.failed:
            writer, self._writer = self._writer, None
            try:
                writer.raise_error()
            finally:
                writer.close()
        raise CheckpointWriteError("A background checkpoint write failed on rank 0 (see its error).")

    def _finish(self, trainer: Trainer) -> None:
        """Finish every save in flight; report a background failure on all ranks."""
        self._complete_snapshot()
        if self._writer is not None:
            self._writer.flush()
        if self._deleter is not None:
            self._deleter.flush()
        failed = _reduce_max(trainer, [int(self._writer is not None and self._writer.failed)])[0]
        if failed:
            self._raise_background_error(trainer)

    # ---------------------------------------------------------------------------------- preemption
    def _install_signal_handlers(self) -> None:
        if not self.preemption_signals or threading.current_thread() is not threading.main_thread():
            return
        self._signal_received = None
        for sig in self.preemption_signals:
            if sig not in self._previous_handlers:
                self._previous_handlers[sig] = signal.getsignal(sig)
                signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        while self._previous_handlers:
            sig, handler = self._previous_handlers.popitem()
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # only a flag: the save happens at the next step boundary, on all ranks together
        self._signal_received = signum

    def _preemption_exit(self, trainer: Trainer) -> None:
        self._finish(trainer)
        trainer.strategy.barrier("DurableCheckpoint.preemption")
        self.preempted = True
        self._restore_signal_handlers()
        if self.slurm_requeue and trainer.is_global_zero:
            _slurm_requeue()
        rank_zero_info(f"DurableCheckpoint: preemption checkpoint saved at step {trainer.global_step}; stopping.")
        if self.preemption_exit_code is None:
            trainer.should_stop = True
            return
        raise SystemExit(self.preemption_exit_code)


def request_checkpoint(trainer: Trainer) -> None:
    """Ask every :class:`DurableCheckpoint` of ``trainer`` for a checkpoint at the next step boundary.

    Safe to call on one rank only, e.g. inside ``if trainer.is_global_zero:``: it only sets a flag, and
    the callback carries it to all ranks with the collective it runs at each step boundary, so all
    ranks save together. This replaces the pattern that deadlocks under DDP::

        if batch_idx % 1000 == 0 and self.trainer.is_global_zero:
            self.trainer.save_checkpoint(...)  # deadlock: save_checkpoint is collective

    Raises:
        ValueError: ``trainer`` has no ``DurableCheckpoint`` callback.
    """
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, DurableCheckpoint)]  # type: ignore[attr-defined]
    if not callbacks:
        raise ValueError("request_checkpoint(trainer): the trainer has no DurableCheckpoint callback; add one.")
    for cb in callbacks:
        cb.request()


# -------------------------------------------------------------------------------------- helpers
def _positive_int(name: str, value: object, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "a positive integer or None" if optional else "a positive integer"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _parse_signal(value: str | int | signal.Signals) -> int:
    try:
        if isinstance(value, str):
            return int(signal.Signals[value if value.startswith("SIG") else "SIG" + value])
        return int(signal.Signals(value))
    except (KeyError, ValueError):
        raise ValueError(
            f"preemption_signals: {value!r} is not a signal; use names like 'SIGTERM', 'SIGUSR1' or signal numbers"
        ) from None


def _dist(trainer: Trainer) -> bool:
    return trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def _reduce_max(trainer: Trainer, values: list[int]) -> list[int]:
    """Element-wise max over all ranks (one small all-reduce); the values themselves when single-process."""
    if not _dist(trainer):
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=trainer.strategy.root_device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def _gather(trainer: Trainer, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not _dist(trainer):
        return [obj]
    out: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def _broadcast(trainer: Trainer, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not _dist(trainer):
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _agree_on_path(trainer: Trainer, path: str | None) -> None:
    paths = _gather(trainer, path)
    if len(set(paths)) > 1:
        listing = ", ".join(f"rank {rank}: {p!r}" for rank, p in enumerate(paths))
        raise RuntimeError(
            f"Ranks resolved different checkpoints to resume from ({listing}). The checkpoint directory must be"
            " shared by all ranks (or pass the same explicit ckpt_path everywhere)."
        )


def _set_ckpt_path(trainer: Trainer, path: str | None) -> None:
    """Make ``trainer.ckpt_path`` report the checkpoint ``"latest"`` resolved to (None: a fresh start)."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is not None and hasattr(connector, "_ckpt_path"):
        connector._ckpt_path = path


def _loads_itself(trainer: Trainer) -> bool:
    """Whether the strategy has its own ``load_checkpoint`` (DeepSpeed, FSDP2: they bypass ``CheckpointIO``)."""
    from lightning.pytorch.strategies import Strategy

    return type(trainer.strategy).load_checkpoint is not Strategy.load_checkpoint


def _resolving_load(trainer: Trainer, dirpath: str, deep: bool) -> Callable[..., Any]:
    """The strategy's own ``load_checkpoint`` with ``"latest"`` resolved (and agreed on by all ranks) in front."""
    original = trainer.strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(checkpoint_path, str) and checkpoint_path == LATEST:
            resolved = latest_checkpoint(dirpath, deep=deep)
            _agree_on_path(trainer, resolved)
            _set_ckpt_path(trainer, resolved)
            if resolved is None:
                import lightning

                return NoCheckpoint({"pytorch-lightning_version": lightning.__version__})
            checkpoint_path = resolved
        else:
            _agree_on_path(trainer, os.fspath(checkpoint_path))
        if "weights_only" in kwargs and not hasattr(trainer.strategy, "deepspeed_engine"):
            kwargs["weights_only"] = True  # DeepSpeed's engine loads its own files (docs/checkpoint.md)
        return original(checkpoint_path, *args, **kwargs)

    load_checkpoint._lplugins_resolving = True  # type: ignore[attr-defined]
    return load_checkpoint


_CRC_LOCK = threading.Lock()
_crc_off_count = 0
_crc_previous = True


def _torch_save(obj: Any, target: Any) -> None:
    """``torch.save`` without the archive's per-record CRC32s (the stream's whole-file CRC32 replaces them).

    torch's switch is process-wide (``torch.serialization.set_crc32_options``): it is off while any of
    these saves runs (saves on several threads share one "off" period) and restored after the last.
    Older torch versions without the switch compute them (slower, same result).
    """
    global _crc_off_count, _crc_previous
    if not _can_skip_zip_crc():
        torch.save(obj, target)
        return
    with _CRC_LOCK:
        if _crc_off_count == 0:
            _crc_previous = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_off_count += 1
    try:
        torch.save(obj, target)
    finally:
        with _CRC_LOCK:
            _crc_off_count -= 1
            if _crc_off_count == 0:
                torch.serialization.set_crc32_options(_crc_previous)


_DELETES_IN_FLIGHT = 1 << 16


def _delete_quietly(storage: Storage, name: str) -> None:
    """Retention's delete of an old checkpoint: a failure leaves it in place with a warning (nothing is lost)."""
    try:
        storage.delete(name)
    except Exception as err:  # a background thread: report, keep the checkpoint, go on
        log.warning("DurableCheckpoint: could not delete old checkpoint %s: %s", storage.path(name), err)


def _stable_storages(trainer: Trainer) -> frozenset[int]:
    """Storage addresses of the CPU parameters and optimizer state: they change only in the optimizer step."""
    out: set[int] = set()
    for p in trainer.lightning_module.parameters():
        if p.device.type == "cpu":
            out.add(p.untyped_storage().data_ptr())
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    out.add(value.untyped_storage().data_ptr())
    out.discard(0)
    return frozenset(out)


def _can_skip_zip_crc() -> bool:
    return hasattr(torch.serialization, "set_crc32_options") and hasattr(torch.serialization, "get_crc32_options")


def _cpu_storages(obj: Any) -> dict[int, int]:
    """``{address: size}`` of the storages of the CPU tensors in ``obj`` (``torch.save`` writes each in one piece)."""
    out: dict[int, int] = {}

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.device.type == "cpu" and o.layout == torch.strided:
                storage = o.untyped_storage()
                out[storage.data_ptr()] = storage.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    out.pop(0, None)
    return out


def _writes_itself(trainer: Trainer) -> bool:
    """Whether a plain ``torch.save`` on rank 0 is exactly what the strategy would write."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.strategies import Strategy

    io = trainer.strategy.checkpoint_io
    inner = io.inner if isinstance(io, SafeResumeIO) else io
    return type(trainer.strategy).save_checkpoint is Strategy.save_checkpoint and type(inner) is TorchCheckpointIO


def _get_rng() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(state), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = [
            kind,
            torch.from_numpy(np.asarray(keys).astype("int64")),
            int(pos),
            int(has_gauss),
            float(cached),
        ]
    except ImportError:  # pragma: no cover
        pass
    return out


def _set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _slurm_requeue() -> None:
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        job = f"{array_job}_{array_task}"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        log.error("DurableCheckpoint: `scontrol requeue %s` failed: %s", job, err)
        return
    if result.returncode:
        log.error("DurableCheckpoint: `scontrol requeue %s` exited %s: %s", job, result.returncode, result.stderr)
    else:
        log.info("DurableCheckpoint: requeued SLURM job %s", job)
