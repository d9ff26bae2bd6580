"""``CheckpointConfig``: the arguments of :class:`~lplugins.callbacks.DurableCheckpoint`, checked and frozen."""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from lplugins._validate import a_bool, did_you_mean, is_int, positive_int, positive_number
from lplugins.callbacks._errors import CheckpointConfigError
from lplugins.callbacks._preemption import PREEMPTED_EXIT_CODE, parse_signals
from lplugins.callbacks._record import NameTemplate
from lplugins.callbacks._retention import Retention

__all__ = ["CheckpointConfig", "ConfigField", "check_dirpath"]

_OWNER = "DurableCheckpoint"


@dataclass(frozen=True)
class CheckpointConfig:
    """Every argument of :class:`~lplugins.callbacks.DurableCheckpoint` (documented there), checked when built.

    ``preemption_signals`` is kept as signal numbers.

    Raises:
        CheckpointConfigError: an argument is invalid (a ``ValueError``; the message names it).

    >>> CheckpointConfig(every_n_steps=5, keep_last=None).retention
    Retention(keep_last=None, keep_top=0, monitor=None, mode='min')
    """

    every_n_steps: int | None = None
    every_n_seconds: float | None = None
    every_n_epochs: int | None = None
    save_on_train_end: bool = True
    keep_last: int | None = 3
    keep_top: int = 0
    monitor: str | None = None
    mode: str = "min"
    async_save: bool = False
    continuous: bool = False
    max_slowdown: float | None = 0.03
    max_in_flight: int = 1
    preemption_signals: Sequence[str | int | signal.Signals] = field(default=("SIGTERM", "SIGUSR1"))
    preemption_exit_code: int | None = PREEMPTED_EXIT_CODE
    slurm_requeue: bool = False
    verify: str = "quick"
    crc32: bool = True
    filename: str | None = None
    auto_insert_metric_name: bool = True
    take_over: bool = False
    #: How checkpoints are named (from ``filename`` and ``auto_insert_metric_name``); set when built.
    names: NameTemplate = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for flag in (
            "save_on_train_end",
            "async_save",
            "continuous",
            "slurm_requeue",
            "crc32",
            "auto_insert_metric_name",
            "take_over",
        ):
            a_bool(flag, getattr(self, flag), error=CheckpointConfigError, owner=_OWNER)
        an_int = functools.partial(positive_int, error=CheckpointConfigError, owner=_OWNER)
        an_int("every_n_steps", self.every_n_steps, optional=True)
        an_int("every_n_epochs", self.every_n_epochs, optional=True)
        positive_number(
            "every_n_seconds",
            self.every_n_seconds,
            optional=True,
            unit="seconds",
            error=CheckpointConfigError,
            owner=_OWNER,
        )
        an_int("keep_last", self.keep_last, optional=True)
        an_int("keep_top", self.keep_top, minimum=0)
        if self.keep_top and not self.monitor:
            raise CheckpointConfigError(f"{_OWNER}: keep_top={self.keep_top} needs monitor=<name of a logged metric>")
        if self.monitor is not None and (not isinstance(self.monitor, str) or not self.monitor):
            raise CheckpointConfigError(
                f"{_OWNER}: monitor must be a metric name (a non-empty string) or None, got {self.monitor!r}"
            )
        _one_of("mode", self.mode, ("min", "max"))
        an_int("max_in_flight", self.max_in_flight)
        _one_of("verify", self.verify, ("quick", "deep"))
        if not self.crc32 and self.verify == "deep":
            raise CheckpointConfigError(
                f"{_OWNER}: crc32=False writes no checksums, so verify='deep' cannot check them; use verify='quick'"
            )
        if self.continuous and not self.async_save:
            raise CheckpointConfigError(
                f"{_OWNER}: continuous=True starts a save as soon as the previous one has committed, which only"
                " an asynchronous save makes cheap; set async_save=True (a synchronous save every step stalls"
                " every step), or use every_n_steps/every_n_seconds."
            )
        if self.continuous and self.keep_last is None:
            raise CheckpointConfigError(
                f"{_OWNER}: continuous=True with keep_last=None would keep a checkpoint of nearly every step and"
                " fill the disk; set keep_last to how many of the newest to keep (at least 1: a checkpoint is"
                " deleted only after a newer one has committed)."
            )
        positive_number("max_slowdown", self.max_slowdown, optional=True, error=CheckpointConfigError, owner=_OWNER)
        if self.max_slowdown is not None and self.max_slowdown >= 1:
            raise CheckpointConfigError(
                f"{_OWNER}: max_slowdown={self.max_slowdown!r} is not allowed; it must be a fraction of throughput"
                " in (0, 1), e.g. 0.05, or None (continuous saves never rest)."
            )
        code = self.preemption_exit_code
        if code is not None and (not is_int(code) or not 0 <= code <= 255):
            raise CheckpointConfigError(
                f"{_OWNER}: preemption_exit_code must be an int in 0..255 or None, got {code!r}"
            )
        object.__setattr__(self, "preemption_signals", parse_signals(self.preemption_signals))
        try:
            names = NameTemplate(self.filename, self.auto_insert_metric_name)
        except ValueError as err:
            raise CheckpointConfigError(
                f"{_OWNER}: filename={self.filename!r} is not a valid template: {err}"
            ) from None
        object.__setattr__(self, "names", names)

    @property
    def automatic_triggers(self) -> bool:
        """Whether anything but ``request_checkpoint`` ever saves (an interval, train end or a preemption signal)."""
        intervals = (self.every_n_steps, self.every_n_seconds, self.every_n_epochs)
        return (
            self.continuous
            or self.save_on_train_end
            or bool(self.preemption_signals)
            or any(i is not None for i in intervals)
        )

    @property
    def retention(self) -> Retention:
        """What to keep after each commit."""
        return Retention(self.keep_last, self.keep_top, self.monitor, self.mode)


def check_dirpath(dirpath: object) -> str | None:
    """``dirpath`` as a string (``None`` stays ``None``: the default directory).

    Raises:
        CheckpointConfigError: (a ``ValueError``) not a str or ``os.PathLike`` of str, or empty.

    >>> check_dirpath(None), check_dirpath("ckpts")
    (None, 'ckpts')
    """
    if dirpath is None:
        return None
    path = os.fspath(dirpath) if isinstance(dirpath, (str, os.PathLike)) else None
    if not isinstance(path, str):
        raise CheckpointConfigError(
            f"{_OWNER}: dirpath={dirpath!r} is not allowed; it must be a directory (a str, a pathlib.Path or an"
            " fsspec URL such as 's3://bucket/run') or None for <default_root_dir>/checkpoints."
        )
    if not path.strip():
        raise CheckpointConfigError(
            f"{_OWNER}: dirpath={dirpath!r} is not allowed: an empty path names no directory; pass None for the"
            " default (<default_root_dir>/checkpoints) or '.' for the working directory."
        )
    return path


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        choices = " or ".join(repr(a) for a in allowed)
        suffix = did_you_mean(value, allowed) if isinstance(value, str) else ""
        raise CheckpointConfigError(f"{_OWNER}: {name} must be {choices}, got {value!r}.{suffix}")


T = TypeVar("T")


class ConfigField(Generic[T]):
    """A read-only attribute of the callback that reads the field of the same name from its ``config``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> ConfigField[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> Any:
        return self if obj is None else getattr(obj.config, self.name)  # type: ignore[attr-defined]
