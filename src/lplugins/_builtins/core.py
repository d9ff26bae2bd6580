"""The essential built-in plugin ``core``: Lightning's own callbacks by name.

It cannot be blocked. Every factory imports Lightning only when it is called.
"""

from __future__ import annotations

from typing import Any

from lplugins.hookspecs import Register, hookimpl


def _lightning_callback(name: str) -> Any:
    def factory(**kwargs: Any) -> Any:
        from lightning.pytorch import callbacks

        return getattr(callbacks, name)(**kwargs)

    factory.__name__ = name
    factory.__qualname__ = name
    # where **kwargs go, for the parameter check (lplugins._plugins.params), without importing Lightning now
    factory.lplugins_forwards_to = f"lightning.pytorch.callbacks:{name}"  # type: ignore[attr-defined]
    return factory


_CALLBACKS = {
    "model_checkpoint": ("ModelCheckpoint", "Lightning's ModelCheckpoint"),
    "early_stopping": ("EarlyStopping", "Lightning's EarlyStopping (give monitor=...)"),
    "lr_monitor": ("LearningRateMonitor", "Lightning's LearningRateMonitor"),
    "device_stats": ("DeviceStatsMonitor", "Lightning's DeviceStatsMonitor"),
    "throughput": ("ThroughputMonitor", "Lightning's ThroughputMonitor (give batch_size_fn=...)"),
}


@hookimpl
def lplugins_register_callbacks(register: Register) -> None:
    for name, (cls_name, description) in _CALLBACKS.items():
        register(name, _lightning_callback(cls_name), description=description)
