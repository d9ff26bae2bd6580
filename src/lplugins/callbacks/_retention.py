"""Retention: which committed checkpoints to keep (the last K, the best K by a metric), and the ledger of them.

Old checkpoints are deleted only after a newer one is committed, on a background thread on rank 0
(a failed delete keeps the checkpoint and logs a warning: nothing is lost).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from dataclasses import dataclass

from lplugins.callbacks._background import BackgroundQueue
from lplugins.callbacks._record import COMMIT_SUFFIX, NameTemplate, Record, order
from lplugins.callbacks._storage import Storage

__all__ = ["Ledger", "Retention"]

log = logging.getLogger("lplugins")

_DELETES_IN_FLIGHT = 1 << 16


@dataclass(frozen=True)
class Retention:
    """Which checkpoints to keep: always the newest, the newest ``keep_last``, the best ``keep_top`` by ``monitor``.

    Attributes:
        keep_last: Keep the newest this many (``None``: all).
        keep_top: Also keep the best this many by ``monitor`` (0: none).
        monitor: The logged metric ``keep_top`` ranks by.
        mode: ``"min"`` or ``"max"``: which values are better.
    """

    keep_last: int | None = 3
    keep_top: int = 0
    monitor: str | None = None
    mode: str = "min"

    def keep(self, records: list[Record]) -> set[str]:
        """The names to keep among ``records`` (commit order, newest last; not empty).

        >>> recs = [Record(f"c{i}", i, 0, 0.0, monitor="loss", metric=m) for i, m in enumerate([3.0, 1.0, 2.0, 4.0])]
        >>> sorted(Retention(keep_last=1, keep_top=1, monitor="loss").keep(recs))
        ['c1', 'c3']
        """
        keep = {records[-1].name}
        keep |= {r.name for r in (records if self.keep_last is None else records[-self.keep_last :])}
        if self.keep_top:
            scored = [
                r for r in records if r.metric is not None and r.monitor == self.monitor and not math.isnan(r.metric)
            ]
            sign = 1.0 if self.mode == "min" else -1.0
            scored.sort(key=lambda r: sign * float(r.metric or 0.0))
            keep |= {r.name for r in scored[: self.keep_top]}
        return keep


class Ledger:
    """The committed checkpoints of one directory that a callback keeps (rank 0's view), thread-safe.

    Args:
        storage: The checkpoint directory.
        retention: What to keep after each commit.
    """

    def __init__(self, storage: Storage, retention: Retention) -> None:
        self.storage = storage
        self.retention = retention
        self._records: list[Record] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._deleter: BackgroundQueue | None = None

    def open(self) -> None:
        """Read the committed checkpoints already in the directory; delete old ones off the calling thread from now."""
        with self._lock:
            self._records = self.storage.find_committed()
            self._seq = max((r.seq for r in self._records), default=0)
        self._deleter = BackgroundQueue(_DELETES_IN_FLIGHT)

    def names(self) -> list[str]:
        """The names of the checkpoints kept, oldest first."""
        with self._lock:
            return [r.name for r in self._records]

    def free_name(self, base: str) -> str:
        """A checkpoint name for ``base`` (a :meth:`NameTemplate.base`) that nothing in the directory uses."""
        entries = set(self.storage.listdir())
        version = 0
        while (name := NameTemplate.name(base, version)) in entries or name + COMMIT_SUFFIX in entries:
            version += 1
        return name

    def next_seq(self) -> int:
        """The commit sequence number of the next commit."""
        with self._lock:
            self._seq += 1
            return self._seq

    def add(self, record: Record) -> None:
        """Record a commit, then apply retention (only now may older checkpoints go)."""
        with self._lock:
            self._records.append(record)
            self._records.sort(key=order)
            keep = self.retention.keep(self._records)
            doomed = [r for r in self._records if r.name not in keep]
            self._records = [r for r in self._records if r.name in keep]
        deleter = self._deleter
        for r in doomed:
            if deleter is None:
                self.storage.delete(r.name)
            else:
                deleter.submit(functools.partial(_delete_quietly, self.storage, r.name))

    def forget(self, name: str) -> None:
        """Drop ``name`` from the kept checkpoints (it was moved to the quarantine: retention never touches it)."""
        with self._lock:
            self._records = [r for r in self._records if r.name != name]

    def flush(self) -> None:
        """Wait for the deletes in flight."""
        if self._deleter is not None:
            self._deleter.flush()

    def close(self) -> None:
        """Finish the deletes in flight and stop the background thread."""
        if self._deleter is not None:
            deleter, self._deleter = self._deleter, None
            deleter.close()


def _delete_quietly(storage: Storage, name: str) -> None:
    """Retention's delete of an old checkpoint: a failure leaves it in place with a warning (nothing is lost)."""
    try:
        storage.delete(name)
    except Exception as err:  # a background thread: report, keep the checkpoint, go on
        log.warning("DurableCheckpoint: could not delete old checkpoint %s: %s", storage.path(name), err)
