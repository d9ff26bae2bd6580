"""Lightning's ``DDPStrategy`` with the lplugins process-group timeout."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy

from lplugins.strategies.timeout import resolve_timeout

__all__ = ["DDPStrategy"]


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` whose process-group timeout comes from lplugins.

    Args:
        timeout: Seconds or a ``timedelta``; default ``LPLUGINS_PG_TIMEOUT``, then 30 minutes.
        **kwargs: Passed to Lightning's ``DDPStrategy``.

    Raises:
        LPluginsError: the timeout is not a positive number of seconds.
    """

    def __init__(self, *, timeout: float | timedelta | None = None, **kwargs: Any) -> None:
        super().__init__(timeout=resolve_timeout(timeout), **kwargs)
