"""How a checkpoint reaches storage: one :class:`CheckpointWriter` interface, written three ways.

* :class:`SyncWriter` -- rank 0 streams the checkpoint to a file and commits it, while all ranks wait;
* :class:`~lplugins.callbacks._async.AsyncWriter` -- rank 0 snapshots it to CPU memory and writes it
  on a background thread (errors surface at the next step boundary, on every rank);
* :class:`StrategyWriter` -- the strategy writes it (each rank its shards: DeepSpeed, FSDP), into a
  temporary directory that rank 0 renames and commits.

Every write either commits (marker last) or raises :class:`CheckpointWriteError` on *all* ranks
together, so no rank is left waiting in a collective; the checkpoints committed before stay intact.
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NoReturn

from lplugins.callbacks._collective import agree_on_failure
from lplugins.callbacks._errors import CheckpointConfigError, CheckpointWriteError
from lplugins.callbacks._record import TMP_PREFIX, Record, now
from lplugins.callbacks._resume import SafeResumeIO
from lplugins.callbacks._retention import Ledger
from lplugins.callbacks._serialization import can_skip_zip_crc, cpu_storages, torch_save
from lplugins.callbacks._storage import Storage
from lplugins.callbacks._verify import crc32_of

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "CheckpointWriter",
    "StrategyWriter",
    "SyncWriter",
    "refuse_continuous",
    "saves_shards_async",
    "writes_itself",
]


class CheckpointWriter(ABC):
    """Writes and commits checkpoints into one directory; commits go to the ledger (which applies retention).

    All ranks call :meth:`save` and :meth:`finish` together; the other methods are local.

    Args:
        ledger: The directory's committed checkpoints.
        crc32: Compute the CRC32 of file checkpoints while writing them.
    """

    def __init__(self, ledger: Ledger, crc32: bool) -> None:
        self.ledger = ledger
        self.storage = ledger.storage
        self.crc32 = crc32
        #: What every commit marker records about the run that saved it (set by :meth:`describe`).
        self.world_size = 0
        self.strategy = ""

    def describe(self, trainer: Trainer) -> CheckpointWriter:
        """Record ``trainer``'s world size and strategy class in every marker from now on."""
        self.world_size = trainer.world_size
        self.strategy = type(trainer.strategy).__name__
        return self

    @abstractmethod
    def save(self, trainer: Trainer, checkpoint: dict[str, Any], record: Record) -> None:
        """Write ``checkpoint`` as ``record.name`` and commit it (or queue that).

        Raises:
            CheckpointWriteError: on every rank, when the write failed on any rank.
        """

    def failed(self) -> bool:
        """Whether a background write failed on this rank (not reported yet)."""
        return False

    def busy(self) -> bool:
        """Whether a save of this rank's is still being written (or continuous mode rests); a sync writer never is."""
        return False

    def raise_failure(self) -> NoReturn:
        """Raise the background failure some rank had (this rank's own error, if it was this rank)."""
        raise CheckpointWriteError("A background checkpoint write failed on rank 0 (see its error).")

    def complete_snapshot(self) -> float | None:
        """Finish copying the state a save still reads, before training changes it; the seconds waited."""
        return None

    def flush(self) -> None:  # noqa: B027 -- nothing in flight unless the writer has a background thread
        """Wait for the writes in flight on this rank."""

    def finish(self, trainer: Trainer) -> None:
        """Finish every save in flight (and retention's deletes); report a background failure on all ranks.

        The agreement is out of band (:func:`~lplugins.callbacks._collective.agree_on_failure`): the rank
        whose write failed raises its error, the others a :class:`CheckpointWriteError` carrying it.
        """
        self.flush()
        self.ledger.flush()
        error: BaseException | None = None
        if self.failed():
            try:
                self.raise_failure()
            except BaseException as err:
                error = err
        agree_on_failure(trainer, error, "a background checkpoint write")

    def close(self) -> None:  # noqa: B027 -- nothing to stop unless the writer has a background thread
        """Commit what is queued, then stop any background thread (after an exception: no collective)."""

    # --- shared by the writers -----------------------------------------------------------------
    def write_file(self, record: Record, checkpoint: dict[str, Any]) -> None:
        """Stream ``checkpoint`` to the file ``record.name``, then commit it (the marker last).

        Raises:
            CheckpointWriteError: the write failed; nothing of it is visible.
        """
        storage = self.storage
        path = storage.path(record.name)
        try:
            # without the file's CRC32, torch's per-record CRC32s are kept: a resume can still check every byte
            record.crc32 = storage.write_stream(
                record.name,
                lambda stream: torch_save(checkpoint, stream, skip_zip_crc=self.crc32),
                self.crc32,
                cpu_storages(checkpoint),
            )
            record.zip_crc = not (self.crc32 and can_skip_zip_crc())
            record.world_size, record.strategy = self.world_size, self.strategy
            record.size = storage.size(record.name)
            record.time, record.seq = now(), self.ledger.next_seq()
            storage.commit(record)
        except Exception as err:  # OSError, or torch's RuntimeError from a failed stream write
            storage.remove(record.name)  # the rename happened but the marker did not: leftover, not visible
            raise self.write_error(path, err) from err
        self.ledger.add(record)

    def commit_entry(self, tmp: str, record: Record, add: bool = True, mapped: bool = True) -> None:
        """Commit the written (and ``fsync``-ed) temporary entry ``tmp`` as ``record.name`` (rank 0).

        Its files' sizes and CRC32s go into the marker (``mapped``: see :func:`tree_crc32s`), the entry is
        renamed, the marker written last; ``add``: the ledger learns of it (retention).

        Raises:
            CheckpointWriteError: the commit failed; neither ``tmp`` nor ``record.name`` is left.
        """
        storage = self.storage
        try:
            record.world_size, record.strategy = self.world_size, self.strategy
            if storage.isdir(tmp):
                record.kind, record.files = "dir", storage.tree_sizes(tmp)
                if self.crc32:
                    record.crcs = tree_crc32s(storage, tmp, list(record.files), mapped)
            else:
                record.size = storage.size(tmp)
                if self.crc32:
                    record.crc32 = storage.file_crc32(tmp)
            storage.rename(tmp, record.name, sync_dir=False)
            record.time, record.seq = now(), self.ledger.next_seq()
            storage.commit(record)
        except Exception as err:
            storage.remove(tmp)
            storage.remove(record.name)
            raise self.write_error(storage.path(record.name), err) from err
        if add:
            self.ledger.add(record)

    def write_error(self, path: str, err: BaseException) -> CheckpointWriteError:
        """The error for a failed write of ``path``: what failed, and which checkpoints are intact.

        When the failure comes from the operating system (anywhere in the exception chain: torch reports a
        full disk as ``unexpected pos ...`` with the ``OSError`` chained), its message and the path come
        first, e.g. ``No space left on device: /ckpts/step=...ckpt``, and the error carries its ``errno``.
        """
        intact = self.ledger.names()
        os_error = _os_error_in(err)
        if os_error is not None:
            reason = os_error.strerror or str(os_error)
            hint = (
                " Free space there (or lower keep_last) and restart."
                if os_error.errno in (errno.ENOSPC, errno.EDQUOT)
                else ""
            )
            error = CheckpointWriteError(
                f"{reason}: {path} (writing the checkpoint failed: {type(os_error).__name__}"
                f" [Errno {os_error.errno}]).{hint} The previous checkpoints are intact: {intact or 'none'}"
            )
            error.errno = os_error.errno  # (strerror and filename stay unset: str() is the message above)
            return error
        reason = str(err).splitlines()[-1] if str(err) else "no message"
        return CheckpointWriteError(
            f"Writing checkpoint {path} failed ({type(err).__name__}: {reason}). The previous checkpoints are"
            f" intact: {intact or 'none'}"
        )

    def agree_or_raise(
        self, trainer: Trainer, error: BaseException | None, record: Record, cleanup: str | None = None
    ) -> None:
        """All ranks learn whether any rank failed; all raise together, every rank with the real error.

        Out of band (the process group's store, :func:`~lplugins.callbacks._collective.agree_on_failure`):
        it cannot pair with a collective the strategy runs inside its save, so a rank stuck in one
        (DeepSpeed's final barrier, when rank 0's part raised) does not hang the job.
        """
        try:
            agree_on_failure(trainer, error, f"saving checkpoint {record.name}")
        except BaseException:
            if cleanup is not None and trainer.is_global_zero:
                self.storage.remove(cleanup)
            raise


