"""``ShardedAsyncWriter``: every rank snapshots its own shards to reused CPU buffers; torch DCP writes them behind.

For a strategy that saves a torch distributed checkpoint (DCP) directory -- FSDP2 with
``save_distributed_checkpoint=True`` -- the step boundary gathers nothing: each rank copies only its own
local shards (``DTensor.to_local()`` of the parameters and optimizer state) into CPU buffers that are
allocated once and reused by every save (the copies of the parameters and optimizer state run on a second
thread while the next forward and backward run, as :class:`~lplugins.callbacks._async.AsyncWriter`'s do),
and rank 0 also copies the small rest of the checkpoint. A background thread (``nice`` +10) then runs
``torch.distributed.checkpoint.save`` on a gloo process group of its own, created once, so its
collectives never interleave with training's: each rank writes and ``fsync``-s its shard file into the
temporary entry, rank 0 writes the DCP ``.metadata`` once every rank has reported its write, and a failure
on any rank is raised by DCP on every rank. Only then does rank 0 commit with the directory protocol
(temporary entry renamed, per-file CRC32s, marker last, ledger and retention), exactly the layout
``FSDP2Strategy`` writes synchronously (``meta.pt`` beside the DCP files), so resume and resharding load it.

A failure of any rank's background write surfaces at the next step boundary on every rank (the step's
collective carries :meth:`ShardedAsyncWriter.failed`) as :class:`~lplugins.callbacks.CheckpointWriteError`.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from lplugins import _lightning
from lplugins.callbacks._async import BufferPool, DeferredCopy, snapshot
from lplugins.callbacks._background import BackgroundQueue
from lplugins.callbacks._collective import agree_on_failure
from lplugins.callbacks._errors import CheckpointWriteError
from lplugins.callbacks._pacing import Pacer
from lplugins.callbacks._record import TMP_PREFIX, Record
from lplugins.callbacks._retention import Ledger
from lplugins.callbacks._writer import CheckpointWriter

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "CLOSE_WAIT_S",
    "META_FILENAME",
    "PeerWriteError",
    "ShardedAsyncWriter",
    "local_shards",
    "rewrap",
    "storage_writer",
]

#: The file beside the DCP files with the rest of the checkpoint (Lightning's ``ModelParallelStrategy`` name).
META_FILENAME = "meta.pt"

#: How long :meth:`ShardedAsyncWriter.close` waits for saves still in flight (they need every rank).
CLOSE_WAIT_S = 30.0


class PeerWriteError(CheckpointWriteError):
    """This rank's part of a save was fine; another rank's failed (its own error names the cause)."""


def storage_writer(path: str) -> Any:
    """The DCP writer of one save: one file per rank, each ``fsync``-ed before the rank reports it written."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    return FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)


