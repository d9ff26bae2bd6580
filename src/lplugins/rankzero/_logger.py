"""Rank-aware logging: records carry the global rank and, by default, only rank 0 emits them."""

from __future__ import annotations

import builtins
import logging
import warnings
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from lplugins.rankzero._rank import global_rank

if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:
    _Adapter = logging.LoggerAdapter

#: The record attribute that holds the global rank (use ``%(rank)s`` in a format string).
RANK_ATTR = "rank"


def rank_prefix(rank: int) -> str:
    """The prefix put in front of messages that every rank emits.

    Examples:
        >>> rank_prefix(3)
        '[rank 3] '
    """
    return f"[rank {rank}] "


class RankLogger(_Adapter):
    """A ``logging.LoggerAdapter`` whose records carry the global rank and that emits on rank 0 only.

    Every record gets a ``rank`` attribute (``%(rank)s`` in a format string). By default a record is
    emitted only on global rank 0 -- in a DDP run a message is printed once, not once per process.
    Pass ``all_ranks=True`` to a call (or to :func:`get_logger` for every call) to emit on every rank;
    those messages are prefixed with ``[rank N] `` so the lines can be told apart. The rank is read
    from ``torch.distributed`` once it is initialised and from the launcher's environment before
    (see :func:`lplugins.rankzero.rank_info`), so module-level logging works too.

    Args:
        logger: The standard logger to emit through.
        all_ranks: Emit every call on every rank (with the prefix) instead of rank 0 only.
        extra: Extra attributes for every record, as for ``logging.LoggerAdapter``.

    Examples:
        >>> log = get_logger("lplugins.example")
        >>> log.info("printed by rank 0 only")
        >>> log.warning("printed by every rank, prefixed", all_ranks=True)
    """

    def __init__(self, logger: logging.Logger, all_ranks: bool = False, extra: Mapping[str, object] | None = None):
        super().__init__(logger, dict(extra or {}))
        self.all_ranks = bool(all_ranks)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        """Merge the adapter's ``extra`` under the call's own (the call wins)."""
        merged = dict(self.extra or {})
        merged.update(kwargs.get("extra") or {})
        kwargs["extra"] = merged
        return msg, kwargs

    def log(  # type: ignore[override]
        self, level: int, msg: Any, *args: Any, all_ranks: bool | None = None, **kwargs: Any
    ) -> None:
        """Log ``msg % args`` at ``level``, on rank 0 only unless ``all_ranks`` (per call or per logger).

        Args:
            level: The logging level.
            msg: The message (``%``-style with ``args``, as in :mod:`logging`).
            *args: The message arguments.
            all_ranks: Emit on every rank, prefixed with ``[rank N] ``; ``None`` uses the logger's setting.
            **kwargs: ``exc_info``, ``stack_info``, ``stacklevel``, ``extra`` as in :mod:`logging`.
        """
        if not self.logger.isEnabledFor(level):
            return
        rank = global_rank()
        every = self.all_ranks if all_ranks is None else bool(all_ranks)
        if not every and rank != 0:
            return
        msg, processed = self.process(msg, kwargs)
        processed["extra"].setdefault(RANK_ATTR, rank)
        processed["extra"].setdefault("all_ranks", every)
        if every:
            msg = f"{rank_prefix(rank)}{msg}"
        # skip this frame so that %(filename)s/%(lineno)d point at the caller
        processed["stacklevel"] = int(processed.get("stacklevel", 1)) + 1
        self.logger.log(level, msg, *args, **processed)


def get_logger(name: str | None = None, *, all_ranks: bool = False) -> RankLogger:
    """Return a :class:`RankLogger` over ``logging.getLogger(name)``.

    Args:
        name: The logger's name (``__name__`` usually); ``None`` for the root logger.
        all_ranks: Emit every call on every rank, prefixed with ``[rank N] ``.

    Returns:
        The rank-aware logger.

    Examples:
        >>> get_logger("my_project.train").all_ranks
        False
    """
    return RankLogger(logging.getLogger(name), all_ranks=all_ranks)


class RankZeroFilter(logging.Filter):
    """A ``logging.Filter`` that makes any logger or handler rank-zero: it adds ``record.rank`` and
    drops records on ranks other than 0 (unless the record was made with ``all_ranks=True`` by a
    :class:`RankLogger`).

    Attach it to a handler to quiet a third-party library on every rank but 0::

        handler.addFilter(RankZeroFilter())

    Examples:
        >>> record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
        >>> RankZeroFilter().filter(record), record.rank == global_rank()
        (True, True)
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep the record on rank 0 (or when it asks for every rank); set ``record.rank``."""
        rank = getattr(record, RANK_ATTR, None)
        if not isinstance(rank, int):
            rank = global_rank()
            setattr(record, RANK_ATTR, rank)
        return rank == 0 or bool(getattr(record, "all_ranks", False))


def rank_zero_print(*args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
    """``print`` on global rank 0 only (or on every rank, prefixed, with ``all_ranks=True``).

    Args:
        *args: What to print.
        all_ranks: Print on every rank, with ``[rank N]`` first.
        **kwargs: ``sep``, ``end``, ``file``, ``flush`` as for ``print``.

    Examples:
        >>> rank_zero_print("hello")
        hello
    """
    rank = global_rank()
    if all_ranks:
        builtins.print(rank_prefix(rank).rstrip(), *args, **kwargs)
    elif rank == 0:
        builtins.print(*args, **kwargs)


def rank_zero_warn(
    message: str | Warning,
    category: type[Warning] | None = None,
    stacklevel: int = 1,
    *,
    all_ranks: bool = False,
) -> None:
    """``warnings.warn`` on global rank 0 only (or on every rank, prefixed, with ``all_ranks=True``).

    Args:
        message: The warning text (or a ``Warning`` instance).
        category: The warning class (``UserWarning`` by default).
        stacklevel: As for ``warnings.warn``, counted from the caller of this function.
        all_ranks: Warn on every rank, with ``[rank N] `` in front of the message.
    """
    rank = global_rank()
    if not all_ranks and rank != 0:
        return
    if all_ranks:
        if isinstance(message, Warning):
            category = category or type(message)
            message = str(message)
        message = f"{rank_prefix(rank)}{message}"
    warnings.warn(message, category, stacklevel=stacklevel + 1)
