"""``AsyncWriter``: saves snapshotted to CPU memory and written on a background thread, a bound on saves in flight.

The snapshot copies the parameters and optimizer state (which change only in the optimizer step) on
a second thread while the next forward and backward run (:class:`DeferredCopy`); the callback calls
:meth:`AsyncWriter.complete_snapshot` before the next optimizer step. Everything else is copied at
the save. Only rank 0 writes (a plain ``torch.save`` of the whole state, see :func:`writes_itself`).
"""

from __future__ import annotations

import copy
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lplugins.callbacks._background import BackgroundQueue
from lplugins.callbacks._errors import CheckpointWriteError
from lplugins.callbacks._pacing import Pacer
from lplugins.callbacks._record import Record
from lplugins.callbacks._retention import Ledger
from lplugins.callbacks._writer import CheckpointWriter

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["AsyncWriter", "BufferPool", "DeferredCopy", "snapshot", "stable_storages"]


def snapshot(
    obj: Any,
    buffers: list[torch.Tensor] | None = None,
    used: list[torch.Tensor] | None = None,
    defer: frozenset[int] = frozenset(),
    deferred: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Any:
    """A deep copy of a checkpoint dict with every tensor copied to CPU memory.

    Containers are rebuilt, tensors are copied (so training may change the originals right away), and
    other leaves are deep-copied -- except the copies of tensors in ``defer``, which are left to a
    :class:`DeferredCopy`.

    Args:
        obj: The checkpoint (or any part of it).
        buffers: CPU tensors from an earlier snapshot of the same structure, reused in traversal order
            where shape, dtype and strides match (``copy_`` into memory that is already mapped is
            several times faster than allocating).
        used: Receives the tensors of the new snapshot, in traversal order (to reuse them next time).
        defer: Storage addresses of contiguous CPU tensors whose copy may wait (parameters and
            optimizer state, which change only in the optimizer step): their buffer is allocated but
            not filled; ``(buffer, source)`` goes to ``deferred``.
        deferred: Receives the copies left to do.
    """
    pool = iter(buffers or ())
    out_used: list[torch.Tensor] = [] if used is None else used

    def copy_tensor(t: torch.Tensor) -> torch.Tensor:
        src = t.detach()
        buf = next(pool, None)
        later = (
            deferred is not None
            and src.device.type == "cpu"
            and src.layout == torch.strided
            and src.is_contiguous()
            and not src.is_inference()  # no version counter to check
            and src.untyped_storage().data_ptr() in defer
        )
        if not (
            buf is not None
            and buf.shape == src.shape
            and buf.dtype == src.dtype
            and buf.stride() == src.stride()
            and src.layout == torch.strided
        ):
            buf = torch.empty(src.shape, dtype=src.dtype) if later else src.to("cpu", copy=True)
            if later:
                assert deferred is not None
                deferred.append((buf, src))
        elif later:
            assert deferred is not None
            deferred.append((buf, src))
        else:
            buf.copy_(src)
        out_used.append(buf)
        return buf

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return copy_tensor(o)
        if isinstance(o, dict):
            out = copy.copy(o)  # keeps the dict's type (OrderedDict, AttributeDict, ...)
            for k, v in o.items():
                out[k] = walk(v)
            return out
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple) and not hasattr(o, "_fields"):
            return tuple(walk(v) for v in o)
        if isinstance(o, (str, bytes, int, float, bool, type(None))):
            return o
        return copy.deepcopy(o)

    return walk(obj)


class DeferredCopy:
    """Copies of tensors made on a background thread while training goes on, completed at a barrier.

    The sources must not change before :meth:`complete` (the caller puts the barrier in front of the
    optimizer step). :meth:`complete` also compares every source's version counter with its value at
    the start: an in-place change in between (user code outside ``optimizer.step()``) marks the copy
    as torn, and the writer drops it instead of writing a mix of two states.

    Args:
        pairs: ``(destination, source)`` tensors, both on CPU with the same shape and dtype.
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._pairs = pairs
        self._versions = [src._version for _, src in pairs]
        self._done = threading.Event()
        self._intact = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if pairs:
            self._thread = threading.Thread(target=self._run, name="lplugins-checkpoint-snapshot", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            with torch.no_grad():
                for dst, src in self._pairs:
                    dst.copy_(src)
        except BaseException as err:  # reported by the writer
            self._error = err

    @property
    def completed(self) -> bool:
        """Whether :meth:`complete` ran."""
        return self._done.is_set()

    def complete(self) -> tuple[float, bool]:
        """Wait for the copies (training thread); return ``(seconds waited, intact)``. Idempotent."""
        if self._done.is_set():
            return 0.0, self._intact
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        waited = time.perf_counter() - start
        self._intact = self._error is None and all(
            src._version == version for (_, src), version in zip(self._pairs, self._versions, strict=True)
        )
        self._pairs = []  # no references to the live tensors
        self._done.set()
        return waited, self._intact

    def result(self) -> bool:
        """Wait for :meth:`complete` (writer thread); raise the copy's error; whether the copy is intact."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._intact


