"""Built-in plugin ``checkpoint``: registers ``durable_checkpoint`` (:class:`lplugins.callbacks.DurableCheckpoint`).

Lightning is imported only when the callback is built.
"""

from __future__ import annotations

from typing import Any

from lplugins.hookspecs import Register, hookimpl


def durable_checkpoint(**kwargs: Any) -> Any:
    """Build a :class:`lplugins.callbacks.DurableCheckpoint` (imported on first use)."""
    from lplugins.callbacks.checkpoint import DurableCheckpoint

    return DurableCheckpoint(**kwargs)


#: Where the keyword arguments go (``lplugins._plugins.params`` checks them against it before the Trainer is built).
durable_checkpoint.lplugins_forwards_to = "lplugins.callbacks.checkpoint:DurableCheckpoint"  # type: ignore[attr-defined]


@hookimpl
def lplugins_register_callbacks(register: Register) -> None:
    register(
        "durable_checkpoint",
        durable_checkpoint,
        description="atomic, durable, rank-safe checkpoints; resume with ckpt_path='latest' (or Lightning's 'last')",
    )
