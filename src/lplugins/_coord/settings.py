"""The hang detector's settings: their names, their environment variables, their checks, and how they adapt.

Two thresholds, each a floor that the detector raises on its own when the job turns out slower:

``collective_timeout`` (``LPLUGINS_COLLECTIVE_TIMEOUT``, default ``auto`` = 5 s)
    How long every other rank may wait in a collective for a rank that is stuck elsewhere (a
    different collective, a stalled DataLoader) before it is a hang. In use:
    ``max(floor, 3 x the longest step seen)``, where a "step" is the time between two collectives
    completing on this rank (sampled by the watchdog; the longest of the last 200 is kept), so a job
    whose steps take 20 s gets 60 s and a job of 50 ms steps keeps the floor. Only steps inside
    Lightning's batch loops count (:func:`lplugins._coord.stacks.in_batch_loop`): a gap in set-up
    (DeepSpeed's engine, a restore) is not a step.
``heartbeat_timeout`` (``LPLUGINS_HEARTBEAT_TIMEOUT``, default ``auto`` = 5 s)
    How long a rank's watchdog thread may be kept from running (its main thread holds the GIL, or
    the process is stopped) before that rank is unresponsive: its own C-level timer then writes its
    stack and ends it, and the other ranks name it. In use: ``max(floor, 3 x the longest delay a
    sample of the watchdog has had so far)``.

Each is set by environment variable or by name (:func:`from_env` ``(collective_timeout=...,
heartbeat_timeout=...)``, whose result :func:`lplugins._coord.watchdog.arm` takes as ``timeout`` and
``heartbeat``): a number of seconds (the floor), ``auto`` (the default floor), or ``off``
(``LPLUGINS_COLLECTIVE_TIMEOUT=off`` turns the whole watchdog off). ``0``, a negative number, NaN,
infinity or anything that is not a number is refused with the setting's name, when the ``Trainer``
is built -- before any training.

Imports only the base layer.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

from lplugins._errors import LPluginsError

__all__ = [
    "COLLECTIVE_VAR", "DEFAULT_COLLECTIVE_S", "DEFAULT_HEARTBEAT_S", "FACTOR", "HEARTBEAT_VAR", "OFF", "Adaptive",
    "Settings", "from_env", "parse",
]  # fmt: skip

COLLECTIVE_VAR = "LPLUGINS_COLLECTIVE_TIMEOUT"
HEARTBEAT_VAR = "LPLUGINS_HEARTBEAT_TIMEOUT"
#: Where lplugins writes each rank's stack dump (default: the Trainer's ``default_root_dir``).
STACKS_VAR = "LPLUGINS_STACKS_DIR"
DEFAULT_COLLECTIVE_S = 5.0
DEFAULT_HEARTBEAT_S = 5.0
#: A threshold in use is at least this many times the longest step (or sample delay) seen.
FACTOR = 3.0
#: How many recent steps the longest is taken over.
WINDOW = 200
OFF = 0.0


def parse(name: str, value: Any, default: float, *, can_be_off: bool = False) -> float:
    """A threshold in seconds from ``value`` (a number, a numeric string, ``"auto"``/``None``: ``default``).

    ``"off"`` gives :data:`OFF` where ``can_be_off``.

    Raises:
        LPluginsError: not a finite number > 0 (0, negative, NaN, infinity, a bool, text); the message
            names the setting.

    >>> parse("LPLUGINS_COLLECTIVE_TIMEOUT", "12", 5.0)
    12.0
    >>> parse("collective_timeout", 0, 5.0)
    Traceback (most recent call last):
    ...
    lplugins.LPluginsError: collective_timeout=0 is not allowed; it must be a number of seconds > 0 (e.g. 5), or 'auto'.
    """
    if value is None:
        return default
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "auto"):
            return default
        if text == "off" and can_be_off:
            return OFF
        try:
            number = float(text)
        except ValueError:
            number = math.nan
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        also = ", 'auto' or 'off' (no watchdog)" if can_be_off else ", or 'auto'"
        raise LPluginsError(
            f"{name}={value!r} is not allowed; it must be a number of seconds > 0 (e.g. {default:g}){also}."
        )
    return number


@dataclass(frozen=True)
class Settings:
    """The floors in use (seconds; ``collective == 0``: the watchdog is off)."""

    collective: float = DEFAULT_COLLECTIVE_S
    heartbeat: float = DEFAULT_HEARTBEAT_S


def from_env(collective_timeout: Any = None, heartbeat_timeout: Any = None) -> Settings:
    """The settings: each argument given by name wins over its environment variable.

    Raises:
        LPluginsError: a value is not allowed (see :func:`parse`).
    """
    if collective_timeout is None:
        collective = parse(COLLECTIVE_VAR, os.environ.get(COLLECTIVE_VAR), DEFAULT_COLLECTIVE_S, can_be_off=True)
    else:
        collective = parse("collective_timeout", collective_timeout, DEFAULT_COLLECTIVE_S, can_be_off=True)
    if heartbeat_timeout is None:
        heartbeat = parse(HEARTBEAT_VAR, os.environ.get(HEARTBEAT_VAR), DEFAULT_HEARTBEAT_S)
    else:
        heartbeat = parse("heartbeat_timeout", heartbeat_timeout, DEFAULT_HEARTBEAT_S)
    return Settings(collective, heartbeat)


class Adaptive:
    """A threshold that is ``max(floor, FACTOR x the longest of the last WINDOW observations)``.

    >>> a = Adaptive(5.0)
    >>> a.observe(0.1); a.value
    5.0
    >>> a.observe(4.0); a.value
    12.0
    """

    def __init__(self, floor: float) -> None:
        self.floor = floor
        self.seen: deque[float] = deque(maxlen=WINDOW)
        self.longest = 0.0

    def observe(self, seconds: float) -> None:
        dropped = self.seen[0] if len(self.seen) == self.seen.maxlen else None
        self.seen.append(seconds)
        if seconds >= self.longest:
            self.longest = seconds
        elif dropped is not None and dropped >= self.longest:
            self.longest = max(self.seen)

    @property
    def value(self) -> float:
        return max(self.floor, FACTOR * self.longest)
