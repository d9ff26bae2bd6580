"""The deadlock guard: inside a rank-zero block, a collective raises instead of hanging.

``if trainer.is_global_zero: trainer.save_checkpoint(...)`` hangs forever under DDP: the call ends
in a barrier that the other ranks never join (Lightning #18148, #19045). Code inside
:func:`rank_zero_block` (or a function decorated with :func:`rank_zero_only`) is declared to run on
one rank; any ``torch.distributed`` collective or barrier it reaches, and the Lightning calls that
use one, raise :class:`CollectiveInRankZeroBlockError` naming the call and the safe alternative.

Cost model: nothing is patched while no thread is inside a block, so ordinary training steps pay
nothing. Entering the first block installs thin wrappers (a thread-local check) on the collective
functions; leaving the last block removes them. Blocks nest, and each thread is judged on its own:
a collective called by another thread outside any block goes through untouched.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable
from contextlib import ContextDecorator
from types import TracebackType
from typing import Any, TypeVar, overload

from lplugins._errors import LPluginsError, shown_from
from lplugins._lightning.runtime import loaded_classes
from lplugins.rankzero._rank import global_rank

F = TypeVar("F", bound=Callable[..., Any])

#: ``torch.distributed`` functions that every rank (of the group) must call.
TORCH_COLLECTIVES: tuple[str, ...] = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "_all_gather_base",
    "_reduce_scatter_base",
)

#: Strategy methods (Lightning and Fabric) that run a collective under a multi-process strategy.
STRATEGY_COLLECTIVES: tuple[str, ...] = ("barrier", "broadcast", "reduce", "all_gather", "reduce_boolean_decision")

_CHECKPOINT_ALTERNATIVE = (
    "call trainer.save_checkpoint() on every rank, outside the rank-zero block (Lightning writes the file on "
    "rank 0 only), or ask for a checkpoint from this rank with lplugins.callbacks.request_checkpoint(trainer) "
    "(with a DurableCheckpoint callback): it only sets a flag, and every rank saves together at the next step"
)
_LOG_DIR_ALTERNATIVE = (
    "read trainer.log_dir on every rank before the rank-zero block (e.g. in setup()) and use the saved value, "
    "or use trainer.logger.log_dir, which does not broadcast"
)
_SYNC_DIST_ALTERNATIVE = (
    "call self.log(..., sync_dist=True) on every rank, outside the rank-zero block; or log a torchmetrics "
    "Metric (lplugins.metrics.MetricsCallback syncs it once per interval); or drop sync_dist inside the block "
    "and pass rank_zero_only=True"
)
_STRATEGY_ALTERNATIVE = "call it on every rank, outside the rank-zero block"
_TORCH_ALTERNATIVE = (
    "every rank of the group must call it: move it out of the rank-zero block and branch on the rank only "
    "around the work that rank 0 does alone"
)


class CollectiveInRankZeroBlockError(LPluginsError, RuntimeError):
    """A collective operation was called inside a rank-zero block, where it would hang forever.

    Attributes:
        call: The call that was refused, e.g. ``"Trainer.save_checkpoint()"``.
        alternative: What to do instead.
        rank: The global rank that made the call.
    """

    def __init__(self, call: str, alternative: str, rank: int, where: str | None = None) -> None:
        self.call = call
        self.alternative = alternative
        self.rank = rank
        via = f" (called from {where})" if where else ""
        super().__init__(
            f"{call} was called inside a rank-zero block on global rank {rank}{via}. It is a collective "
            f"operation that every rank must join; called from one rank it would hang until the process group "
            f"times out. Instead, {alternative}."
        )


shown_from("lplugins.rankzero", CollectiveInRankZeroBlockError)


# ---------------------------------------------------------------------------------------- state
_local = threading.local()
_lock = threading.RLock()
_active = 0  # blocks open in all threads together; wrappers are installed while > 0
_installed: list[tuple[Any, str, Any]] = []  # (owner, attribute, original value in owner.__dict__)


def in_rank_zero_block() -> bool:
    """Whether the calling thread is inside a rank-zero block.

    Examples:
        >>> in_rank_zero_block()
        False
        >>> with rank_zero_block():
        ...     in_rank_zero_block()
        True
    """
    return bool(getattr(_local, "depth", 0))


def _caller(skip_prefixes: tuple[str, ...]) -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(skip_prefixes):
            return f"{module}.{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}"
        frame = frame.f_back  # type: ignore[assignment]
    return None  # pragma: no cover


def _refuse(call: str, alternative: str, where: str | None = None) -> CollectiveInRankZeroBlockError:
    return CollectiveInRankZeroBlockError(call, alternative, global_rank(), where)


def _wrap_function(original: Callable[..., Any], call: str, alternative: str, *, torch_level: bool) -> Any:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "depth", 0):
            where = _caller(("torch.distributed", "lplugins.rankzero")) if torch_level else None
            raise _refuse(call, alternative, where)
        return original(*args, **kwargs)

    guarded.__lplugins_guarded__ = True  # type: ignore[attr-defined]
    return guarded


def _wrap_log(original: Callable[..., Any]) -> Any:
    signature = inspect.signature(original)

    def wants_sync(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        try:
            return bool(signature.bind(self, *args, **kwargs).arguments.get("sync_dist"))
        except TypeError:  # let the original report the bad call
            return False

    @functools.wraps(original)
    def log(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "depth", 0) and wants_sync(self, args, kwargs):
            name = type(self).__name__
            raise _refuse(f"{name}.{original.__name__}(..., sync_dist=True)", _SYNC_DIST_ALTERNATIVE)
        return original(self, *args, **kwargs)

    log.__lplugins_guarded__ = True  # type: ignore[attr-defined]
    return log


def _patch(owner: Any, attr: str, replacement: Any) -> None:
    original = owner.__dict__[attr]
    setattr(owner, attr, replacement)
    _installed.append((owner, attr, original))


def _all_subclasses(cls: type) -> list[type]:
    seen: list[type] = []
    stack = [cls]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.append(current)
        stack.extend(current.__subclasses__())
    return seen


def _install_torch() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    wrapped: dict[int, Any] = {}
    for namespace in (dist, c10d):
        if namespace is None:
            continue
        for name in TORCH_COLLECTIVES:
            original = namespace.__dict__.get(name)
            if original is None or not callable(original):
                continue
            if id(original) not in wrapped:
                wrapped[id(original)] = _wrap_function(
                    original, f"torch.distributed.{name}()", _TORCH_ALTERNATIVE, torch_level=True
                )
            _patch(namespace, name, wrapped[id(original)])


def _install_lightning() -> None:
    for trainer_cls in loaded_classes("Trainer"):
        _patch(
            trainer_cls,
            "save_checkpoint",
            _wrap_function(
                trainer_cls.save_checkpoint, "Trainer.save_checkpoint()", _CHECKPOINT_ALTERNATIVE, torch_level=False
            ),
        )
        getter = _wrap_function(
            trainer_cls.__dict__["log_dir"].fget, "Trainer.log_dir", _LOG_DIR_ALTERNATIVE, torch_level=False
        )
        _patch(trainer_cls, "log_dir", property(getter, doc=trainer_cls.__dict__["log_dir"].__doc__))
    for module_cls in loaded_classes("LightningModule"):
        for name in ("log", "log_dict"):
            _patch(module_cls, name, _wrap_log(module_cls.__dict__[name]))
    for base in loaded_classes("Strategy"):
        for cls in _all_subclasses(base):
            for name in STRATEGY_COLLECTIVES:
                original = cls.__dict__.get(name)
                if not callable(original) or isinstance(original, (staticmethod, classmethod)):
                    continue
                call = f"{cls.__name__}.{name}() (strategy.{name})"
                _patch(cls, name, _wrap_function(original, call, _STRATEGY_ALTERNATIVE, torch_level=False))


def _install() -> None:
    try:
        _install_torch()
        _install_lightning()
    except BaseException:
        _uninstall()
        raise


def _uninstall() -> None:
    while _installed:
        owner, attr, original = _installed.pop()
        setattr(owner, attr, original)


def _enter() -> None:
    global _active
    with _lock:
        if _active == 0:
            _install()
        _active += 1
    _local.depth = getattr(_local, "depth", 0) + 1


def _exit() -> None:
    global _active
    _local.depth -= 1
    with _lock:
        _active -= 1
        if _active == 0:
            _uninstall()


class RankZeroBlock(ContextDecorator):
    """A block of code that runs on one rank only; collectives inside it raise instead of hanging.

    Use :func:`rank_zero_block` to make one. Usable as a context manager and as a decorator; blocks
    nest and are independent per thread.
    """

    def __enter__(self) -> RankZeroBlock:
        _enter()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _exit()


@overload
def rank_zero_block(func: F) -> F: ...


@overload
def rank_zero_block(func: None = None) -> RankZeroBlock: ...


def rank_zero_block(func: F | None = None) -> F | RankZeroBlock:
    """Declare a block of code that runs on one rank only (a context manager or a decorator).

    Inside it, any ``torch.distributed`` collective or barrier, and the Lightning calls that use one
    (``Trainer.save_checkpoint``, ``Trainer.log_dir``, ``self.log(..., sync_dist=True)``,
    ``strategy.barrier/broadcast/reduce/all_gather``, Fabric's likewise), raise
    :class:`CollectiveInRankZeroBlockError` at once instead of hanging, on every world size (so a
    single-process run already catches what would deadlock under DDP). The block itself does not
    skip anything: wrap it in ``if trainer.is_global_zero:``, or use :func:`rank_zero_only`.

    Because the error is raised *before* the collective starts, the ranks stay in step: catching it
    and carrying on is safe.

    Args:
        func: When used as a bare decorator (``@rank_zero_block``), the function to guard.

    Returns:
        A :class:`RankZeroBlock` (or the guarded function).

    Examples:
        >>> import torch.distributed as dist
        >>> with rank_zero_block():
        ...     dist.barrier()
        Traceback (most recent call last):
        ...
        lplugins.rankzero.CollectiveInRankZeroBlockError: torch.distributed.barrier() was called ...
    """
    if func is not None:
        return RankZeroBlock()(func)
    return RankZeroBlock()


def rank_zero_only(func: F) -> F:
    """Run ``func`` on global rank 0 only (returning ``None`` elsewhere), inside a rank-zero block.

    Lightning's ``rank_zero_only`` plus the deadlock guard: a collective reached from ``func`` raises
    :class:`CollectiveInRankZeroBlockError` instead of hanging.

    Args:
        func: The function.

    Returns:
        The wrapped function.

    Examples:
        >>> @rank_zero_only
        ... def report(value):
        ...     return f"value={value}"
        >>> report(3)
        'value=3'
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if global_rank() != 0:
            return None
        with RankZeroBlock():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
