"""What a rank's main thread is doing, read from its Python stack: running, or waiting in which collective.

:func:`classify` takes a stack (``sys._current_frames()``; nothing is wrapped, so a training step
costs nothing extra) and names the collective it waits in (which one, called through what, from
which line of user code), or a backward pass that does not progress (DDP's gradient all-reduce runs
in C++: no Python frame names it). Used by the watchdog (:mod:`lplugins._coord.watchdog`) and,
through :class:`Where`, by the failure board. A ``self.log(..., sync_dist=True)`` synced after its
hook returned is named by :func:`lplugins._lightning.runtime.logged_metric` (Lightning internals).

Imports no Lightning and no torch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import FrameType

from lplugins._lightning.runtime import logged_metric

__all__ = ["BATCH_LOOPS", "COLLECTIVES", "Where", "classify", "in_batch_loop", "is_library", "thread_cpu_seconds"]

#: The ``torch.distributed`` functions that are collectives (the outermost one on the stack is named).
COLLECTIVES = frozenset(
    {
        "barrier", "monitored_barrier", "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_object",
        "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced", "broadcast", "broadcast_object_list",
        "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "gather", "gather_object",
        "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send", "recv", "send_object_list",
        "recv_object_list", "batch_isend_irecv", "wait",
    }
)  # fmt: skip
#: The files of Lightning's loops that run batches (``<namespace>/loops/<file>``, method ``run``): training
#: epochs, validation (the sanity check included), test and prediction. A main thread inside one is past set-up.
BATCH_LOOPS = ("training_epoch_loop.py", "evaluation_loop.py", "prediction_loop.py")
_LIBRARY_PACKAGES = (
    "torch", "lightning", "lightning_fabric", "lightning_utilities", "pytorch_lightning", "deepspeed",
    "torchmetrics", "lplugins",
)  # fmt: skip


@dataclass(frozen=True)
class Where:
    """What a rank's main thread is doing, as the watchdog sees it.

    Attributes:
        kind: ``"run"``, ``"collective"`` (a ``torch.distributed`` call or lplugins' agreement),
            ``"backward"`` (no progress inside a backward pass: DDP's gradient all-reduce) or ``"data"``
            (waiting for the next batch of a DataLoader: not waiting for other ranks, but maybe stalled).
        op: The collective (``"torch.distributed.barrier()"``); empty when running.
        via: The library call user code made to get there (``"Trainer.save_checkpoint"``), if any.
        inside: The library function that called the collective (``"DeepSpeedEngine.save_checkpoint"``), if
            not user code itself.
        site: ``file:line`` of the user code it is waiting in (the innermost frame when none is); for
            ``"run"``, the innermost line of user code.
        shape: The shape of the tensor a collective was given (``"[8]"``), when it has one.
    """

    kind: str
    op: str = ""
    via: str = ""
    site: str = ""
    inside: str = ""
    shape: str = ""

    @property
    def blocked(self) -> bool:
        """Whether this state waits for other ranks."""
        return self.kind in ("collective", "backward")

    def describe(self) -> str:
        """``torch.distributed.barrier() in DDPStrategy.barrier (through Trainer.save_checkpoint) at train.py:42``."""
        inside = f" in {self.inside}" if self.inside and self.inside != self.via else ""
        via = f" (through {self.via})" if self.via else ""
        shape = f" (tensor shape {self.shape})" if self.shape else ""
        if self.kind == "run":
            return f"running at {self.site}" if self.site else "running"
        return f"{self.op}{shape}{inside}{via} at {self.site}" if self.site else f"{self.op}{shape}{inside}{via}"


_library_cache: dict[str, bool] = {}
_library_roots: tuple[str, ...] | None = None


def _roots() -> tuple[str, ...]:
    global _library_roots
    if _library_roots is None:
        import sysconfig

        roots = {os.path.dirname(os.__file__), sysconfig.get_paths()["stdlib"]}
        for name in _LIBRARY_PACKAGES:
            module = sys.modules.get(name)
            file = getattr(module, "__file__", None)
            if file:
                roots.add(os.path.dirname(os.path.abspath(file)))
        _library_roots = tuple(os.path.join(r, "") for r in roots)
    return _library_roots


def _is_library(filename: str) -> bool:
    known = _library_cache.get(filename)
    if known is None:
        known = filename.startswith("<") or os.path.abspath(filename).startswith(_roots())
        _library_cache[filename] = known
    return known


def is_library(filename: str) -> bool:
    """Whether ``filename`` belongs to Python, torch, Lightning, DeepSpeed or lplugins (not the user's code)."""
    return _is_library(filename)


def _site(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _qualname(frame: FrameType) -> str:
    return getattr(frame.f_code, "co_qualname", frame.f_code.co_name)


def in_batch_loop(frame: FrameType | None) -> bool:
    """Whether a (main thread's) stack is inside one of Lightning's loops that run batches (:data:`BATCH_LOOPS`).

    Set-up (the process group, the strategy's ``setup``: DeepSpeed's engine, FSDP's sharding, a checkpoint's
    restore) comes before; the sanity check, the first batch and every step after it are inside.
    """
    while frame is not None:
        code = frame.f_code
        if code.co_name == "run" and os.path.basename(code.co_filename) in BATCH_LOOPS:
            if os.path.basename(os.path.dirname(code.co_filename)) == "loops":
                return True
        frame = frame.f_back
    return False


def classify(frame: FrameType | None, waiting: str | None = None, cpu_idle: bool = False) -> Where:
    """Classify a (main thread's) stack; ``waiting`` names lplugins' agreement when the thread is in it."""
    frames: list[FrameType] = []
    while frame is not None and len(frames) < 200:
        frames.append(frame)  # innermost first
        frame = frame.f_back
    if not frames:
        return Where("run")
    op_index = None
    for i, f in enumerate(frames):
        name = f.f_code.co_name
        if (
            name in COLLECTIVES
            and f"{os.sep}distributed{os.sep}" in f.f_code.co_filename
            and _is_library(f.f_code.co_filename)
        ):
            op_index = i  # keep going: the outermost one is what the caller called
    if waiting is not None:
        kind, op, start = "collective", waiting, 0
    elif op_index is not None:
        kind, op, start = "collective", f"torch.distributed.{frames[op_index].f_code.co_name}()", op_index
    elif cpu_idle and _in_backward(frames):
        kind, op, start = "backward", "the gradient all-reduce of a backward pass (DDP)", 0
    elif cpu_idle and (awaits := _awaited_collective(frames[0])):
        kind, op, start = "collective", awaits, 0
    elif (loader := _in_dataloader(frames)) is not None:
        first = getattr(loader.f_locals.get("self"), "_num_yielded", 1) == 0  # workers may still be starting
        kind, op, start = "data", f"the DataLoader's {'first' if first else 'next'} batch", 0
    else:
        site = next((_site(f) for f in frames if not _is_library(f.f_code.co_filename)), "")
        return Where("run", site=site)
    via, site, inside = "", "", ""
    if op_index is not None and waiting is None:
        for f in frames[op_index + 1 :]:
            if f"{os.sep}distributed{os.sep}" not in f.f_code.co_filename:
                inside = _qualname(f) if _is_library(f.f_code.co_filename) else ""
                break
    for i in range(start, len(frames)):
        if not _is_library(frames[i].f_code.co_filename):
            site = _site(frames[i])
            called = frames[i - 1] if i > 0 else None  # what user code called, unless it is the collective itself
            if called is not None and f"{os.sep}distributed{os.sep}" not in called.f_code.co_filename:
                via = _qualname(called)
            break
    if kind == "backward" or (op_index is None and waiting is None):
        via = ""  # whatever called fit (or the module): not what waits
    logged = logged_metric(frames, _is_library)
    if logged is not None:
        via, site = logged[0], logged[1] or site
    shape = ""
    if op_index is not None and waiting is None:
        tensor = frames[op_index].f_locals.get("tensor")
        size = getattr(tensor, "shape", None)
        if size is not None:
            shape = str(list(size))
    return Where(kind, op, via, site or _site(frames[0]), inside, shape)


#: Where a strategy waits for a collective it started asynchronously (``Work.wait()`` runs in C++: no Python frame
#: names the collective), as (path fragment, what it is called).
_AWAITING = ((f"{os.sep}distributed{os.sep}fsdp{os.sep}", "FSDP2's"),)


def _awaited_collective(frame: FrameType) -> str:
    """``"FSDP2's collective awaited in foreach_all_gather_copy_out()"`` when the innermost frame is where a
    strategy waits for its own collective (and the thread's CPU is idle), else ``""``."""
    file = frame.f_code.co_filename
    for fragment, owner in _AWAITING:
        if fragment in file and _is_library(file):
            return f"{owner} collective awaited in {_qualname(frame)}()"
    return ""


def _in_dataloader(frames: list[FrameType]) -> FrameType | None:
    """The frame of a DataLoader iterator's ``__next__`` the thread waits in (or computes a batch in), if any."""
    marker = f"{os.sep}utils{os.sep}data{os.sep}"
    return next((f for f in frames if f.f_code.co_name == "__next__" and marker in f.f_code.co_filename), None)


def _in_backward(frames: list[FrameType]) -> bool:
    f = frames[0]
    return f.f_code.co_name in ("_engine_run_backward", "backward") and f"{os.sep}autograd{os.sep}" in (
        f.f_code.co_filename
    )


def thread_cpu_seconds(native_id: int | None) -> float | None:
    """CPU time of one thread of this process (Linux), ``None`` where it cannot be read."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
