"""A collective mismatch: every rank waits, for at least the bound, in collectives that are not the same call.

:func:`report` reads every rank's published state (:mod:`lplugins._coord.watchdog` publishes them) and
returns the report every rank logs, or ``None`` when some rank works, is not watched, or all wait in
the same call (slow, not mismatched). :func:`stop_this_rank` ends the highest rank once the others
have logged it, so that their pending collectives fail at once ("Connection closed by peer")
instead of at the process-group timeout (gloo cannot be aborted from a thread).

May import: the standard library, the logger and :mod:`lplugins._coord.faults`; the board is passed in.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

from lplugins._coord import faults
from lplugins._coord.settings import COLLECTIVE_VAR
from lplugins._log import log

__all__ = ["report", "stop_this_rank"]


def report(board: Any, now: float, bound: float, interval: float) -> str | None:
    """The mismatch report when every rank has waited ``bound`` s in different collectives, else ``None``."""
    states: dict[int, dict[str, Any]] = {}
    for r in range(board.world):
        key = f"state/{r}"
        if not board.store.check([key]):
            return None  # a rank that never published: its watchdog is off, nothing to compare
        states[r] = json.loads(board.store.get(key))
    fresh = 10 * interval + 5
    for s in states.values():
        if s["kind"] not in ("collective", "backward") or now - s["t"] > fresh or now - s["since"] < bound / 2:
            return None  # some rank is working (or not watched): not a deadlock, maybe slow
    if len({(s["op"], s["site"], s.get("shape", "")) for s in states.values()}) == 1:
        return None  # all in the same call at the same line with the same shape: slow, not mismatched
    lines = [f"  rank {r}: waits {now - s['since']:.0f}s in {faults.describe(s)}" for r, s in sorted(states.items())]
    return (
        "lplugins: collective mismatch -- the ranks wait in different collectives and none can complete:\n"
        + "\n".join(lines)
        + "\nEvery rank must make the same collective calls in the same order: a collective under"
        " `if trainer.is_global_zero:` (save_checkpoint, barrier, self.log(..., sync_dist=True)) deadlocks;"
        " call it on every rank, or use lplugins.callbacks.request_checkpoint / rank_zero_block."
        f" (Detected by the lplugins collective watchdog after {bound:g}s; {COLLECTIVE_VAR}=off turns it off.)"
    )


def stop_this_rank(board: Any, text: str, interval: float) -> None:
    """Exit this process so the other ranks' collectives fail now, once they have logged ``text`` (at most 5 s)."""
    deadline = time.monotonic() + max(5.0, 5 * interval)
    while time.monotonic() < deadline:  # let the others log their report first
        if all(board.store.check([f"mismatch/{r}"]) for r in range(board.world)):
            break
        time.sleep(0.1)
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
    sys.stderr.write(
        f"lplugins [rank {board.rank}]: stopping this rank (exit status {faults.EXIT_STATUS}) so the others do"
        f" not wait for the process-group timeout. Its main thread was here:\n{stack}{text}\n"
    )
    for handler in [*log.handlers, *logging.getLogger().handlers]:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(faults.EXIT_STATUS)
