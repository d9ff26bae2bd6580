"""Preemption: signals caught as a flag (the save happens at the next step boundary), and SLURM requeue."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from lplugins._coord import board as _board
from lplugins.callbacks._errors import CheckpointConfigError

__all__ = ["PREEMPTED_EXIT_CODE", "PreemptionSignals", "parse_signal", "parse_signals", "slurm_requeue"]

log = logging.getLogger("lplugins")

#: The exit code of a process that saved and stopped because of a preemption signal
#: (``EX_TEMPFAIL`` from ``sysexits.h``: "temporary failure, retry"). Schedulers and wrappers can
#: requeue on it; a finished run exits 0.
PREEMPTED_EXIT_CODE = 75
"""Exit code after a preemption checkpoint: 75, ``EX_TEMPFAIL`` ("temporary failure, retry"), for requeueing."""

_HANDLER = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


#: Signals no process can catch (the kernel acts on them itself); ``signal.signal`` refuses them.
_UNCATCHABLE = frozenset(int(getattr(signal, name)) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name))
#: What the message suggests: the signals schedulers send before they kill (SLURM, Kubernetes, ...).
_SUGGESTED = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")


def parse_signal(value: str | int | signal.Signals) -> int:
    """The number of a signal given by name (``"SIGTERM"``, ``"TERM"``) or number, checked to be catchable.

    Raises:
        CheckpointConfigError: not a signal, or one that cannot be caught (``SIGKILL``, ``SIGSTOP``), a
            ``ValueError``.

    >>> parse_signal("TERM") == signal.SIGTERM
    True
    """
    allowed = ", ".join(repr(s) for s in _SUGGESTED if hasattr(signal, s))
    try:
        if isinstance(value, str):
            number = int(signal.Signals[value if value.startswith("SIG") else "SIG" + value])
        elif isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(value)
        else:
            number = int(signal.Signals(value))
    except (KeyError, ValueError):
        raise CheckpointConfigError(
            f"DurableCheckpoint: preemption_signals: {value!r} is not a signal; use names like {allowed}"
            " or signal numbers"
        ) from None
    if number in _UNCATCHABLE or number not in signal.valid_signals():
        raise CheckpointConfigError(
            f"DurableCheckpoint: preemption_signals: {signal.Signals(number).name} cannot be caught (the kernel"
            f" stops or kills the process itself, before any save); use a signal sent before the kill, e.g. {allowed}"
            " (any signal but SIGKILL and SIGSTOP)"
        )
    return number


def parse_signals(values: object) -> tuple[int, ...]:
    """:func:`parse_signal` for each of a list or tuple of signals (a bare name or number is an error).

    Raises:
        CheckpointConfigError: not a list or tuple, or one of them is not a catchable signal.
    """
    if isinstance(values, (str, bytes, int, signal.Signals)) or not isinstance(values, (list, tuple, set, frozenset)):
        raise CheckpointConfigError(
            f"DurableCheckpoint: preemption_signals={values!r} is not allowed; it must be a list of signals,"
            " e.g. ['SIGTERM', 'SIGUSR1'], or () for none"
        )
    return tuple(dict.fromkeys(parse_signal(v) for v in values))


class PreemptionSignals:
    """Handlers for the preemption signals that only note the signal; the previous handlers come back after.

    Handlers can only be installed from the main thread; elsewhere both calls do nothing.

    Args:
        signals: The signals to catch, by name or number (empty: none).

    Raises:
        CheckpointConfigError: one is not a signal.
    """

    def __init__(self, signals: Iterable[str | int | signal.Signals]) -> None:
        self.signals = tuple(parse_signal(s) for s in signals)
        #: The last signal received since :meth:`install`, or ``None``.
        self.received: int | None = None
        self._previous: dict[int, _HANDLER] = {}

    def install(self) -> None:
        """Catch the signals (keeping the current handlers to restore)."""
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return
        self.received = None
        _board.stop_signal(None)  # a signal of an earlier fit in this process is no stop of this one
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """Put the previous handlers back (idempotent)."""
        if threading.current_thread() is not threading.main_thread():
            return
        while self._previous:
            sig, handler = self._previous.popitem()
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # only a flag: the save happens at the next step boundary, on all ranks together
        self.received = signum
        # under torchelastic SIGTERM can also mean "a peer died, torchrun restarts the group": an
        # agreement this rank waits in then ends the process instead of waiting for the dead peer
        if signum == signal.SIGTERM:
            _board.stop_signal(signum)


def slurm_requeue() -> None:
    """Run ``scontrol requeue`` for this SLURM job (or array task); log, never raise, when it fails."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        job = f"{array_job}_{array_task}"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        log.error("DurableCheckpoint: `scontrol requeue %s` failed: %s", job, err)
        return
    if result.returncode:
        log.error("DurableCheckpoint: `scontrol requeue %s` exited %s: %s", job, result.returncode, result.stderr)
    else:
        log.info("DurableCheckpoint: requeued SLURM job %s", job)
