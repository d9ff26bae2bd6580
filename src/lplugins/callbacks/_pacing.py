"""``Pacer``: continuous checkpointing's rest between saves, so that saving costs at most ``max_slowdown``.

While an asynchronous save is being written, the writing rank's steps may run slower: the snapshot,
the CRC32 and the write compete with training for CPU and memory bandwidth (on a CPU-only machine
whose cores all train; on a GPU machine the step usually does not notice). The pacer times every step
of the writing rank, apart by whether a save was in flight when the step started, and after each
commit lets step boundaries pass without a new save (it *rests*) just long enough that the average
slowdown stays within the budget::

    slowdown while a save is in flight   s = 1 - quiet / busy     (medians of the recent step times)
    cost of one save-and-rest cycle      s * S / (S + R) <= max_slowdown
    so the rest                          R = S * (s / max_slowdown - 1), at least 0

where ``S`` is how long the save took (start to commit). When saving costs nothing (``s <= max_slowdown``)
the rest is zero and a new save starts at the first boundary after each commit. Until a few steps of
each kind have been timed, the pacer rests after a commit only to time steps without a save (and then
rests the measured rest, counted from the commit). Lightning-free.
"""

from __future__ import annotations

import statistics
from collections import deque

from lplugins._log import announce

__all__ = ["Pacer", "announce_continuous"]

#: Steps of each kind (a save in flight or not) timed before the rest follows the measured slowdown.
MIN_SAMPLES = 3


class Pacer:
    """Decides, on the writing rank, whether continuous mode rests at a step boundary (see the module).

    Args:
        max_slowdown: The throughput saving may cost, as a fraction in (0, 1).
        window: How many recent steps of each kind the medians use.

    >>> p = Pacer(0.05)
    >>> for t in range(4):  # quiet steps of 1 s
    ...     p.boundary(float(t), in_flight=False)
    >>> p.started(3.0)  # a save starts at the boundary at 3 s; steps take 2 s while it is written
    >>> for t in (5.0, 7.0, 9.0):
    ...     p.boundary(t, in_flight=True)
    >>> p.boundary(11.0, in_flight=False)  # committed: the save took 8 s and halved the step rate
    >>> round(p.rest(8.0), 1)  # 8 s * (0.5 / 0.05 - 1)
    72.0
    >>> p.resting(11.0 + 71.0), p.resting(11.0 + 72.0)
    (True, False)
    """

    def __init__(self, max_slowdown: float, window: int = 16) -> None:
        self.max_slowdown = max_slowdown
        self._quiet: deque[float] = deque(maxlen=window)
        self._busy: deque[float] = deque(maxlen=window)
        self._last: float | None = None  # when the previous step ended
        self._step_busy = False  # a save was in flight when the step now running started
        self._saving_since: float | None = None  # when the save in flight started
        self._took = 0.0  # how long the last committed save took
        self._committed_at: float | None = None  # when it committed
        self._rest: float | None = None  # the rest after it, once measured
        self._said = False

    def boundary(self, now: float, in_flight: bool) -> None:
        """Time the step that ended at ``now``; ``in_flight``: whether a save is still being written now."""
        if self._last is not None:
            (self._busy if self._step_busy else self._quiet).append(now - self._last)
        self._last = now
        if self._saving_since is not None and not in_flight:  # committed during the step just ended
            self._took, self._committed_at = now - self._saving_since, now
            self._saving_since, self._rest = None, None
        self._step_busy = in_flight

    def started(self, now: float) -> None:
        """A save starts at the boundary at ``now``."""
        self._saving_since = now
        self._step_busy = True

    def resting(self, now: float) -> bool:
        """Whether a continuous save must wait at the boundary at ``now``."""
        if self._saving_since is not None or self._committed_at is None:
            return False
        if len(self._quiet) < MIN_SAMPLES:
            return True  # time steps without a save first
        if len(self._busy) < MIN_SAMPLES:
            return False  # time more steps with one
        if self._rest is None:
            self._rest = self.rest(self._took)
        return now < self._committed_at + self._rest

    def slowdown(self) -> float | None:
        """The fraction of throughput lost while a save is in flight (None: not timed enough yet)."""
        if len(self._quiet) < MIN_SAMPLES or len(self._busy) < MIN_SAMPLES:
            return None
        return max(0.0, 1.0 - statistics.median(self._quiet) / statistics.median(self._busy))

    def rest(self, took: float) -> float:
        """Seconds to rest after a save that took ``took`` seconds (0 while the slowdown is not measured)."""
        slowdown = self.slowdown()
        if slowdown is None:
            return 0.0
        rest = max(0.0, took * (slowdown / self.max_slowdown - 1.0))
        if rest > 0 and not self._said:
            self._said = True
            announce(
                "lplugins: continuous checkpointing: a step takes %.3g s while a save is written and %.3g s"
                " otherwise (a save takes %.3g s), so saves rest %.3g s after each commit to cost at most %.0f%%"
                " of throughput (max_slowdown=%g; None never rests). Re-measured after every save.",
                statistics.median(self._busy),
                statistics.median(self._quiet),
                took,
                rest,
                100 * self.max_slowdown,
                self.max_slowdown,
            )
        return rest


def announce_continuous(dirpath: str | None, keep_last: int | None, max_slowdown: float | None) -> None:
    """Say once, on rank zero, that a ``DurableCheckpoint`` saves continuously, and how it paces its saves."""
    announce(
        "lplugins: DurableCheckpoint(%s) saves continuously: a new asynchronous save starts at the first step"
        " boundary after the previous one has committed (keeping the newest %s), %s.",
        dirpath,
        keep_last,
        "never resting (max_slowdown=None)"
        if max_slowdown is None
        else f"resting between saves as long as keeps their cost within {max_slowdown:g} of throughput (max_slowdown)",
    )