class BufferPool:
    """CPU buffers of finished snapshots, handed to the next snapshot (at most ``size`` sets kept)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[list[torch.Tensor]] = []
        self._lock = threading.Lock()

    def take(self) -> list[torch.Tensor] | None:
        """A free set of buffers, or None."""
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Return a set whose write is finished."""
        with self._lock:
            if len(self._free) < self.size:
                self._free.append(buffers)


def stable_storages(trainer: Trainer) -> frozenset[int]:
    """Storage addresses of the CPU parameters and optimizer state: they change only in the optimizer step."""
    out: set[int] = set()
    tensors: list[torch.Tensor] = list(trainer.lightning_module.parameters())
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    for t in tensors:
        if t.device.type == "cpu":
            try:
                out.add(t.untyped_storage().data_ptr())
            except RuntimeError:  # no storage of its own (a DTensor: FSDP2 saves a gathered copy instead)
                pass
    out.discard(0)
    return frozenset(out)


class AsyncWriter(CheckpointWriter):
    """Rank 0 snapshots each save to CPU memory and writes it on a background thread.

    A background failure is kept until the next step boundary, where every rank learns of it (the
    callback's step-boundary collective carries :meth:`failed`) and raises.

    Args:
        ledger: The directory's committed checkpoints.
        crc32: Compute the CRC32 of the files while writing them.
        max_in_flight: The most saves queued or being written; a save beyond it waits for the oldest.
        writes: Whether this rank writes (rank 0); other ranks only take part in the collectives.
        max_slowdown: Continuous mode's budget (:class:`~lplugins.callbacks._pacing.Pacer`): :meth:`busy` is
            also true while resting after a commit. None: no rest.
    """

    def __init__(
        self, ledger: Ledger, crc32: bool, max_in_flight: int, writes: bool, max_slowdown: float | None = None
    ) -> None:
        super().__init__(ledger, crc32)
        self._queue = BackgroundQueue(max_in_flight) if writes else None
        self._pacer = Pacer(max_slowdown) if writes and max_slowdown is not None else None
        self._pool: BufferPool | None = BufferPool(1) if writes else None
        self._copy: DeferredCopy | None = None
        self._eager = False

    def save(self, trainer: Trainer, checkpoint: dict[str, Any], record: Record) -> None:
        if self._queue is None or self._pool is None:
            return
        used: list[torch.Tensor] = []
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        stable = frozenset() if self._eager else stable_storages(trainer)
        data = snapshot(checkpoint, self._pool.take(), used, defer=stable, deferred=pairs)
        del checkpoint
        pool = self._pool
        copy = DeferredCopy(pairs)

        def job() -> None:
            try:
                if copy.result():
                    self.write_file(record, data)
            finally:
                data.clear()
                pool.give(used)

        self._copy = copy
        if self._pacer is not None:
            self._pacer.started(time.monotonic())
        self._queue.submit(job)

    def complete_snapshot(self) -> float | None:
        copy, self._copy = self._copy, None
        if copy is None:
            return None
        waited, intact = copy.complete()
        if not intact and not self._eager:
            self._eager = True
            rank_zero_warn(
                "DurableCheckpoint(async_save=True): parameters or optimizer state changed in place before the"
                " optimizer step that followed a save (outside optimizer.step()); that checkpoint was dropped,"
                " and from now on snapshots are copied before training goes on."
            )
        return waited

    def failed(self) -> bool:
        return self._queue is not None and self._queue.failed

    def busy(self) -> bool:
        """Whether a save is in flight, or continuous mode rests (called once per step boundary)."""
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
        raise CheckpointWriteError("A background checkpoint write failed on rank 0 (see its error).")

    def flush(self) -> None:
        if self._queue is not None:
            self._queue.flush()

    def close(self) -> None:
        self.complete_snapshot()
        if self._queue is not None:
            queue, self._queue = self._queue, None
            queue.close()  # commit what was already snapshotted; errors were or will be reported
        self._pool = None  # the CPU copies of the state
