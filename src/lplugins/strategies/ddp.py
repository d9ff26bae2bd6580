"""Lightning's ``DDPStrategy`` with the lplugins process-group timeout, reliable under torchrun restarts."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from typing_extensions import override

from lplugins.strategies import _elastic
from lplugins.strategies.timeout import resolve_timeout

__all__ = ["DDPStrategy"]


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` whose process-group timeout comes from lplugins.

    Under torchrun its process group re-forms after every restart: it is made through store keys of
    the attempt's own (see ``docs/scaling-out.md``), never a dead rank's.

    Args:
        timeout: Seconds or a ``timedelta``; default ``LPLUGINS_PG_TIMEOUT``, then 30 minutes.
        **kwargs: Passed to Lightning's ``DDPStrategy``.

    Raises:
        LPluginsError: the timeout is not a positive number of seconds.
    """

    def __init__(self, *, timeout: float | timedelta | None = None, **kwargs: Any) -> None:
        super().__init__(timeout=resolve_timeout(timeout), **kwargs)

    @override
    def setup_distributed(self) -> None:
        _elastic.init_process_group(self)  # under torchrun; Lightning's init below then finds the group made
        super().setup_distributed()
