"""Faults the watchdog names besides a collective mismatch, and what every rank does about them.

A rank that **failed** (an uncaught exception: :func:`fatal_text`), whose process **ended** without a
word (SIGKILL, the OOM killer, a C++ abort), that **does not respond** (its main thread holds the GIL,
or the process is stopped: its watchdog thread cannot publish), that **stalls** fetching a batch
while every other rank waits for it in a collective, or that **ended after fewer collectives** than a
rank still waiting for it (uneven batches). Each is judged from the states the ranks' watchdogs
publish in the store (:func:`judge`), named in one sentence (which rank, what it was doing, the
collective's sequence number ``#N``, the user's ``file:line``) and posted on the failure board, so
that every rank logs the same verdict, writes its stack to its file in the log directory
(:class:`StackFile`) and exits with status 1 instead of waiting for the process-group timeout.

A rank that cannot run Python (the GIL is held, or it died of a fatal signal) writes its own stack
through :mod:`faulthandler`, which needs no GIL: its C-level timer is re-armed by each watchdog sample
and fires ``heartbeat_timeout`` after the last one.

May import: the standard library, the logger and :mod:`lplugins._coord.stacks`; the board is passed in.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from lplugins._coord.stacks import Where, classify, is_library
from lplugins._log import log

__all__ = [
    "EXIT_STATUS", "PeerClock", "StackFile", "Verdict", "describe", "diagnose", "ended", "fatal_text", "judge",
    "publish", "stop_process", "uneven", "wait_for_readers",
]  # fmt: skip

#: The exit status of a rank the watchdog stops.
EXIT_STATUS = 1
#: Seconds a rank that is not itself waiting for others goes on after a verdict (its own error may end it).
GRACE_S = 3.0
#: A DataLoader's first batch (its workers start, its dataset opens) may take this many times the bound.
FIRST_BATCH_FACTOR = 12
_HEADER = 512  # bytes of the rewritten first line of a stack file


@dataclass(frozen=True)
class Verdict:
    """What went wrong: ``text`` names the faulty ``rank``; ``kind`` is ``failed``, ``ended``, ``unresponsive``,
    ``stalled``, ``uneven`` or ``mismatch``."""

    kind: str
    rank: int
    text: str


def describe(state: dict[str, Any]) -> str:
    """A published state in words: ``...all_reduce() (tensor shape [3]) at train.py:40 (collective #12)``."""
    where = Where(**{k: state.get(k, "") for k in ("kind", "op", "via", "site", "inside", "shape")})
    seq = state.get("seq")
    text = where.describe()
    if where.kind in ("run", "data"):
        return f"{text} (after collective #{seq})"
    return f"{text} (collective #{seq})"


def fatal_text(rank: int, err: BaseException, tb: TracebackType | None, seq: int | None) -> tuple[str, str]:
    """``(sentence, site)`` for an uncaught exception: its type and message, and the innermost user line."""
    site = ""
    for frame, line in traceback.walk_tb(tb):
        if not is_library(frame.f_code.co_filename):
            site = f"{frame.f_code.co_filename}:{line}"
    message = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return f"rank {rank} failed: {message} at {site or '?'} (after collective #{seq})", site


class StackFile:
    """This rank's file in the log directory, ``<dir>/rank<N>.txt``: a first line rewritten by each sample
    (what the rank was last seen doing), then every stack dump of this process.

    A clean end removes it (:meth:`close`); a file with a stack is what a fault leaves behind.
    """

    def __init__(self, directory: str, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank{rank}.txt")
        self.rank = rank
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.dumped = False
        self.header = ""
        os.write(self.fd, self._line("started"))
        self._previous_enabled = faulthandler.is_enabled()
        faulthandler.enable(file=self.fd, all_threads=True)  # a fatal signal (a C++ abort) writes the stacks here

    def _line(self, text: str) -> bytes:
        raw = f"lplugins [rank {self.rank}] pid {os.getpid()}: {text}".encode(errors="replace")[: _HEADER - 1]
        return raw.ljust(_HEADER - 1) + b"\n"

    def note(self, text: str, gil_timeout: float) -> None:
        """Rewrite the first line; re-arm the C-level timer (``gil_timeout`` s without a sample: dump, exit)."""
        header = (
            f"last seen {text}; a stack below was written when this process held the GIL for"
            f" {gil_timeout:g}s (no lplugins sample could run) or died of a fatal signal"
        )
        if header != self.header:
            self.header = header
            os.pwrite(self.fd, self._line(header), 0)
        faulthandler.dump_traceback_later(gil_timeout, repeat=False, file=self.fd, exit=True)

    def dump(self, reason: str) -> None:
        """Append ``reason`` and the Python stack of every thread of this process."""
        self.dumped = True
        os.write(self.fd, f"\n{reason}\n".encode(errors="replace"))
        faulthandler.dump_traceback(file=self.fd, all_threads=True)

    def close(self, keep: bool = False) -> None:
        """Stop the timer and the fatal-signal handler; remove the file unless it holds a stack (or ``keep``)."""
        faulthandler.cancel_dump_traceback_later()
        if self._previous_enabled:
            faulthandler.enable(file=sys.stderr, all_threads=True)
        else:
            faulthandler.disable()
        try:
            os.close(self.fd)
            if not (self.dumped or keep):
                os.unlink(self.path)
                os.rmdir(os.path.dirname(self.path))  # only when empty
        except OSError:
            pass


class PeerClock:
    """When each rank's published state last changed, on this process's monotonic clock (host clocks differ)."""

    def __init__(self) -> None:
        self.changed: dict[int, tuple[float, float]] = {}  # rank -> (its published t, our monotonic time)

    def silent_for(self, rank: int, state: dict[str, Any], mono: float) -> float:
        known = self.changed.get(rank)
        if known is None or known[0] != state["t"]:
            self.changed[rank] = (state["t"], mono)
            return 0.0
        return mono - known[1]


def judge(
    board: Any,
    mine: dict[str, Any],
    states: dict[int, dict[str, Any]],
    clock: PeerClock,
    mono: float,
    collective_bound: float,
    interval: float,
    stacks: str | None = None,
) -> Verdict | None:
    """A fault of another rank (ended, unresponsive) or of this one (stalled fetching data), if any."""
    me = board.rank
    for r in range(board.world):
        if r == me:
            continue
        state = states.get(r)
        if board._ended(r) and not board.store.check([f"done/{r}"]):
            return ended(r, state, clock, mono, None, mine, stacks)
        if state is None:
            continue
        silent = clock.silent_for(r, state, mono)
        limit = float(state.get("hb", 5.0)) + 2 * interval + 1.0
        if silent > limit and not board.store.check([f"done/{r}"]):
            # its GIL timer's dump (written by then on one host) says where it holds the GIL; the last
            # sample may predate the call that holds it
            said, _ = _stack_file_says(r, stacks)
            return Verdict(
                "unresponsive",
                r,
                f"rank {r} does not respond: its lplugins watchdog has not run for {silent:.0f}s -- its main thread"
                f" holds the GIL (a long call into C that does not release it) or the process is stopped;"
                f" it was last seen {describe(state)}{said or f'; its stack is in its file rank{r}.txt'}. This rank"
                f" waits {describe(mine)}.",
            )
    data_bound = collective_bound * (FIRST_BATCH_FACTOR if "first batch" in mine["op"] else 1)
    if mine["kind"] == "data" and time.time() - mine["since"] >= data_bound:
        others = [states.get(r) for r in range(board.world) if r != me]
        if others and all(s is not None and s["kind"] in ("collective", "backward") for s in others):
            waits = "; ".join(f"rank {r} waits in {describe(s)}" for r, s in sorted(states.items()) if r != me)
            return Verdict(
                "stalled",
                me,
                f"rank {me} is stalled fetching its next batch for {time.time() - mine['since']:.0f}s:"
                f" {describe(mine)} -- the other ranks wait for it ({waits}). A DataLoader that never returns"
                " (a worker stuck on I/O or a lock, a dataset that blocks) hangs every rank.",
            )
    return None


def ended(
    rank: int,
    state: dict[str, Any] | None,
    clock: PeerClock,
    mono: float,
    where: Where | None,
    mine: dict[str, Any] | int | None,
    stacks: str | None = None,
) -> Verdict:
    """``rank``'s process ended without a word; ``where``: this rank's failed collective, ``mine``: its state or seq.

    ``stacks``: the directory of the stack files; on one host (or a shared file system) the ended rank's
    own dump there (written by :mod:`faulthandler` when it held the GIL or died of a fatal signal) says
    where it was.
    """
    last, headline = "", ""
    said, held = _stack_file_says(rank, stacks)
    if state is not None:
        silent = clock.silent_for(rank, state, mono)
        last = f"; it was last seen {describe(state)}"
        # its own GIL timer's dump says so; without one (another host), its silence before it ended does
        if held is not None or silent > 0.8 * float(state.get("hb", 5.0)):
            headline = (
                f"rank {rank} does not respond: its main thread held the GIL for {held or f'{silent:.0f}s'} (its"
                " lplugins watchdog could not run), so its own timer wrote its stack and ended it"
            )
    elif held is not None:
        headline = (
            f"rank {rank} does not respond: its main thread held the GIL for {held} (its lplugins watchdog could"
            " not run), so its own timer wrote its stack and ended it"
        )
    last += said
    if where is not None and where.kind != "run":
        seq = mine if isinstance(mine, int) else None
        this = describe({**where.__dict__, "seq": seq})
    elif isinstance(mine, dict):
        this = describe(mine)
    else:
        this = f"after collective #{mine}"
    headline = headline or (
        f"rank {rank}'s process ended without an error report (killed: SIGKILL, the OOM killer, a C++ abort such"
        " as gloo's on a collective of another size)"
    )
    return Verdict("ended", rank, f"{headline}{last}. This rank's collective failed: {this}.")


def _stack_file_says(rank: int, stacks: str | None) -> tuple[str, str | None]:
    """``("; its stack (rank1.txt) shows it in f at train.py:12", held)`` from a faulthandler dump, or ``("", None)``.

    ``held``: how long the GIL was held (``"5s"``) when the dump is the one of that rank's GIL timer
    (faulthandler's ``Timeout (0:00:05)!``), the proof that it ended for holding the GIL -- which its
    silence, as another rank saw it, only suggests (a loaded rank sees the last heartbeat late).
    """
    if not stacks:
        return "", None
    path = os.path.join(stacks, f"rank{rank}.txt")
    try:
        with open(path, errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return "", None
    timer = re.search(r"^Timeout \((\d+):(\d\d):(\d\d)(?:\.\d+)?\)!$", text, re.M)
    held = f"{int(timer[1]) * 3600 + int(timer[2]) * 60 + int(timer[3])}s" if timer else None
    head = "Current thread" if "Current thread" in text else "Thread"
    block = text[text.rfind(head) :] if head in text else ""
    for line in block.splitlines():  # most recent call first
        match = re.match(r'\s*File "(.+)", line (\d+) in (.+)', line)
        if match and not is_library(match.group(1)):
            return f"; its stack ({path}) shows it in {match.group(3)} at {match.group(1)}:{match.group(2)}", held
    return "", held


def uneven(board: Any, seq: int, wait: float, interval: float) -> Verdict | None:
    """At this rank's clean end: a rank still waiting in a later collective than this rank's last (uneven data)?

    Posts ``done/<rank>`` (the other ranks then know this end is not a crash), then waits at most
    ``wait`` seconds until every other rank has ended too or is seen running on.
    """
    me = board.rank
    start = time.time()
    board.store.set(f"done/{me}", json.dumps({"seq": seq, "t": start}))
    deadline = time.monotonic() + wait
    while True:
        pending = False
        for r in range(board.world):
            if r == me or board.store.check([f"done/{r}"]) or board._ended(r):
                continue
            if not board.store.check([f"state/{r}"]):
                continue
            state = json.loads(board.store.get(f"state/{r}"))
            if state["kind"] in ("collective", "backward") and int(state.get("seq") or 0) > seq:
                return Verdict(
                    "uneven",
                    r,
                    f"rank {me} ended after collective #{seq} while rank {r} waits in {describe(state)}, a collective"
                    f" rank {me} never makes: the ranks ran different numbers of steps (uneven batches per rank:"
                    " use a DistributedSampler, or drop_last / the same number of batches on every rank).",
                )
            if state["t"] < start + 2 * interval:
                pending = True  # not seen since this rank ended: wait for a fresher sample
        if not pending or time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def diagnose(
    board: Any, states: dict[int, dict[str, Any]], clock: PeerClock, err: BaseException, seq: int | None, stacks: str
) -> tuple[Verdict, bool] | None:
    """``(verdict, post it?)`` for a collective of this rank that failed with ``err``: what another rank posted
    (a stall, an exception), or the rank whose process has ended (looked for during 3 s: a process whose
    sockets closed may take a moment to be gone).

    The collective usually fails before the next sample could see the rank gone; without this the
    error would read "Connection reset by peer" and name nobody. An error raised outside a collective
    (this rank's own exception) is not waited for.
    """
    posted = [r for r in board.failures.values() if r.get("kind") in ("fatal", "verdict") and r["rank"] != board.rank]
    if posted:
        return Verdict(posted[0]["where"], posted[0]["rank"], posted[0]["error"]), False
    frame = None
    for frame, _line in traceback.walk_tb(err.__traceback__):  # noqa: B007 -- the innermost frame is wanted
        pass
    where = classify(frame, None, cpu_idle=True) if frame is not None else None
    # a loaded machine may take a while to finish a killed process; an error not raised in a collective (this
    # rank's own, at its top level) is looked at once: waiting would only delay telling the others
    waits = where is not None and where.blocked
    deadline = time.monotonic() + (3.0 if waits else 0.0)
    while True:
        for r in range(board.world):
            try:
                if r == board.rank or not board._ended(r) or (not board.dead and board.store.check([f"done/{r}"])):
                    continue
            except Exception:  # the store is gone, the place of that rank never read
                continue
            return ended(r, states.get(r), clock, time.monotonic(), where, seq, stacks), not board.dead
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def wait_for_readers(board: Any, index: int, interval: float) -> None:
    """Give every other live rank the time to read failure ``index`` (rank 0's process hosts the store)."""
    deadline = time.monotonic() + 2 * interval + 1.5
    while time.monotonic() < deadline:
        try:
            alive = sum(not board._ended(r) for r in range(board.world) if r != board.rank)
            if int(board.store.add(f"ack/{index}", 0)) >= alive:
                return
        except Exception:  # the store is gone: nobody can read it any more
            return
        time.sleep(0.05)


def publish(
    board: Any, stack_file: StackFile | None, verdict: Verdict, kind: str, interval: float, detail: str = ""
) -> None:
    """Log ``verdict`` on this rank, write this rank's stack, post it (``kind``: ``fatal``/``verdict``) and
    wait until the other live ranks have read it."""
    log.error("lplugins [rank %d]: %s", board.rank, verdict.text)
    if stack_file is not None:
        stack_file.dump(f"lplugins [rank {board.rank}]: {verdict.text}\n{detail}")
    try:
        index = board.post_failure(verdict.text, verdict.kind, -1, kind=kind, rank=verdict.rank)
        wait_for_readers(board, index, interval)
    except Exception:  # the store is gone: every rank judges for itself
        pass


def stop_process(rank: int, message: str) -> None:
    """Write ``message`` to stderr, flush every log handler and end this process with :data:`EXIT_STATUS`."""
    try:
        sys.stderr.write(f"lplugins [rank {rank}]: {message}\n")
        for handler in [*log.handlers, *logging.getLogger().handlers]:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(EXIT_STATUS)
