"""The watchdog's hooks on the way an error leaves a rank: torch's c10d logger and ``sys.excepthook``.

At a failing collective (torch logs its error inside its ``except``) and at top level, ``note`` attaches what
the watchdog knows (a mismatch, a peer's failure) to the error; at top level ``post`` then tells the other
ranks why this one ends. Installed once, only when there is something to say: no cost before.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

_installed = False


class _NoteFilter(logging.Filter):
    def __init__(self, note: Callable[[BaseException], Any]) -> None:
        super().__init__()
        self._note = note

    def filter(self, record: logging.LogRecord) -> bool:
        error = sys.exc_info()[1]
        if error is not None:
            self._note(error)
        return True


def install(note: Callable[[BaseException], Any], post: Callable[[BaseException, Any], None]) -> None:
    """Hook ``note(error)`` on torch's c10d logger and ``note`` then ``post(error, tb)`` on ``sys.excepthook``."""
    global _installed
    if _installed:
        return
    _installed = True
    try:  # torch's collectives log their error through this logger, in their `except` block
        from torch.distributed import c10d_logger

        c10d_logger._c10d_logger.addFilter(_NoteFilter(note))
    except (ImportError, AttributeError):  # another torch: the excepthook below still prints it
        pass
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        note(value)
        previous(kind, value, tb)
        post(value, tb)

    sys.excepthook = hook
