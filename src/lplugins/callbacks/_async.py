"""Background writing: CPU snapshots and a single writer thread with a bound on saves in flight."""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch


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


class Writer:
    """One background thread that runs write jobs in order, at most ``max_in_flight`` queued or running.

    A job's exception is kept and re-raised by :meth:`raise_error` (called by the training thread at
    the next step) -- never swallowed. After a failure, queued jobs are dropped.

    Args:
        max_in_flight: The most saves queued or running at once; :meth:`submit` waits beyond it.
    """

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self._jobs: deque[Callable[[], None]] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lplugins-checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> float:
        """Queue ``job``; wait while ``max_in_flight`` saves are in flight. Returns the seconds waited."""
        start = time.perf_counter()
        with self._cond:
            while self._in_flight >= self.max_in_flight and self._error is None:
                self._cond.wait()
            self._in_flight += 1
            self._jobs.append(job)
            self._cond.notify_all()
        return time.perf_counter() - start

    @property
    def failed(self) -> bool:
        """Whether a background write failed (and the error was not raised yet)."""
        return self._error is not None

    def raise_error(self) -> None:
        """Re-raise a background failure, once."""
        with self._cond:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def flush(self) -> None:
        """Wait until every queued save is finished (or one failed)."""
        with self._cond:
            while self._in_flight and self._error is None:
                self._cond.wait()

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs[0]
            try:
                job()
            except BaseException as err:  # kept for the training thread
                with self._cond:
                    self._error = err
                    self._in_flight -= len(self._jobs)
                    self._jobs.clear()
                    self._cond.notify_all()
                continue
            with self._cond:
                self._jobs.popleft()
                self._in_flight -= 1
                self._cond.notify_all()
