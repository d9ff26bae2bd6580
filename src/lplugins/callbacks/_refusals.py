"""Why a checkpoint was not loaded, in words every rank agrees on: the kinds of failure and the refusals.

A candidate's failure travels between ranks as ``"Type: message"`` (:func:`failure_kind` names its
kind, the gravest winning); torch's weights-only refusal becomes an error that names the file and the
type (:func:`unsafe_error`); a refusal to resume on this world size or strategy is raised on every rank
(:func:`refused_error`). Lightning-free.
"""

from __future__ import annotations

import os
import re
from typing import Any

from lplugins.callbacks._errors import DamagedCheckpointError, InconsistentCheckpointError, UnsafeCheckpointError

__all__ = [
    "DAMAGED", "DISALLOWED", "INCONSISTENT", "REFUSALS", "UNREADABLE", "failure_kind", "refused_error", "unsafe_error",
]  # fmt: skip


def unsafe_error(path: Any, err: BaseException) -> UnsafeCheckpointError:
    """The :class:`UnsafeCheckpointError` for torch's refusal ``err`` of ``path``: the file and the disallowed type.

    >>> str(unsafe_error("c.ckpt", Exception("... Unsupported global: GLOBAL fractions.Fraction was not ...")))[:88]
    "Refusing to load checkpoint 'c.ckpt': it holds fractions.Fraction, which torch.load(weig"
    """
    text = str(err)
    found = _GLOBAL_RE.search(text)
    what = found.group(1) if found else None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[-1] if lines else "")
    holds = what if what else "an object"
    allow = f"torch.serialization.add_safe_globals([{what}])" if what else "torch.serialization.add_safe_globals([...])"
    return UnsafeCheckpointError(
        f"Refusing to load checkpoint {os.fspath(path)!r}: it holds {holds}, which torch.load(weights_only=True)"
        f" does not allow (nothing in it was executed). A file you did not write yourself may be malicious: do not"
        f" load it. Only if you trust this file: allow the type with {allow}, or pass weights_only=False to"
        f" fit()/validate()/test() with this ckpt_path.\ntorch said: {detail}"
    )


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


#: Why a candidate was skipped (each said in its own words).
DAMAGED, DISALLOWED, INCONSISTENT, UNREADABLE = "damaged", "disallowed", "inconsistent", "unreadable"
_KIND_OF_TYPE = {
    DamagedCheckpointError.__name__: DAMAGED,
    InconsistentCheckpointError.__name__: INCONSISTENT,
    UnsafeCheckpointError.__name__: DISALLOWED,
}
_SEVERITY = (DAMAGED, INCONSISTENT, DISALLOWED, UNREADABLE)


def failure_kind(failures: list[tuple[int, str]]) -> str:
    """The kind of a candidate's failure, from every failing rank's ``"Type: message"`` (the gravest wins).

    >>> failure_kind([(1, "UnicodeDecodeError: ..."), (0, "DamagedCheckpointError: ...")])
    'damaged'
    """
    kinds = {_KIND_OF_TYPE.get(text.split(":", 1)[0], UNREADABLE) for _, text in failures}
    return next(kind for kind in _SEVERITY if kind in kinds)


#: Errors that refuse a resume on this world size or strategy (by class name, as failures travel between ranks).
REFUSALS = ("ReshardError", "DeepSpeedReshardError")


def refused_error(failures: list[tuple[int, str]], error: BaseException | None) -> None:
    """Raise on every rank when a rank refused the resume (:data:`REFUSALS`): this rank's own error, or a
    :class:`~lplugins.callbacks._reshard.ReshardError` with the refusing rank's message."""
    from lplugins.callbacks._reshard import ReshardError

    for rank, text in failures:
        kind, _, message = text.partition(": ")
        if kind in REFUSALS:
            if error is not None and type(error).__name__ in REFUSALS:
                raise error
            raise ReshardError(f"{message.strip()} (refused on rank {rank})")
