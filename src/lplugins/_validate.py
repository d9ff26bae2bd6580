"""Parameter checks shared by every component: one wording for every "positive int" error.

Each check names the parameter, the bad value and what is allowed, and raises the caller's
error class (an :class:`~lplugins.LPluginsError` subclass by default), so a typo fails when the
object is built, before any process starts.
"""

from __future__ import annotations

import math
from typing import Any

from lplugins._errors import LPluginsError, did_you_mean, suggest

__all__ = ["a_bool", "did_you_mean", "is_int", "positive_int", "positive_number", "suggest"]


def is_int(value: object) -> bool:
    """``True`` for an ``int`` that is not a ``bool`` (``True`` is an ``int`` in Python).

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(
    name: str,
    value: Any,
    *,
    minimum: int = 1,
    optional: bool = False,
    error: type[Exception] = LPluginsError,
    owner: str | None = None,
) -> Any:
    """Return ``value`` if it is an int (not a bool) ``>= minimum`` (or ``None`` when ``optional``).

    Args:
        name: The parameter's name, as the user spells it.
        value: The value to check.
        minimum: The smallest allowed value (1: a positive int; 0: a non-negative int).
        optional: Whether ``None`` is allowed.
        error: The exception class to raise (it is called with the message).
        owner: What the parameter belongs to, e.g. ``"DurableCheckpoint"``; prefixed to the message.

    Raises:
        LPluginsError: (or ``error``) the value is not allowed; the message names it.

    >>> positive_int("every_n_steps", 5)
    5
    >>> positive_int("every_n_steps", 0, owner="DurableCheckpoint")
    Traceback (most recent call last):
    ...
    lplugins.LPluginsError: DurableCheckpoint: every_n_steps=0 is not allowed; it must be an int >= 1.
    """
    if value is None and optional:
        return None
    if not is_int(value) or value < minimum:
        allowed = f"an int >= {minimum}" + (" or None" if optional else "")
        prefix = f"{owner}: " if owner else ""
        raise error(f"{prefix}{name}={value!r} is not allowed; it must be {allowed}.")
    return value


def positive_number(
    name: str,
    value: Any,
    *,
    optional: bool = False,
    allow_zero: bool = False,
    error: type[Exception] = LPluginsError,
    owner: str | None = None,
    unit: str = "",
) -> Any:
    """Return ``value`` if it is a finite int or float (not a bool) ``> 0`` (``>= 0`` with ``allow_zero``).

    Raises:
        LPluginsError: (or ``error``) the value is not allowed; the message names it.

    >>> positive_number("every_n_seconds", 1.5)
    1.5
    """
    if value is None and optional:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        allowed = (
            ("a non-negative" if allow_zero else "a positive") + " finite number" + (f" of {unit}" if unit else "")
        )
        allowed += " or None" if optional else ""
        prefix = f"{owner}: " if owner else ""
        raise error(f"{prefix}{name}={value!r} is not allowed; it must be {allowed}.")
    return value


def a_bool(name: str, value: Any, *, error: type[Exception] = LPluginsError, owner: str | None = None) -> bool:
    """Return ``value`` if it is a real ``bool``; a string like ``"no"`` or a number is an error, not truthy.

    Raises:
        LPluginsError: (or ``error``) the value is not a bool; the message names it.

    >>> a_bool("async_save", False)
    False
    >>> a_bool("async_save", "no", owner="DurableCheckpoint")
    Traceback (most recent call last):
    ...
    lplugins.LPluginsError: DurableCheckpoint: async_save='no' is not allowed; it must be True or False.
    """
    if not isinstance(value, bool):
        prefix = f"{owner}: " if owner else ""
        raise error(f"{prefix}{name}={value!r} is not allowed; it must be True or False.")
    return value
