"""Built-in plugin ``accumulation``: gradient-accumulation schedules by name.

Registered through ``lplugins_register_schedules`` like a third-party plugin's; the schedule classes
are pure Python, so loading this plugin does not import Lightning.
"""

from __future__ import annotations

from lplugins.hookspecs import Register, hookimpl


@hookimpl
def lplugins_register_schedules(register: Register) -> None:
    from lplugins.accumulation import ConstantGlobalSchedule, EpochSchedule, RampSchedule, StepSchedule

    register("epoch", EpochSchedule, description="epoch-keyed factors: schedule={0: 8, 5: 4, 10: 2}")
    register("step", StepSchedule, description="optimizer-step-keyed factors: schedule={0: 8, 1000: 4}")
    register(
        "ramp",
        RampSchedule,
        description="global batch ramp start -> target over N samples/steps (kind='linear'|'stepwise')",
    )
    register(
        "constant_global",
        ConstantGlobalSchedule,
        description="constant global batch: factor = global_batch_size / (micro-batch x world size)",
    )
