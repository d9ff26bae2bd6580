"""Metrics that are right under DDP: torchmetrics synced across ranks, throughput of the whole job.

* :class:`MetricsCallback` feeds torchmetrics ``Metric``/``MetricCollection`` from the step outputs,
  computes them across ranks once per interval and logs each value once, through the Trainer's loggers.
* :class:`ThroughputCallback` logs samples/s, batches/s and tokens/s measured across ranks.

Both are registered by name by the built-in ``logging`` plugin: ``"metrics"`` and ``"rank_throughput"``.
Importing this package imports Lightning and torchmetrics (``import lplugins`` does not).
"""

from __future__ import annotations

from lplugins.metrics._callback import STAGES, MetricsCallback, build_metric, flatten_values
from lplugins.metrics._throughput import ThroughputCallback, infer_batch_size

__all__ = [
    "STAGES",
    "MetricsCallback",
    "ThroughputCallback",
    "build_metric",
    "flatten_values",
    "infer_batch_size",
]
