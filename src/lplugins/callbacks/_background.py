"""``BackgroundQueue``: one thread that runs checkpoint jobs in order, errors kept for the training thread.

The thread runs at a lower CPU priority than training (``nice`` +:data:`WRITER_NICE` for that thread,
and the CRC32 threads it starts, on Linux): a background write takes the cycles training leaves, so on
a machine whose cores all train it slows the write, not the step.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["BackgroundQueue", "WRITER_NICE"]

#: How much lower the writer thread's CPU priority is than the training thread's (0: the same).
WRITER_NICE = 10


def _lower_priority() -> None:
    """Lower this thread's CPU priority by :data:`WRITER_NICE` (Linux: threads have their own nice value)."""
    if not WRITER_NICE or not sys.platform.startswith("linux"):  # elsewhere a thread id is no PRIO_PROCESS id
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
    except OSError:  # not allowed here: the write runs at the training thread's priority
        pass


class BackgroundQueue:
    """One background thread that runs jobs in order (writes, deletes), at most ``max_in_flight`` queued or running.

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

    def wait_for_room(self) -> float:
        """Wait until a :meth:`submit` would not (fewer than ``max_in_flight`` in flight); the seconds waited."""
        start = time.perf_counter()
        with self._cond:
            while self._in_flight >= self.max_in_flight and self._error is None:
                self._cond.wait()
        return time.perf_counter() - start

    @property
    def in_flight(self) -> int:
        """Saves queued or being written now (a save leaves the count once committed, or failed)."""
        with self._cond:
            return self._in_flight

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
        _lower_priority()
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
