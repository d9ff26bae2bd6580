"""The time limit of each ``ft_ddp`` all-reduce: adaptive, so that no survivor waits out a dead peer.

When a replica group dies in the middle of an all-reduce, gloo reports it only to the groups whose
connection to it breaks. A survivor that was sending to another survivor -- one that has already
failed the step and moved on, without closing its connections -- waits until the collective's
timeout: measured, a 20.4 s stall of every group with ``timeout=20`` (one kill in 50). So each
all-reduce carries its own timeout (gloo's per-operation ``AllreduceOptions.timeout``):

* ``"auto"`` (the default): ``max(2 s, 10 x the median of the last 64 completed all-reduces)``, and the
  strategy's ``timeout`` until 5 have completed; never above ``timeout``;
* a number: that many seconds, fixed.

The first all-reduce in each new quorum runs under the strategy's ``timeout`` all the same: a group
that has just joined may take its first step slowly, and a kill is seen in a quorum that is not new.

A limit that fires on a step that is only slow fails that attempt alone: torchft does not commit it,
and the strategy all-reduces the same gradients again in the next quorum (``step_retries``), so
nothing is lost but the time of a new quorum.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from datetime import timedelta
from typing import Any

from lplugins.strategies._ft_env import FTConfigError

__all__ = ["AllreduceLimit", "bounded_gloo"]

FLOOR_S = 2.0
FACTOR = 10.0
WINDOW = 64
WARM_UP = 5


class AllreduceLimit:
    """How long an all-reduce may take (see the module); learns from the all-reduces that completed.

    >>> limit = AllreduceLimit("auto", cap_s=60.0)
    >>> limit.seconds()  # nothing seen yet: the strategy's timeout
    60.0
    >>> for _ in range(5):
    ...     limit.observe(0.02)
    >>> limit.seconds()  # 10 x 20 ms is below the floor
    2.0
    >>> AllreduceLimit(0.5, cap_s=60.0).seconds()
    0.5
    """

    def __init__(self, setting: float | str, cap_s: float) -> None:
        self.fixed: float | None = None if setting == "auto" else _fixed(setting)
        self.cap_s = cap_s
        self._done: deque[float] = deque(maxlen=WINDOW)

    def observe(self, seconds: float) -> None:
        """An all-reduce that completed, and how long the training thread waited for it."""
        self._done.append(seconds)

    def seconds(self) -> float:
        """The time limit of the next all-reduce, in seconds."""
        if self.fixed is not None:
            return self.fixed
        if len(self._done) < WARM_UP:
            return self.cap_s
        return min(self.cap_s, max(FLOOR_S, FACTOR * statistics.median(self._done)))


def _fixed(setting: Any) -> float:
    number = not isinstance(setting, bool) and isinstance(setting, (int, float))
    if not (number and setting > 0 and math.isfinite(setting)):
        raise FTConfigError(
            f"allreduce_timeout={setting!r} is not allowed: it must be 'auto' (adapts to the all-reduces seen)"
            " or a positive, finite number of seconds."
        )
    return float(setting)


def bounded_gloo(timeout_s: float, limit: AllreduceLimit) -> Any:
    """torchft's reconfigurable gloo process group, each of whose all-reduces carries ``limit.seconds()``."""
    from torch.distributed import AllreduceOptions
    from torchft import ProcessGroupGloo

    class BoundedGloo(ProcessGroupGloo):
        fresh = True  # no all-reduce issued yet in the quorum of the last configure()

        def configure(self, *args: Any, **kwargs: Any) -> None:
            self.fresh = True
            super().configure(*args, **kwargs)

        def _opts_hook(self, opts: Any) -> Any:
            if isinstance(opts, AllreduceOptions):
                opts.timeout = timedelta(seconds=limit.cap_s if self.fresh else limit.seconds())
                self.fresh = False
            return opts

    return BoundedGloo(timeout=timedelta(seconds=timeout_s))
