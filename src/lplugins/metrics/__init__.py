"""Metrics that are right under DDP: torchmetrics synced across ranks, throughput of the whole job.

* :class:`MetricsCallback` feeds torchmetrics ``Metric``/``MetricCollection`` from the step outputs,
  computes them across ranks once per interval and logs each value once, through the Trainer's loggers.
* :class:`ThroughputCallback` logs samples/s, batches/s and tokens/s measured across ranks.

Both are registered by name by the built-in ``logging`` plugin: ``"metrics"`` and ``"rank_throughput"``.
Importing this package imports Lightning and torchmetrics (``import lplugins`` does not).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lplugins.metrics._callback import STAGES, MetricsCallback, build_metric, flatten_values
    from lplugins.metrics._throughput import ThroughputCallback, infer_batch_size

# loaded on first use: importing a Lightning-free module of this package never imports Lightning
_LAZY = {
    "STAGES": "lplugins.metrics._callback",
    "MetricsCallback": "lplugins.metrics._callback",
    "build_metric": "lplugins.metrics._callback",
    "flatten_values": "lplugins.metrics._callback",
    "ThroughputCallback": "lplugins.metrics._throughput",
    "infer_batch_size": "lplugins.metrics._throughput",
}

__all__ = [
    "STAGES",
    "MetricsCallback",
    "ThroughputCallback",
    "build_metric",
    "flatten_values",
    "infer_batch_size",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
