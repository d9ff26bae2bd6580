"""One process-group timeout for every built-in distributed strategy.

The seed guide's fix for a hanging job, ``export NCCL_TIMEOUT=3600``, does nothing: neither NCCL nor
PyTorch reads a variable of that name. The timeout that matters is the one passed to
``torch.distributed.init_process_group``; every lplugins strategy takes it from here.

Resolution order: the ``timeout=`` argument of the strategy, then the ``LPLUGINS_PG_TIMEOUT``
environment variable (seconds), then :data:`DEFAULT_PG_TIMEOUT` (30 minutes, Lightning's default).
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

from lplugins._errors import LPluginsError
from lplugins._validate import positive_number

#: The environment variable that sets the process-group timeout, in seconds.
ENV_VAR = "LPLUGINS_PG_TIMEOUT"

#: The timeout used when neither the argument nor the environment variable is given (Lightning's default).
DEFAULT_PG_TIMEOUT = timedelta(minutes=30)
"""The process-group timeout when neither the argument nor the environment variable is given (Lightning's)."""

_IGNORED_VARS = ("NCCL_TIMEOUT",)


def resolve_timeout(timeout: float | timedelta | None = None) -> timedelta:
    """Return the process-group timeout to use.

    Args:
        timeout: Seconds or a ``timedelta``; ``None`` reads ``LPLUGINS_PG_TIMEOUT`` (seconds), then
            falls back to :data:`DEFAULT_PG_TIMEOUT`.

    Returns:
        The timeout as a ``timedelta``.

    Raises:
        LPluginsError: the value is not a positive, finite number of seconds (the message names it).

    Examples:
        >>> resolve_timeout(90)
        datetime.timedelta(seconds=90)
        >>> resolve_timeout(timedelta(hours=1))
        datetime.timedelta(seconds=3600)
    """
    source = "timeout="
    if timeout is None:
        raw = os.environ.get(ENV_VAR)
        if raw is None or not raw.strip():
            _warn_ignored_vars()
            return DEFAULT_PG_TIMEOUT
        source = f"{ENV_VAR}="
        try:
            timeout = float(raw)
        except ValueError:
            raise LPluginsError(
                f"{ENV_VAR}={raw!r} is not a number of seconds; set it to a positive number such as 3600."
            ) from None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise LPluginsError(f"{source}{timeout!r} is not a timeout; pass seconds (a number) or a datetime.timedelta.")
    positive_number(source.rstrip("="), timeout if isinstance(timeout, (int, float)) else seconds, unit="seconds")
    return timedelta(seconds=seconds)


def _warn_ignored_vars() -> None:
    for var in _IGNORED_VARS:
        if var in os.environ:
            warnings.warn(
                f"{var} is set, but neither NCCL nor PyTorch reads it, so it does not change the process-group "
                f"timeout. Set {ENV_VAR} (seconds) instead, or pass timeout= to the strategy.",
                UserWarning,
                stacklevel=3,
            )
