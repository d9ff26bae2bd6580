"""The failure board: lplugins' keys in the default process group's store, and agreements through it.

Out of band: set/get/add on the store the group was made with never pair with a collective a
strategy runs. Each rank's watchdog publishes its state here (its heartbeat); a rank's real error is
posted here so the others can name it; :func:`agree` (what ``lplugins.callbacks`` uses to agree on a
failed save or load) collects every rank's answer, a rank stuck in a strategy's own collective being
answered for by its watchdog. Rank 0's process hosts the store (outside torchrun): after an
agreement it waits until every rank has read the answers, so a clean run never ends with a rank that
could not reach the store (``Board._release``).

May import: the logger, :mod:`lplugins._coord.stacks` and :mod:`lplugins._coord.elastic`; torch and
:mod:`lplugins._lightning.runtime` (the one torch private it uses) inside
functions.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from lplugins._coord import elastic, procs
from lplugins._coord.stacks import Where
from lplugins._log import log

__all__ = ["DEFAULT_TIMEOUT", "Agreement", "Board", "add_note", "agree", "configure", "current_board", "stop_signal"]

#: How long a failing rank waits for the others' answers when the watchdog is off (seconds).
DEFAULT_TIMEOUT = 30.0
#: Seconds without a heartbeat after which an agreement stops waiting for a rank (its process is gone).
SILENT_RANK_S = 90.0
#: Seconds rank 0 waits, after an agreement, for every rank to say it has read the answers.
RELEASE_WAIT_S = 10.0

_lock = threading.Lock()
_board: Board | None = None
_bound: float = DEFAULT_TIMEOUT  # the watchdog's bound (0: off)
_watched = False  # whether a watchdog thread publishes this rank's state


def configure(bound: float, watched: bool) -> None:
    """Set by the watchdog (:func:`lplugins._coord.watchdog.arm`): its bound, and whether it runs here."""
    global _bound, _watched
    _bound, _watched = bound, watched


@dataclass
class Agreement:
    """What :func:`agree` learned: every failing rank's error, and the ranks that could not answer.

    Attributes:
        failures: ``(rank, "Type: message")`` of each failing rank, in rank order.
        first: The rank that failed first (posted first), ``None`` when none failed.
        blocked: ``(rank, what it waits in)`` of ranks whose watchdog answered for them.
        missing: Ranks that gave no answer within the wait.
    """

    failures: list[tuple[int, str]] = field(default_factory=list)
    first: int | None = None
    blocked: list[tuple[int, str]] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)


class Board:
    """lplugins' keys in the default group's store: ranks' states, failures and agreement answers."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        from lplugins._lightning.runtime import default_store

        # the default store, the one the group was made with: set/get/add never pair with collectives
        base = default_store()
        # weak references: holding the group or its store would keep rank 0's store server (its port) alive
        # after destroy_process_group, and a new group on the same port could not start
        self._store = weakref.ref(base)
        self._group = weakref.ref(group)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.rounds = 0  # agreements this process started on this group
        self.waiting: str | None = None  # the agreement the main thread waits in
        self.answered: dict[int, Agreement] = {}  # rounds the watchdog answered for the main thread
        self.failures: dict[int, dict[str, Any]] = {}  # index -> record: every failure seen
        self.seen = 0
        self.dead = False  # the store is gone (rank 0's process ended)
        self.lock = threading.Lock()
        self.read_lock = threading.Lock()
        self.prefix = elastic.store_prefix()
        # where this rank's process runs: a rank on the same host learns at once when it has ended
        self.store.set(f"proc/{self.rank}", json.dumps({"host": procs.host(), "pid": os.getpid()}))
        self._procs: dict[int, dict[str, Any]] = {}

    @property
    def store(self) -> Any:
        """lplugins' keys (``lplugins/...``) in the group's store.

        Raises:
            RuntimeError: the group was destroyed.
        """
        import torch.distributed as dist

        base = self._store()
        if base is None:
            raise RuntimeError("the process group's store is gone (destroy_process_group)")
        return dist.distributed_c10d.PrefixStore(self.prefix, base)

    def is_for(self, group: Any) -> bool:
        """Whether this board belongs to ``group`` (the current default group, or ``None``)."""
        return group is not None and self._group() is group

    # -- failures
    def post_failure(self, text: str, where: str, round_: int, kind: str | None = None, rank: int | None = None) -> int:
        """Post a failure (``kind``: ``"fatal"``/``"verdict"`` for the watchdog's, of ``rank``); its index."""
        record: dict[str, Any] = {"rank": self.rank if rank is None else rank, "error": text, "where": where}
        record["round"] = round_
        if kind is not None:
            record["kind"] = kind
        index = int(self.store.add("failures", 1))
        record["index"] = index
        self.store.set(f"failure/{index}", json.dumps(record))
        self.failures[index] = record
        return index

    def read_failures(self) -> list[dict[str, Any]]:
        """New failure records of other ranks (cached)."""
        with self.read_lock:
            count = int(self.store.add("failures", 0))
            new = []
            while self.seen < count:
                self.seen += 1
                if self.seen in self.failures:
                    continue
                record = json.loads(self.store.get(f"failure/{self.seen}"))
                record["index"] = self.seen
                self.failures[self.seen] = record
                new.append(record)
            return new

    def failure_text(self, exclude: int | None = None) -> str:
        lines = [
            r["error"] if r.get("kind") else f"rank {r['rank']} failed in {r['where']}: {r['error']}"
            for _, r in sorted(self.failures.items())
            if r["rank"] != exclude
        ]
        return "; ".join(lines)

    # -- agreement
    def agree(self, text: str | None, where: str, wait: float) -> Agreement:
        with self.lock:
            self.rounds += 1
            n = self.rounds
            pre = self.answered.pop(n, None)
            if pre is None:
                if text is not None:
                    self.post_failure(text, where, n)
                self.store.set(f"agree/{n}/{self.rank}", json.dumps({"error": text}))
                self.waiting = f"lplugins' agreement on {where}"
        if pre is not None:  # the watchdog answered for this rank while it was stuck: no store needed
            if text is not None:
                pre.failures = sorted([*pre.failures, (self.rank, text)])
                if pre.first is None:
                    pre.first = self.rank
            return pre
        try:
            result = self._collect(n, wait)
        finally:
            self.waiting = None
        if n > 2:
            self._forget(f"agree/{n - 2}/{self.rank}")
        self._release(n, result)
        return result

    def _release(self, n: int, result: Agreement) -> None:
        """Say that this rank has read round ``n``; rank 0 (the store's host) waits until every rank has.

        Rank 0's process hosts the store (outside torchrun): once it has every answer it may end, and
        the store with it, while a slower rank is still reading the answers. So every rank counts
        itself out (its last store call of the round) and rank 0 goes on only when all ranks that
        answered themselves have, or after :data:`RELEASE_WAIT_S` (a rank that died after answering
        is reported by what comes next, not here).
        """
        key = f"agree/{n}/read"
        try:
            self.store.add(key, 1)
        except RuntimeError:  # the host has gone after every rank answered: nothing left to read
            return
        if self.rank != 0 or result.missing:
            return
        expected = self.world - len(result.blocked)  # a rank answered for by its watchdog reads nothing
        deadline, pause = time.monotonic() + RELEASE_WAIT_S, 0.0005
        while int(self.store.add(key, 0)) < expected:
            if time.monotonic() > deadline:
                log.debug("lplugins: not every rank confirmed reading agreement round %d within %gs", n, RELEASE_WAIT_S)
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        if n > 2:
            self._forget(f"agree/{n - 2}/read")

    def _collect(self, n: int, wait: float) -> Agreement:
        keys = {r: f"agree/{n}/{r}" for r in range(self.world)}
        answers: dict[int, dict[str, Any]] = {}
        deadline, pause = time.monotonic() + wait, 0.0005
        silent: list[int] = []
        next_check = time.monotonic() + 1.0
        while len(answers) < self.world:
            for r, key in keys.items():
                if r not in answers and self.store.check([key]):
                    answers[r] = json.loads(self.store.get(key))
            if len(answers) == self.world or time.monotonic() > deadline:
                break
            stopped = elastic.stopped_for()
            if stopped is not None and stopped >= elastic.STOP_GRACE_S:
                elastic.end_if_peers_gone(self, answers)
            if time.monotonic() > next_check:  # a rank whose watchdog went quiet: its process is gone
                next_check = time.monotonic() + 1.0
                silent = [r for r in keys if r not in answers and self._silent(r)]
                if silent:
                    break
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        result = Agreement(missing=[r for r in range(self.world) if r not in answers])
        for r, answer in sorted(answers.items()):
            if answer.get("error") is not None:
                result.failures.append((r, answer["error"]))
            if answer.get("blocked"):
                result.blocked.append((r, answer["blocked"]))
        if result.failures:
            self.read_failures()
            order = [rec["rank"] for _, rec in sorted(self.failures.items()) if rec["round"] == n]
            result.first = order[0] if order else result.failures[0][0]
        return result

    def heartbeat_age(self, rank: int) -> float:
        """Seconds since ``rank``'s watchdog last published its state (infinite when it never did)."""
        if not self.store.check([f"state/{rank}"]):
            return float("inf")
        return time.time() - float(json.loads(self.store.get(f"state/{rank}"))["t"])

    def _silent(self, rank: int) -> bool:
        """Whether ``rank`` is gone: its process ran on this host and has ended, or its watchdog published a
        heartbeat once and then none for :data:`SILENT_RANK_S` (a rank on another host)."""
        if self._ended(rank):
            return True
        if not _watched or not self.store.check([f"state/{rank}"]):
            return False  # no watchdog here or there: nothing to judge by
        state = json.loads(self.store.get(f"state/{rank}"))
        return bool(time.time() - state["t"] > max(SILENT_RANK_S, 3 * _bound))

    def _ended(self, rank: int) -> bool:
        """Whether ``rank``'s process ran on this host and is no longer running (killed, crashed)."""
        proc = self._procs.get(rank)
        if proc is None:
            if not self.store.check([f"proc/{rank}"]):
                return False  # its board is not made yet: nothing to judge by
            proc = self._procs[rank] = json.loads(self.store.get(f"proc/{rank}"))
        return bool(proc["host"] == procs.host() and not procs.running(int(proc["pid"])))

    def answer_for_main(self, state: Where) -> None:
        """Answer, for a main thread stuck in a collective, each agreement a failing rank waits in."""
        for _, record in sorted(self.failures.items()):
            n = record["round"]
            if record["rank"] == self.rank or n in self.answered:
                continue
            with self.lock:
                if self.rounds != n - 1 or self.waiting is not None:
                    continue  # the main thread is past it, or will answer it itself
                self.store.set(f"agree/{n}/{self.rank}", json.dumps({"error": None, "blocked": state.describe()}))
                failures = sorted((r["rank"], r["error"]) for _, r in sorted(self.failures.items()) if r["round"] == n)
                first = next((r["rank"] for _, r in sorted(self.failures.items()) if r["round"] == n), None)
                self.answered[n] = Agreement(failures=failures, first=first)

    def _forget(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except Exception:  # housekeeping only
            pass


def stop_signal(signum: int | None) -> None:
    """Note torchrun's stop signal (SIGTERM) under torchelastic (from lplugins' preemption-signal handler).

    Outside torchelastic it does nothing: the signal is a preemption, saved at the next step boundary.
    Under torchelastic it posts ``signalled/<rank>`` on the failure board (the other ranks then know
    this one is alive and stopping too), and from then on an agreement this rank waits in ends the
    process once a rank that has not answered has not got the signal either (see
    :func:`lplugins._coord.elastic.end_if_peers_gone`) instead of waiting for torchrun's SIGKILL.
    ``None`` forgets the signal (a new fit).
    """
    if not elastic.note_stop(signum):
        return
    board = _board
    if board is not None and not board.dead:
        try:
            board.store.set(f"signalled/{board.rank}", "1")
        except Exception:  # the store is gone: the agreement learns that itself
            pass


def current_board() -> Board | None:
    """The board of the current default group (made on first use), ``None`` without a multi-process group."""
    global _board
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        _board = None
        return None
    group = dist.group.WORLD
    with _lock:
        if _board is None or not _board.is_for(group):
            _board = Board(group)
        return _board


def agree(text: str | None, where: str) -> Agreement:
    """Every rank's answer at ``where`` (``text``: this rank's error, ``None``: it succeeded); all ranks call it.

    Out of band (the store): it cannot pair with a collective a strategy runs. A rank that failed
    waits for the others at most the bound (30 s when the watchdog is off); the others wait as long
    as a collective would (the process-group timeout). A rank stuck in a strategy's collective is
    answered for by its watchdog.

    Raises:
        RuntimeError: the store cannot be reached (rank 0's process ended), with what is known.
    """
    import torch.distributed as dist

    board = current_board()
    if board is None:
        return Agreement(failures=[(0, text)] if text is not None else [], first=0 if text is not None else None)
    if text is not None:
        wait = _bound or DEFAULT_TIMEOUT
    else:  # as long as a collective would wait
        wait = dist.constants.default_pg_timeout.total_seconds()
    try:
        return board.agree(text, where, wait)
    except RuntimeError as err:
        known = board.failure_text(exclude=board.rank)
        raise RuntimeError(
            f"lplugins could not reach the other ranks to agree on {where} ({err})."
            + (f" Known failures: {known}." if known else "")
        ) from err


def add_note(err: BaseException, note: str) -> None:
    """``err.add_note(note)`` (Python 3.11+); on 3.10 the note is kept in ``__notes__`` and in the log."""
    if hasattr(err, "add_note"):
        err.add_note(note)
    else:  # Python 3.10: tracebacks do not print notes
        err.__notes__ = [*getattr(err, "__notes__", ()), note]  # type: ignore[attr-defined]
        log.error("%s", note)
