"""Where lplugins says what it decided: the ``lplugins`` logger, visible the way Lightning's is.

Lightning gives its ``lightning.pytorch`` logger a stream handler at INFO when it is imported, so
"GPU available: ..." and "Restoring states from ..." reach the terminal without any logging setup.
lplugins does the same for its own ``lplugins`` logger (only when the application has not configured
it), and every decision it makes (what ``precision="auto"`` chose, which checkpoint a run resumes
from or why it starts fresh, which accumulation factor applies, which plugins loaded or were
blocked) goes through :func:`announce`: once, on global rank zero, at INFO.

To silence it: ``logging.getLogger("lplugins").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging

__all__ = ["announce", "configure", "log"]

#: The logger every lplugins message goes to.
log = logging.getLogger("lplugins")


def configure() -> None:
    """Set the ``lplugins`` logger to INFO, as Lightning does for its own logger.

    Like Lightning: when the root logger has no handler (no logging setup in the application), the
    logger gets a stream handler of its own and does not propagate; otherwise its INFO records
    reach the application's handlers. A level the application set on ``lplugins`` is kept.
    """
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().hasHandlers():
        log.addHandler(logging.StreamHandler())
        log.propagate = False


def announce(message: str, *args: object) -> None:
    """Log one decision at INFO, on global rank zero only (``message % args``, logging-style).

    Examples:
        >>> announce("lplugins: precision='auto' chose %r (%s)", "32-true", "CPU")
    """
    from lplugins.rankzero._rank import is_global_zero

    if is_global_zero():
        log.info(message, *args)