def _is_dtensor(obj: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


def local_shards(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its local shard (a view of the live storage: nothing is copied)."""
    if _is_dtensor(obj):
        with torch.no_grad():
            return obj.to_local()
    if isinstance(obj, dict):
        return {k: local_shards(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_shards(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(local_shards(v) for v in obj)
    return obj


def rewrap(original: Any, staged: Any) -> Any:
    """``staged`` (a snapshot of ``local_shards(original)``) with each shard wrapped as ``original``'s DTensor was.

    The wrapper reuses the original's sharding spec as it is: the staged shard stays in CPU memory (where
    ``DTensor.from_local`` would move it to the mesh's device) and no collective runs.
    """
    if _is_dtensor(original):
        from torch.distributed.tensor import DTensor

        return DTensor(staged, original._spec, requires_grad=False)
    if isinstance(original, dict):
        return {k: rewrap(v, staged[k]) for k, v in original.items()}
    if isinstance(original, (list, tuple)) and not hasattr(original, "_fields"):
        out = [rewrap(o, s) for o, s in zip(original, staged, strict=True)]
        return tuple(out) if isinstance(original, tuple) else out
    return staged


def _stable_shards(trainer: Trainer) -> frozenset[int]:
    """Storage addresses of this rank's CPU shards of the parameters and optimizer state (changed only by a step)."""
    tensors: list[torch.Tensor] = list(trainer.lightning_module.parameters())
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    out: set[int] = set()
    for t in tensors:
        local = local_shards(t)
        if local.device.type == "cpu":
            out.add(local.untyped_storage().data_ptr())
    out.discard(0)
    return frozenset(out)


class ShardedAsyncWriter(CheckpointWriter):
    """Every rank snapshots its shards; DCP writes them on a background thread; rank 0 commits (see the module).

    Args:
        ledger: The directory's committed checkpoints.
        crc32: Keep each file's CRC32 in the commit marker.
        max_in_flight: The most saves queued or being written; a save beyond it waits for the oldest.
        writes: Whether this rank commits (rank 0); every rank writes its own shards.
        max_slowdown: Continuous mode's budget (rank 0's :class:`~lplugins.callbacks._pacing.Pacer`). None: no rest.
    """

    def __init__(
        self, ledger: Ledger, crc32: bool, max_in_flight: int, writes: bool, max_slowdown: float | None = None
    ) -> None:
        super().__init__(ledger, crc32)
        self._commits = writes
        self._queue: BackgroundQueue | None = BackgroundQueue(max_in_flight)
        self._pacer = Pacer(max_slowdown) if writes and max_slowdown is not None else None
        self._pool: BufferPool | None = BufferPool(max_in_flight)
        self._copy: DeferredCopy | None = None
        self._eager = False
        self._group: Any = None  # the background thread's own gloo group (created in describe, on every rank)
        self._closed = False  # close() gave up waiting: a save still in flight must not commit any more
        #: The CPU buffers of the last snapshot, in traversal order (what the next save reuses).
        self.last_buffers: list[torch.Tensor] = []

    def describe(self, trainer: Trainer) -> CheckpointWriter:
        """Also create the writer's gloo process group (a collective: every rank calls it, in ``setup``)."""
        super().describe(trainer)
        if self._group is None and dist.is_available() and dist.is_initialized():
            timeout = _lightning.strategy_timeout(trainer.strategy)  # FSDP2Strategy's (LPLUGINS_PG_TIMEOUT)
            self._group = dist.new_group(backend="gloo", timeout=timeout if isinstance(timeout, timedelta) else None)
        return self

    def save(self, trainer: Trainer, checkpoint: dict[str, Any], record: Record) -> None:
        if self._queue is None or self._pool is None:
            return
        # what Lightning's ModelParallelStrategy.save_checkpoint writes: the DCP part and meta.pt
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        # the buffers of a finished save are free again (with one save in flight at most: the last save's)
        self._queue.wait_for_room()
        used: list[torch.Tensor] = []
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        stable = frozenset() if self._eager else _stable_shards(trainer)
        # one traversal for both parts, so the buffers line up with the same tensors at every save
        parts = {"dcp": local_shards(converted), "meta": checkpoint if self._commits else {}}
        staged = snapshot(parts, self._pool.take(), used, defer=stable, deferred=pairs)
        shards = rewrap(converted, staged["dcp"])
        meta = staged["meta"]
        del checkpoint, converted, parts, staged
        self.last_buffers = used
        copy = DeferredCopy(pairs)
        pool, group = self._pool, self._group
        tmp = TMP_PREFIX + record.name

        def job() -> None:
            try:
                self._write(copy, shards, meta, tmp, record, group)
            finally:
                shards.clear()
                meta.clear()
                pool.give(used)

        self._copy = copy
        if self._pacer is not None:
            self._pacer.started(time.monotonic())
        self._queue.submit(job)

    def _write(self, copy: DeferredCopy, shards: Any, meta: Any, tmp: str, record: Record, group: Any) -> None:
        """The background job of one save, on every rank (the collectives run on the writer's own group)."""
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        storage = self.storage
        error: BaseException | None = None
        try:
            intact = copy.result()
            if intact and self._commits:
                storage.mkdir(tmp)
                with storage.open_write(f"{tmp}/{META_FILENAME}") as f:
                    torch.save(meta, f)
                    f.flush()
                    storage.sync_file(f)
        except Exception as err:
            intact, error = False, err
        try:
            # every rank learns whether any rank's snapshot was torn or its part failed (none then enters the
            # save), and that all write the same save: the step's MAX and the MAX of its negation must agree
            step = int(record.global_step)
            flags = torch.tensor([int(not intact), int(error is not None), step, -step], dtype=torch.int64)
            if group is not None:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            if error is not None or flags[1]:
                raise error or PeerWriteError(f"Writing checkpoint {record.name} failed on another rank.")
            if int(flags[2]) != -int(flags[3]):
                raise CheckpointWriteError(
                    f"The ranks' background writers reached different saves (steps {-int(flags[3])} to"
                    f" {int(flags[2])}) for {record.name}; nothing of it is committed."
                )
            if flags[0]:
                if self._commits:
                    storage.remove(tmp)
                return  # a torn snapshot (said on that rank): dropped on every rank, nothing committed
            # each rank writes and fsyncs its shards; rank 0 writes .metadata after all have; an error anywhere
            # is raised on every rank
            dcp_save(shards, storage_writer=storage_writer(storage.path(tmp)), process_group=group)
            self._commit(tmp, record, group)
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            if self._commits:
                storage.remove(tmp)
            if isinstance(err, CheckpointWriteError):
                raise
            raise self.write_error(storage.path(record.name), err) from err

    def _commit(self, tmp: str, record: Record, group: Any) -> None:
        """Rank 0 commits; every rank learns whether it did, so all fail on the same save (their queues stay paired)."""
        error: BaseException | None = None
        if self._commits:
            if self._closed:
                error = CheckpointWriteError(
                    f"{record.name} was still being written when the fit ended; not committed."
                )
            else:
                try:
                    self.storage.fsync_tree(tmp)  # the directory entries too (DCP fsynced each file it wrote)
                    self.commit_entry(tmp, record, mapped=False)  # no file pages resident beside the training state
                except Exception as err:
                    error = err
        failed = torch.tensor([int(error is not None)], dtype=torch.int64)
        if group is not None:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        if error is not None:
            raise error
        if failed[0]:
            raise PeerWriteError(f"Committing checkpoint {record.name} failed on rank 0.")

    def complete_snapshot(self) -> float | None:
        copy, self._copy = self._copy, None
        if copy is None:
            return None
        waited, intact = copy.complete()
        if not intact and not self._eager:
            self._eager = True
            warnings.warn(  # on the rank that saw it: every rank drops that checkpoint
                "DurableCheckpoint(async_save=True): parameters or optimizer state changed in place before the"
                " optimizer step that followed a save (outside optimizer.step()); that checkpoint was dropped,"
                " and from now on snapshots are copied before training goes on.",
                stacklevel=2,
            )
        return waited

    def failed(self) -> bool:
        return self._queue is not None and self._queue.failed

    def busy(self) -> bool:
        """Whether a save is in flight here, or rank 0 rests in continuous mode (once per step boundary)."""
        in_flight = self._queue is not None and self._queue.in_flight > 0
        if self._pacer is None:
            return in_flight
        now = time.monotonic()
        self._pacer.boundary(now, in_flight)
        return in_flight or self._pacer.resting(now)

    def raise_failure(self) -> NoReturn:
        if self._queue is not None and self._queue.failed:
            queue, self._queue = self._queue, None
            try:
                queue.raise_error()
            finally:
                queue.close()
        raise CheckpointWriteError("A background checkpoint write failed on another rank (see its error).")

    def finish(self, trainer: Trainer) -> None:
        """As every writer's, except that a save that failed only because another rank's part did is not this
        rank's failure: the rank whose part failed is the one named on every rank."""
        self.flush()
        self.ledger.flush()
        error: BaseException | None = None
        if self.failed():
            try:
                self.raise_failure()
            except PeerWriteError:
                error = None
            except BaseException as err:
                error = err
        agree_on_failure(trainer, error, "a background checkpoint write")

    def flush(self) -> None:
        if self._queue is not None:
            self._queue.flush()

    def close(self) -> None:
        """Write what was snapshotted (errors were or will be reported), then release the buffers and the group.

        Saves still in flight here (after an exception: ``finish`` ran otherwise) need every rank's writer: they
        get :data:`CLOSE_WAIT_S` seconds, then are left to their (daemon) thread, uncommitted.
        """
        self.complete_snapshot()
        queue, self._queue = self._queue, None
        drained = True
        if queue is not None:
            deadline = time.monotonic() + CLOSE_WAIT_S
            while queue.in_flight and not queue.failed and time.monotonic() < deadline:
                time.sleep(0.05)
            drained = not queue.in_flight or queue.failed
            if drained:
                queue.close()
            else:
                self._closed = True  # the directory's claim and ledger are released after this
        self._pool = None
        self.last_buffers = []
        group, self._group = self._group, None
        if drained and group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception:  # already gone with the default group
                pass
