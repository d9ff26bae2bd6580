"""Dynamic gradient-accumulation schedules and the Lightning callback that applies them.

Schedules are plain Python (importing them does not import Lightning); the callback
:class:`AccumulationScheduler` is imported on first use.

Examples:
    >>> from lplugins.accumulation import EpochSchedule, ScheduleContext
    >>> EpochSchedule({0: 8, 5: 4, 10: 2}).factor(ScheduleContext(epoch=7))
    4
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lplugins.accumulation._schedules import (
    ConstantGlobalSchedule,
    EpochSchedule,
    RampSchedule,
    Schedule,
    ScheduleContext,
    ScheduleError,
    StepSchedule,
    schedule_from,
)

if TYPE_CHECKING:
    from lplugins.accumulation._scheduler import AccumulationScheduler

__all__ = [
    "AccumulationScheduler",
    "ConstantGlobalSchedule",
    "EpochSchedule",
    "RampSchedule",
    "Schedule",
    "ScheduleContext",
    "ScheduleError",
    "StepSchedule",
    "schedule_from",
]


def __getattr__(name: str) -> Any:
    if name == "AccumulationScheduler":
        from lplugins.accumulation._scheduler import AccumulationScheduler

        return AccumulationScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
