"""Background writing: CPU snapshots and a single writer thread with a bound on saves in flight."""

from __future__ import annotations

import copy
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch


def snapshot(obj: Any, buffers: list[torch.Tensor] | None = None, used: list[torch.Tensor] | None = None) -> Any:
    """A deep copy of a checkpoint dict with every tensor copied to CPU memory.

    Containers are rebuilt, tensors are copied (so training may change the originals right away), and
    other leaves are deep-copied.

    Args:
        obj: The checkpoint (or any part of it).
        buffers: CPU tensors from an earlier snapshot of the same structure, reused in traversal order
            where shape, dtype and strides match (``copy_`` into memory that is already mapped is
            several times faster than allocating).
        used: Receives the tensors of the new snapshot, in traversal order (to reuse them next time).
    """
    pool = iter(buffers or ())
    out_used: list[torch.Tensor] = [] if used is None else used

    def copy_tensor(t: torch.Tensor) -> torch.Tensor:
        src = t.detach()
        buf = next(pool, None)
        if (
            buf is not None
            and buf.shape == src.shape
            and buf.dtype == src.dtype
            and buf.stride() == src.stride()
            and src.layout == torch.strided
        ):
            buf.copy_(src)
        else:
            buf = src.to("cpu", copy=True)
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
        import time

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
