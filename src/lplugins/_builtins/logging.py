"""The built-in plugin ``logging``: rank-zero-safe metric and throughput callbacks, by name.

* ``metrics``: :class:`lplugins.metrics.MetricsCallback` (give ``metrics=...``);
* ``rank_throughput``: :class:`lplugins.metrics.ThroughputCallback`.

(Named ``logging`` after its area; being inside ``lplugins._builtins`` it does not shadow the standard
``logging`` module.) The factories import Lightning and torchmetrics only when called.
"""

from __future__ import annotations

from typing import Any

from lplugins.hookspecs import Register, hookimpl


def metrics(**kwargs: Any) -> Any:
    """Build a :class:`lplugins.metrics.MetricsCallback` (imported lazily)."""
    from lplugins.metrics import MetricsCallback

    return MetricsCallback(**kwargs)


metrics.lplugins_forwards_to = "lplugins.metrics:MetricsCallback"  # type: ignore[attr-defined]


def rank_throughput(**kwargs: Any) -> Any:
    """Build a :class:`lplugins.metrics.ThroughputCallback` (imported lazily)."""
    from lplugins.metrics import ThroughputCallback

    return ThroughputCallback(**kwargs)


rank_throughput.lplugins_forwards_to = "lplugins.metrics:ThroughputCallback"  # type: ignore[attr-defined]


@hookimpl
def lplugins_register_callbacks(register: Register) -> None:
    register(
        "metrics",
        metrics,
        description=(
            "torchmetrics on step outputs (steps return preds/target; logits made probabilities once per run), "
            "synced across ranks, logged once per interval (give metrics=...)"
        ),
    )
    register(
        "rank_throughput",
        rank_throughput,
        description="samples/s, batches/s, tokens/s (seq_len=...) measured across ranks, logged once",
    )
