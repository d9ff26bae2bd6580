"""``lplugins checkpoint export SRC OUT``: any checkpoint as one plain file, for inference or a new run.

``SRC`` is a checkpoint in any layout a built-in strategy writes (one file; a DeepSpeed ZeRO directory of any
stage and world size; an FSDP2 sharded directory), or a ``DurableCheckpoint`` directory (its newest committed
checkpoint). A committed checkpoint is verified against its commit marker (every byte) first. ``OUT`` gets, written
atomically (a temporary file, ``fsync``, rename):

* by default, the model's plain state dict, ``{name: tensor}``, fp32 values as trained: ``model.load_state_dict(
  torch.load(OUT, weights_only=True))``, no Lightning, no DeepSpeed;
* with ``--full``, one full Lightning checkpoint (weights, optimizer state, loops, callbacks, LR schedulers):
  ``Model.load_from_checkpoint(OUT)``, or ``trainer.fit(ckpt_path=OUT)`` with any strategy on any world size.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from lplugins._errors import LPluginsError

__all__ = ["ExportError", "add_parser", "export_checkpoint"]


class ExportError(LPluginsError, ValueError):
    """The source cannot be exported (the message names it and why)."""


def _source(src: str) -> str:
    """The checkpoint ``src`` names: itself, or a ``DurableCheckpoint`` directory's newest committed checkpoint."""
    from lplugins._lightning.portable import layout
    from lplugins.callbacks import latest_checkpoint

    if not os.path.exists(src):
        raise ExportError(f"{src!r} does not exist: pass a checkpoint (file or directory) or a checkpoint directory")
    if layout(src) is not None:
        return src
    newest = latest_checkpoint(src) if os.path.isdir(src) else None
    if newest is None:
        raise ExportError(
            f"{src!r} is neither a checkpoint (a file, a DeepSpeed ZeRO directory, an FSDP2 sharded directory) nor a"
            " DurableCheckpoint directory with a committed checkpoint"
        )
    return os.fspath(newest)


def _verify(path: str) -> str:
    """Check a committed checkpoint's bytes against its commit marker; what was checked, in words."""
    from lplugins.callbacks._record import COMMIT_SUFFIX, Record
    from lplugins.callbacks._storages import open_storage

    parent, name = os.path.split(os.path.abspath(path.rstrip("/")))
    marker = os.path.join(parent, name + COMMIT_SUFFIX)
    if not os.path.isfile(marker):
        return "not verified (no commit marker beside it)"
    storage = open_storage(parent)
    with open(marker, "rb") as f:
        record = Record.from_json(f.read())
    problem = storage.check(record, deep=True)
    if problem is not None:
        raise ExportError(f"{path} does not match its commit marker ({problem}): not exported")
    return "every byte verified against its commit marker"


def _full(path: str) -> dict[str, Any]:
    """The full checkpoint of ``path`` (a ZeRO directory: read once, each parameter cut out of the ranks'
    partitions; no conversion written)."""
    from lplugins._lightning.portable import full_checkpoint
    from lplugins._lightning.zero_shards import compact

    checkpoint: dict[str, Any] = compact(full_checkpoint(path))
    return checkpoint


def export_checkpoint(src: str, out: str, full: bool = False) -> dict[str, Any]:
    """Write the checkpoint ``src`` (any layout) to the single file ``out``: a plain state dict, or (``full``) one
    full Lightning checkpoint. Returns what was done (``source``, ``layout``, ``tensors``, ``bytes``, ``checked``).

    Raises:
        ExportError: ``src`` is not a checkpoint, or does not match its commit marker.
    """
    import torch

    from lplugins._lightning.portable import layout

    path = _source(src)
    checked = _verify(path)
    checkpoint = _full(path)
    payload = checkpoint if full else dict(checkpoint.get("state_dict") or {})
    target = os.path.abspath(out)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp.export.", dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    tensors = len(checkpoint.get("state_dict") or {})
    return {"source": path, "layout": layout(path), "tensors": tensors, "bytes": os.path.getsize(target),
            "checked": checked}  # fmt: skip


def add_parser(sub: Any) -> None:
    """Add the ``checkpoint`` subcommand (``checkpoint export``)."""
    p = sub.add_parser(
        "checkpoint",
        help="work with checkpoints (export)",
        description="Work with checkpoints of any strategy and world size.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    e = actions.add_parser(
        "export",
        help="write a checkpoint (any layout) as one plain file",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("src", metavar="SRC", help="a checkpoint file or directory, or a DurableCheckpoint directory")
    e.add_argument("out", metavar="OUT", help="the file to write")
    e.add_argument("--full", action="store_true", help="a full Lightning checkpoint (optimizer, loops...)")
    e.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    done = export_checkpoint(args.src, args.out, full=args.full)
    what = "full checkpoint" if args.full else "state dict"
    print(
        f"exported {done['source']} ({done['layout']}; {done['checked']}) to {args.out}: {what},"
        f" {done['tensors']} tensors, {done['bytes'] / 1e6:.1f} MB"
    )
    return 0
