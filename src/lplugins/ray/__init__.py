"""Ray Train as the engine: a composed Trainer in the workers Ray starts, on one machine or many.

``pip install "lplugins[ray]"``. The Ray names (``ray_ddp``, ``ray_fsdp``, ``ray_deepspeed``, the
cluster environment ``ray``, the callback ``ray_report``) come from the built-in plugin ``ray``; this
module runs a Trainer under ``ray.train.torch.TorchTrainer``:

* :func:`fit` -- ``Trainer(**compose(**trainer)).fit(model, ...)`` in ``num_workers`` workers;
* :func:`run` -- your own training function in the workers, the Trainer built with :func:`compose`;
* :func:`compose` -- :func:`lplugins.compose` inside a worker: what Ray decides filled in, and what
  Ray restored after a failure put back for ``ckpt_path="latest"``;
* :func:`checkpoint_path` -- the ``durable_checkpoint`` path behind a checkpoint lplugins reported to Ray.

Importing this module imports neither Ray nor Lightning. See ``docs/ray.md``.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from lplugins.ray._names import RayUnavailableError

if TYPE_CHECKING:
    from lplugins.ray._run import RayArgumentError, compose, fit, run


def __getattr__(name: str) -> Any:
    """``compose``, ``fit``, ``run`` and ``RayArgumentError`` on first use: ``lplugins.load()`` (which registers the
    Ray names) does not pay for the launcher."""
    if name in ("RayArgumentError", "compose", "fit", "run"):
        value = getattr(importlib.import_module("lplugins.ray._run"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RayArgumentError", "RayUnavailableError", "checkpoint_path", "compose", "fit", "run"]


def checkpoint_path(checkpoint: Any) -> str:
    """The ``durable_checkpoint`` checkpoint behind a checkpoint lplugins reported to Ray.

    Args:
        checkpoint: A ``ray.train.Checkpoint`` (e.g. ``result.checkpoint``) or its local directory.

    Returns:
        The path to pass as ``ckpt_path`` (or to ``torch.load``): in the shared checkpoint directory
        (reported by pointer), or inside the Ray checkpoint's directory (reported as a copy; then
        ``checkpoint`` must be a local directory).

    Raises:
        RayArgumentError: ``checkpoint`` is not one lplugins reported.
    """
    from lplugins.ray._report import read_pointer

    if isinstance(checkpoint, (str, os.PathLike)) and not hasattr(checkpoint, "filesystem"):
        directory: str | None = os.fspath(checkpoint)
        pointer = read_pointer(os.fspath(checkpoint))
    elif hasattr(checkpoint, "as_directory") and hasattr(checkpoint, "path"):  # a ray.train.Checkpoint
        local = type(getattr(checkpoint, "filesystem", None)).__name__ == "LocalFileSystem"
        directory = str(checkpoint.path) if local else None
        with checkpoint.as_directory() as where:  # a remote one is downloaded (a few bytes for a pointer)
            pointer = read_pointer(where)
    else:
        directory, pointer = None, None
    if pointer is None:
        raise RayArgumentError(
            f"checkpoint={checkpoint!r} is not a checkpoint lplugins reported to Ray (no lplugins_checkpoint.json)."
        )
    if pointer["mode"] == "copy":
        if directory is None:
            raise RayArgumentError(
                f"checkpoint={checkpoint!r} holds a copy of the checkpoint in remote storage: download it first "
                "(checkpoint.to_directory()) and pass the local directory."
            )
        return os.path.join(directory, pointer["name"])
    dirpath: str = pointer["dirpath"]
    return f"{dirpath.rstrip('/')}/{pointer['name']}" if "://" in dirpath else os.path.join(dirpath, pointer["name"])