class SyncWriter(CheckpointWriter):
    """Rank 0 writes the file and commits it before training goes on."""

    def save(self, trainer: Trainer, checkpoint: dict[str, Any], record: Record) -> None:
        error: BaseException | None = None
        if trainer.is_global_zero:
            try:
                self.write_file(record, checkpoint)
            except BaseException as err:
                error = err
        self.agree_or_raise(trainer, error, record)


class StrategyWriter(CheckpointWriter):
    """The strategy writes (each rank its shards) into a temporary entry; rank 0 renames and commits it."""

    def save(self, trainer: Trainer, checkpoint: dict[str, Any], record: Record) -> None:
        storage = self.storage
        tmp = TMP_PREFIX + record.name  # the same name on every rank: the strategy writes its shards into it
        error: BaseException | None = None
        try:
            trainer.strategy.save_checkpoint(checkpoint, storage.path(tmp))
            if storage.exists(tmp):
                storage.fsync_tree(tmp)  # every rank syncs what it wrote (its shards, on a shared filesystem)
        except Exception as err:
            error = self.write_error(storage.path(record.name), err)
        self.agree_or_raise(trainer, error, record, cleanup=tmp)
        if trainer.is_global_zero:
            try:
                self.commit_entry(tmp, record, add=False)
            except CheckpointWriteError as err:
                error = err
        self.agree_or_raise(trainer, error, record)
        if trainer.is_global_zero:
            self.ledger.add(record)


