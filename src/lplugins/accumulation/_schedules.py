"""Gradient-accumulation schedules: pure Python, no Lightning import.

A schedule answers one question: *how many micro-batches make up the next optimizer step?* It is
asked once per window (at the first micro-batch after an optimizer step), with a
:class:`ScheduleContext` that says where training stands.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from lplugins._errors import LPluginsError, shown_from
from lplugins._validate import is_int, positive_int


class ScheduleError(LPluginsError, ValueError):
    """A schedule is invalid, or cannot be applied to this run (raised before training)."""


shown_from("lplugins.accumulation", ScheduleError)


@dataclass(frozen=True)
class ScheduleContext:
    """Where training stands when a new accumulation window starts.

    Attributes:
        epoch: The current epoch (0-based).
        step: Optimizer steps completed so far.
        samples: Samples consumed so far, summed over all processes (nominal: micro-batch size x
            world size per micro-step).
        micro_batch_size: Samples per micro-batch on one process, or ``None`` if unknown.
        world_size: Number of processes that train together (devices x nodes).
    """

    epoch: int = 0
    step: int = 0
    samples: int = 0
    micro_batch_size: int | None = None
    world_size: int = 1


def _positive_int(owner: str, name: str, value: object) -> int:
    return int(positive_int(name, value, owner=owner, error=ScheduleError))


def _known_micro(owner: str, own: int | None, given: int | None, why: str = "") -> int:
    """The schedule's own micro-batch size, else the run's; raise if neither is known."""
    micro = own or given
    if micro is None:
        raise ScheduleError(
            f"{owner}: the micro-batch size is unknown{why}; pass micro_batch_size=... to the schedule."
        )
    return micro


class Schedule(abc.ABC):
    """Base class of gradient-accumulation schedules.

    Subclasses implement :meth:`factor`; schedules that depend on the micro-batch size or the world
    size set :attr:`needs_micro_batch_size` and check feasibility in :meth:`check`. Everything is
    validated in ``__init__`` (shape of the arguments) and in :meth:`check` (against the run),
    both before the first optimizer step.

    Examples:
        >>> class EveryOtherEpoch(Schedule):
        ...     def factor(self, context: ScheduleContext) -> int:
        ...         return 4 if context.epoch % 2 else 1
        >>> EveryOtherEpoch().factor(ScheduleContext(epoch=1))
        4
    """

    #: Whether :meth:`factor` needs ``context.micro_batch_size``.
    needs_micro_batch_size: ClassVar[bool] = False

    @abc.abstractmethod
    def factor(self, context: ScheduleContext) -> int:
        """Return the number of micro-batches (>= 1) of the window that starts now."""

    def check(self, *, micro_batch_size: int | None, world_size: int) -> None:  # noqa: B027 - optional hook
        """Check that the schedule can be applied to a run; raise :class:`ScheduleError` if not.

        Args:
            micro_batch_size: Samples per micro-batch on one process, or ``None`` if unknown.
            world_size: Number of processes.
        """

    def global_batch_size(self, factor: int, *, micro_batch_size: int | None, world_size: int) -> int | None:
        """The effective global batch of a window of ``factor`` micro-batches, if the micro-batch size is known."""
        if micro_batch_size is None:
            return None
        return factor * micro_batch_size * world_size


class _KeyedSchedule(Schedule):
    """A mapping ``{key: factor}``; the factor of the greatest key <= the current position applies."""

    _key_name: ClassVar[str] = "key"

    def __init__(self, schedule: Mapping[int, int]) -> None:
        owner = type(self).__name__
        if not isinstance(schedule, Mapping):
            raise ScheduleError(
                f"{owner}: schedule={schedule!r} must be a dict {{{self._key_name}: factor}}, "
                "e.g. {0: 8, 5: 4, 10: 2}."
            )
        if not schedule:
            raise ScheduleError(f"{owner}: the schedule is empty; give at least one {{{self._key_name}: factor}} pair.")
        previous: int | None = None
        for key, value in schedule.items():
            if not is_int(key) or key < 0:
                raise ScheduleError(
                    f"{owner}: key {key!r} is not allowed; keys are {self._key_name}s, ints >= 0 "
                    f"(got keys {list(schedule)!r})."
                )
            if not is_int(value) or value < 1:
                raise ScheduleError(
                    f"{owner}: factor {value!r} at {self._key_name} {key} is not allowed; factors are ints >= 1."
                )
            if previous is not None and key <= previous:
                ordered = dict(sorted(schedule.items()))
                raise ScheduleError(
                    f"{owner}: keys must be strictly increasing, but {key} comes after {previous} "
                    f"(got {dict(schedule)!r}; did you mean {ordered!r}?)."
                )
            previous = key
        self.schedule: dict[int, int] = dict(schedule)
        self._keys = list(self.schedule)

    def _lookup(self, position: int) -> int:
        result = 1
        for key in self._keys:
            if key > position:
                break
            result = self.schedule[key]
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.schedule!r})"


class EpochSchedule(_KeyedSchedule):
    """Epoch-keyed factors, Lightning's dict form: ``{0: 8, 5: 4, 10: 2}``.

    The factor of the greatest key <= the current epoch applies; before the first key the factor is 1
    (as in Lightning's ``GradientAccumulationScheduler``).

    Args:
        schedule: ``{epoch: factor}`` with int epochs >= 0 in increasing order and int factors >= 1.

    Raises:
        ScheduleError: an empty dict, a negative or non-int key, keys not in increasing order, or a
            factor that is not an int >= 1.

    Examples:
        >>> s = EpochSchedule({0: 8, 5: 4, 10: 2})
        >>> [s.factor(ScheduleContext(epoch=e)) for e in (0, 4, 5, 11)]
        [8, 8, 4, 2]
    """

    _key_name = "epoch"

    def factor(self, context: ScheduleContext) -> int:
        """The factor for ``context.epoch``."""
        return self._lookup(context.epoch)


class StepSchedule(_KeyedSchedule):
    """Optimizer-step-keyed factors: ``{0: 8, 1000: 4}`` uses 8 micro-batches for the first 1000 steps.

    A key is the number of optimizer steps completed when the factor starts to apply; the window in
    progress is never cut short. Unlike an epoch schedule, it works in single-epoch runs.

    Args:
        schedule: ``{step: factor}`` with int steps >= 0 in increasing order and int factors >= 1.

    Raises:
        ScheduleError: an empty dict, a negative or non-int key, keys not in increasing order, or a
            factor that is not an int >= 1.

    Examples:
        >>> s = StepSchedule({0: 4, 3: 2})
        >>> [s.factor(ScheduleContext(step=n)) for n in range(5)]
        [4, 4, 4, 2, 2]
    """

    _key_name = "step"

    def factor(self, context: ScheduleContext) -> int:
        """The factor for ``context.step``."""
        return self._lookup(context.step)


_NO_LOADER_SIZE = " (the DataLoader has no batch_size)"


def _multiples_near(value: int, unit: int) -> str:
    lower = (value // unit) * unit
    options = [v for v in (lower, lower + unit) if v > 0]
    return " or ".join(str(v) for v in options)


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


class ConstantGlobalSchedule(Schedule):
    """Keep the global batch size constant: factor = global batch / (micro-batch x world size).

    The factor is re-derived whenever the run starts, so resuming on a different number of
    processes keeps the same global batch (and optimizer-step semantics).

    Args:
        global_batch_size: The samples per optimizer step, over all processes.
        micro_batch_size: Samples per micro-batch on one process; by default the training
            DataLoader's ``batch_size`` (or the size of the first batch).

    Raises:
        ScheduleError: a non-int or non-positive size; in :meth:`check`, a global batch that is not
            a multiple of micro-batch x world size (the message lists what would work).

    Examples:
        >>> s = ConstantGlobalSchedule(64, micro_batch_size=8)
        >>> s.factor(ScheduleContext(micro_batch_size=8, world_size=2))
        4
    """

    needs_micro_batch_size = True

    def __init__(self, global_batch_size: int, micro_batch_size: int | None = None) -> None:
        self.global_batch_size_target = _positive_int("constant_global", "global_batch_size", global_batch_size)
        self.micro_batch_size = (
            None if micro_batch_size is None else _positive_int("constant_global", "micro_batch_size", micro_batch_size)
        )

    def check(self, *, micro_batch_size: int | None, world_size: int) -> None:
        """Check that the global batch is micro-batch x world size x an integer factor."""
        micro = _known_micro("constant_global", self.micro_batch_size, micro_batch_size, _NO_LOADER_SIZE)
        per_step = micro * world_size
        target = self.global_batch_size_target
        if target % per_step:
            micros = [d for d in _divisors(target) if target % (d * world_size) == 0]
            micro_hint = (
                f"a micro-batch size that divides {target // world_size} (e.g. {', '.join(map(str, micros[-4:]))})"
                if target % world_size == 0
                else f"a world size that divides {target}"
            )
            raise ScheduleError(
                f"constant_global: global_batch_size={target} cannot be met with micro_batch_size={micro} x "
                f"world_size={world_size} ({per_step} samples per micro-step). Use global_batch_size="
                f"{_multiples_near(target, per_step)}, or {micro_hint}."
            )

    def factor(self, context: ScheduleContext) -> int:
        """``global_batch_size // (micro_batch_size * world_size)``."""
        micro = _known_micro("constant_global", self.micro_batch_size, context.micro_batch_size)
        return max(1, self.global_batch_size_target // (micro * context.world_size))

    def __repr__(self) -> str:
        return (
            f"ConstantGlobalSchedule(global_batch_size={self.global_batch_size_target}, "
            f"micro_batch_size={self.micro_batch_size})"
        )


class RampSchedule(Schedule):
    """Ramp the global batch size from ``start`` to ``target`` over ``over`` samples or optimizer steps.

    ``kind="linear"`` grows the global batch continuously and rounds it down to a whole number of
    micro-steps (micro-batch x world size); ``kind="stepwise"`` grows it by ``increment`` in equal
    stages (Megatron's ``rampup_batch_size = [start, increment, samples]``). After the ramp the
    global batch stays at ``target``. As with :class:`ConstantGlobalSchedule`, the factor is
    re-derived from the world size, so a resume on more processes continues the same ramp.

    Args:
        start: Global batch size at the beginning.
        target: Global batch size at the end of the ramp (>= ``start``).
        over: Length of the ramp, in ``unit``.
        unit: ``"samples"`` (global samples consumed) or ``"steps"`` (optimizer steps).
        kind: ``"linear"`` or ``"stepwise"``.
        increment: For ``"stepwise"``: the global-batch growth per stage; ``target - start`` must be
            a multiple of it.
        micro_batch_size: Samples per micro-batch on one process (default: from the DataLoader).

    Raises:
        ScheduleError: ``start > target``, a non-positive or non-int size, an unknown ``unit`` or
            ``kind``, a stepwise ramp without a fitting ``increment``; in :meth:`check`, a
            ``start``, ``target`` or ``increment`` that is not a multiple of micro-batch x world size.

    Examples:
        >>> ramp = RampSchedule(start=8, target=32, over=3, unit="steps", micro_batch_size=8)
        >>> [ramp.factor(ScheduleContext(step=n, micro_batch_size=8)) for n in range(5)]
        [1, 2, 3, 4, 4]
    """

    needs_micro_batch_size = True
    UNITS: ClassVar[tuple[str, ...]] = ("samples", "steps")
    KINDS: ClassVar[tuple[str, ...]] = ("linear", "stepwise")

    def __init__(
        self,
        start: int,
        target: int,
        over: int,
        unit: str = "samples",
        kind: str = "linear",
        increment: int | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self.start = _positive_int("ramp", "start", start)
        self.target = _positive_int("ramp", "target", target)
        self.over = _positive_int("ramp", "over", over)
        if self.start > self.target:
            raise ScheduleError(
                f"ramp: start={start} is larger than target={target}; a ramp grows the global batch, "
                "so start <= target."
            )
        if unit not in self.UNITS:
            raise ScheduleError(f"ramp: unit={unit!r} is not allowed; use one of {', '.join(map(repr, self.UNITS))}.")
        if kind not in self.KINDS:
            raise ScheduleError(f"ramp: kind={kind!r} is not allowed; use one of {', '.join(map(repr, self.KINDS))}.")
        self.unit = unit
        self.kind = kind
        if kind == "stepwise":
            if increment is None:
                raise ScheduleError("ramp: kind='stepwise' needs increment=... (the global-batch growth per stage).")
            _positive_int("ramp", "increment", increment)
            span = self.target - self.start
            if span == 0:
                raise ScheduleError(f"ramp: increment={increment} with start == target; use kind='linear'.")
            if span % increment:
                hints = ", ".join(map(str, _divisors(span)[-4:]))
                raise ScheduleError(
                    f"ramp: target - start = {span} is not a multiple of increment={increment}; "
                    f"use an increment that divides it (e.g. {hints})."
                )
        elif increment is not None:
            raise ScheduleError("ramp: increment=... only applies to kind='stepwise'.")
        self.increment = increment
        self.micro_batch_size = (
            None if micro_batch_size is None else _positive_int("ramp", "micro_batch_size", micro_batch_size)
        )

    def global_batch_at(self, position: int) -> int:
        """The (un-rounded) global batch size at ``position`` samples or steps."""
        if position >= self.over or self.start == self.target:
            return self.target
        if self.kind == "linear":
            return self.start + (self.target - self.start) * position // self.over
        assert self.increment is not None
        stages = (self.target - self.start) // self.increment
        stage = position * stages // self.over
        return self.start + stage * self.increment

    def check(self, *, micro_batch_size: int | None, world_size: int) -> None:
        """Check that start, target (and increment) are whole numbers of micro-steps."""
        micro = _known_micro("ramp", self.micro_batch_size, micro_batch_size, _NO_LOADER_SIZE)
        per_step = micro * world_size
        named = {"start": self.start, "target": self.target}
        if self.increment is not None:
            named["increment"] = self.increment
        for name, value in named.items():
            if value % per_step:
                raise ScheduleError(
                    f"ramp: {name}={value} is not a multiple of micro_batch_size={micro} x world_size={world_size} "
                    f"= {per_step} samples per micro-step; use {name}={_multiples_near(value, per_step)}."
                )

    def factor(self, context: ScheduleContext) -> int:
        """The global batch at the current position, in micro-steps (at least 1)."""
        micro = _known_micro("ramp", self.micro_batch_size, context.micro_batch_size)
        position = context.samples if self.unit == "samples" else context.step
        return max(1, self.global_batch_at(position) // (micro * context.world_size))

    def __repr__(self) -> str:
        extra = f", increment={self.increment}" if self.increment is not None else ""
        return (
            f"RampSchedule(start={self.start}, target={self.target}, over={self.over}, unit={self.unit!r}, "
            f"kind={self.kind!r}{extra})"
        )


def schedule_from(value: Any) -> Schedule:
    """A :class:`Schedule` from a schedule object or an epoch-keyed dict.

    Raises:
        ScheduleError: anything else.
    """
    if isinstance(value, Schedule):
        return value
    if isinstance(value, Mapping) and "name" not in value:
        return EpochSchedule(value)
    raise ScheduleError(
        f"{value!r} is not a schedule; pass a lplugins.accumulation.Schedule or an epoch-keyed dict such as "
        "{0: 8, 5: 4, 10: 2} (named schedules are resolved by lplugins.compose)."
    )
