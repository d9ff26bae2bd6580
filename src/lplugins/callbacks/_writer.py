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

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NoReturn

from lplugins.callbacks._collective import any_rank
from lplugins.callbacks._errors import CheckpointWriteError
from lplugins.callbacks._record import TMP_PREFIX, Record, now
from lplugins.callbacks._resume import SafeResumeIO
from lplugins.callbacks._retention import Ledger
from lplugins.callbacks._serialization import can_skip_zip_crc, cpu_storages, torch_save

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["CheckpointWriter", "StrategyWriter", "SyncWriter", "writes_itself"]


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

    @abstractmethod
    def save(self, trainer: Trainer, checkpoint: dict[str, Any], record: Record) -> None:
        """Write ``checkpoint`` as ``record.name`` and commit it (or queue that).

        Raises:
            CheckpointWriteError: on every rank, when the write failed on any rank.
        """

    def failed(self) -> bool:
        """Whether a background write failed on this rank (not reported yet)."""
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
        """Finish every save in flight (and retention's deletes); report a background failure on all ranks."""
        self.flush()
        self.ledger.flush()
        if any_rank(trainer, self.failed()):
            self.raise_failure()

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
            record.crc32 = storage.write_stream(
                record.name, lambda stream: torch_save(checkpoint, stream), self.crc32, cpu_storages(checkpoint)
            )
            record.zip_crc = not can_skip_zip_crc()
            record.size = storage.size(record.name)
            record.time, record.seq = now(), self.ledger.next_seq()
            storage.commit(record)
        except Exception as err:  # OSError, or torch's RuntimeError from a failed stream write
            storage.remove(record.name)  # the rename happened but the marker did not: leftover, not visible
            raise self.write_error(path, err) from err
        self.ledger.add(record)

    def write_error(self, path: str, err: Exception) -> CheckpointWriteError:
        """The error for a failed write of ``path``: what failed, and which checkpoints are intact."""
        intact = self.ledger.names()
        reason = getattr(err, "strerror", None) or (str(err).splitlines()[-1] if str(err) else "no message")
        return CheckpointWriteError(
            f"Writing checkpoint {path} failed ({type(err).__name__}: {reason}). The previous checkpoints are"
            f" intact: {intact or 'none'}"
        )

    def agree_or_raise(
        self, trainer: Trainer, error: BaseException | None, record: Record, cleanup: str | None = None
    ) -> None:
        """All ranks learn whether any rank failed; all raise together (no rank is left in a collective)."""
        if not any_rank(trainer, error is not None):
            return
        if cleanup is not None and trainer.is_global_zero:
            self.storage.remove(cleanup)
        if error is not None:
            raise error
        raise CheckpointWriteError(f"Saving checkpoint {record.name} failed on another rank (see its error).")


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
                if storage.isdir(tmp):
                    record.kind, record.files = "dir", storage.tree_sizes(tmp)
                else:
                    record.size = storage.size(tmp)
                storage.rename(tmp, record.name, sync_dir=False)
                record.time, record.seq = now(), self.ledger.next_seq()
                storage.commit(record)
            except Exception as err:
                storage.remove(tmp)
                storage.remove(record.name)
                error = self.write_error(storage.path(record.name), err)
        self.agree_or_raise(trainer, error, record)
        if trainer.is_global_zero:
            self.ledger.add(record)


def writes_itself(trainer: Trainer) -> bool:
    """Whether a plain ``torch.save`` on rank 0 is exactly what the strategy would write."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.strategies import Strategy

    io = trainer.strategy.checkpoint_io
    inner = io.inner if isinstance(io, SafeResumeIO) else io
    return type(trainer.strategy).save_checkpoint is Strategy.save_checkpoint and type(inner) is TorchCheckpointIO