def tree_crc32s(storage: Storage, top: str, files: list[str], mapped: bool = True) -> dict[str, int]:
    """The CRC32 of each of ``files`` under directory ``top``, hashed on up to 4 threads (zlib releases the GIL).

    ``mapped=False`` reads them in pieces instead of memory-mapping them: a background commit then adds no
    resident pages of the files to the process (a mapped file's pages count as its memory while hashed).
    """
    workers = max(1, min(4, len(files), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="lplugins-checkpoint-crc32") as pool:
        crcs = list(pool.map(lambda rel: crc32_of(storage, f"{top}/{rel}", threads=1, map_file=mapped), files))
    return dict(zip(files, crcs, strict=True))


def _os_error_in(err: BaseException) -> OSError | None:
    """The first ``OSError`` with an ``errno`` in ``err``'s chain (itself, ``__cause__``, then ``__context__``)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        current = current.__cause__ or current.__context__
    return None


def writes_itself(trainer: Trainer) -> bool:
    """Whether a plain ``torch.save`` on rank 0 is exactly what the strategy would write.

    True for a strategy that keeps Lightning's ``Strategy.save_checkpoint``, and for one that says so with a
    true ``writes_one_file_on_rank_zero`` attribute (:class:`~lplugins.strategies.FSDP2Strategy` with its
    default full-state checkpoints: the state is gathered to rank 0, which saves it as one file); either with
    Lightning's own ``TorchCheckpointIO``.
    """
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.strategies import Strategy

    strategy = trainer.strategy
    io = strategy.checkpoint_io
    inner = io.inner if isinstance(io, SafeResumeIO) else io
    plain = type(strategy).save_checkpoint is Strategy.save_checkpoint
    return (plain or getattr(strategy, "writes_one_file_on_rank_zero", False) is True) and type(
        inner
    ) is TorchCheckpointIO


def saves_shards_async(trainer: Trainer) -> bool:
    """Whether every rank may snapshot its own shards and write them in the background as a DCP directory.

    True for a strategy that says so with a true ``saves_dcp_shards`` attribute
    (:class:`~lplugins.strategies.FSDP2Strategy` with ``save_distributed_checkpoint=True``: its synchronous save
    is Lightning's ``ModelParallelStrategy`` layout, which :mod:`~lplugins.callbacks._sharded_async` writes too).
    """
    return getattr(trainer.strategy, "saves_dcp_shards", False) is True


def refuse_continuous(trainer: Trainer) -> None:
    """Raise :class:`CheckpointConfigError` for ``continuous=True`` when the strategy writes its own checkpoints
    synchronously (a sharded strategy whose shards are written in the background is not refused)."""
    if not writes_itself(trainer) and not saves_shards_async(trainer):
        raise CheckpointConfigError(
            f"DurableCheckpoint(continuous=True): {type(trainer.strategy).__name__} (or its checkpoint_io) writes"
            " its own checkpoints, synchronously, so a save at every chance would stall every step. Use"
            " every_n_steps or every_n_seconds with it, or a strategy whose checkpoint rank 0 writes (DDP), or FSDP2"
            " whose shards every rank writes in the background (FSDP2Strategy(save_distributed_checkpoint=True))."
        )
