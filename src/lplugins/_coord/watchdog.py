"""The collective watchdog: a rank stuck in a collective the others do not call is an error, not a silent hang.

One daemon thread per process (started by :func:`arm`, which every ``Trainer()`` reaches through
lplugins' ``callbacks_factory`` entry point) waits for a multi-process default group to exist and
then, once a second:

* samples the main thread's Python stack (``sys._current_frames()``; nothing is wrapped, so a
  training step costs nothing extra) and classifies it: running, waiting in a collective (which
  one, called through what, from which line of user code), or stalled in a backward pass (DDP's
  gradient all-reduce runs in C++: no Python frame names it; a main thread whose CPU time does not
  move there is waiting);
* publishes that state to the process group's store (an out-of-band channel: nothing it does can
  pair with a collective) and reads the failure board there (:class:`Board`).

A **mismatch** is every rank waiting for at least the bound (``LPLUGINS_COLLECTIVE_TIMEOUT``,
default 30 s) in collectives that are not the same call at the same place. Then every rank logs
the same report (each rank: which collective, which line), and the highest rank exits, so that the
others' pending collectives fail at once ("Connection closed by peer") instead of at the process-
group timeout; the report is printed again under their traceback. Ranks that all wait in the same
collective at the same line (slow, not wrong) and a rank that computes while the others wait are
not a mismatch.

The **failure board** (:mod:`lplugins._coord.board`) carries a rank's real error to the others; a
rank whose main thread is stuck in a strategy's own collective (DeepSpeed's final barrier) is
answered for by its watchdog, so the failing rank raises its real error within seconds, and the
stuck rank's error, when its collective fails, carries the real one (:func:`note_peer_failures`).

May import: the logger, the board, :mod:`lplugins._coord.stacks`; torch inside functions (importing
this module stays light).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from lplugins._coord import board as _board_module
from lplugins._coord.board import DEFAULT_TIMEOUT, Board, add_note, current_board
from lplugins._coord.stacks import Where, classify, thread_cpu_seconds
from lplugins._log import announce, log

__all__ = ["DEFAULT_TIMEOUT", "EXIT_STATUS", "TIMEOUT_VAR", "arm", "bound", "disarm", "note_peer_failures"]

#: The environment variable for the bound (seconds; ``0`` turns the watchdog off), read by ``lplugins._env``.
TIMEOUT_VAR = "LPLUGINS_COLLECTIVE_TIMEOUT"
#: The exit status of the rank the watchdog stops after a mismatch.
EXIT_STATUS = 1
#: A rank's watchdog republishes its state at least every this many samples (its heartbeat).
HEARTBEAT_INTERVALS = 5

_bound: float = DEFAULT_TIMEOUT
_lock = threading.Lock()
_thread: _Watchdog | None = None
_announced = False


def bound() -> float:
    """The current bound in seconds (0: the watchdog is off)."""
    return _bound


def note_peer_failures(err: BaseException) -> BaseException:
    """Add to ``err`` (a collective that failed) what the watchdog knows: other ranks' errors, a mismatch report."""
    notes = []
    board = _board_module._board
    if board is not None and board.failures:
        text = board.failure_text(exclude=board.rank)
        if text:
            notes.append(f"lplugins: {text}")
    if _thread is not None and _thread.report:
        notes.append(_thread.report)
    for note in notes:
        if note not in getattr(err, "__notes__", ()):
            add_note(err, note)
    return err


@dataclass
class _State:
    where: Where
    since: float  # wall clock
    t: float  # wall clock of the last publication
    anchor: FrameType | None = None  # the innermost frame: another object when the call was left and made again


class _ForkGuard:
    """Holds forks back while the watchdog thread samples or talks to the store.

    A child forked while this thread holds a lock (the store client's, logging's, the import lock)
    inherits it held, and can hang the first time it needs it: a DataLoader worker started mid-tick.
    ``os.register_at_fork`` takes the lock around every fork (waiting at most a few seconds).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = False

    def before(self) -> None:
        self.held = self.lock.acquire(timeout=5)

    def after_in_parent(self) -> None:
        if self.held:
            self.held = False
            self.lock.release()

    def after_in_child(self) -> None:
        self.lock = threading.Lock()  # the watchdog thread does not exist in the child
        self.held = False


_fork_guard = _ForkGuard()
os.register_at_fork(
    before=_fork_guard.before,
    after_in_parent=_fork_guard.after_in_parent,
    after_in_child=_fork_guard.after_in_child,
)


class _Watchdog(threading.Thread):
    def __init__(self, interval: float) -> None:
        super().__init__(name="lplugins-collective-watchdog", daemon=True)
        self.interval = interval
        self.stopped = threading.Event()
        self.board: Board | None = None
        self.state: _State | None = None
        self.report: str | None = None
        self.cpu: tuple[float, float] | None = None  # (wall, main-thread CPU seconds) at the last sample

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                with _fork_guard.lock:  # a fork (a DataLoader worker) never copies this thread mid-tick
                    self.tick()
            except Exception as err:  # a watchdog never takes the process down
                if self.board is not None and not self.board.dead:
                    self.board.dead = True  # most likely rank 0's process (the store) is gone
                    log.debug("lplugins: collective watchdog stopped watching: %r", err)

    def tick(self) -> None:
        board = self.board
        if board is None or board.dead:
            if board is not None and board.is_for(_default_group()):
                return  # the store is gone: nothing more to learn
            board = self.board = current_board()
            if board is None:
                return
            self.state = None
            global _announced
            if not _announced:
                _announced = True
                announce(
                    "lplugins: collective watchdog on: a rank waiting %gs in a collective the other ranks do not"
                    " call is reported (which collective, which line) and the job is stopped; %s=0 turns it off.",
                    _bound,
                    TIMEOUT_VAR,
                )
        if not board.is_for(_default_group()):
            self.board = None
            return
        now = time.time()
        where, anchor = self.sample(board)
        if self.state is None or self.state.where != where or self.state.anchor is not anchor:
            self.state = _State(where, now, 0.0, anchor)  # a new call: waiting in every step is not stuck
        state = self.state
        if not state.t or now - state.t >= HEARTBEAT_INTERVALS * self.interval:  # a new state, or a heartbeat
            board.store.set(f"state/{board.rank}", json.dumps({**asdict(where), "since": state.since, "t": now}))
            state.t = now
        for record in board.read_failures():
            _install_excepthook()
            if where.blocked:
                self._log_failure(board, record, where)
        if where.blocked and board.failures and now - state.since >= self.interval:
            board.answer_for_main(where)
        if where.blocked and now - state.since >= _bound and self.report is None:
            self.check_mismatch(board, now)

    def sample(self, board: Board) -> tuple[Where, FrameType | None]:
        main = threading.main_thread()
        frame = sys._current_frames().get(main.ident or -1)
        cpu_idle = False
        wall, cpu = time.monotonic(), thread_cpu_seconds(main.native_id)
        if cpu is not None:
            if self.cpu is not None:
                cpu_idle = cpu - self.cpu[1] < 0.1 * (wall - self.cpu[0])
            self.cpu = (wall, cpu)
        where = classify(frame, board.waiting, cpu_idle)
        return where, (frame if where.blocked else None)

    def _log_failure(self, board: Board, record: dict[str, Any], where: Where) -> None:
        log.error(
            "lplugins [rank %d]: rank %d failed in %s: %s -- this rank waits in %s; it stops when rank %d does.",
            board.rank, record["rank"], record["where"], record["error"], where.describe(), record["rank"],
        )  # fmt: skip

    def check_mismatch(self, board: Board, now: float) -> None:
        states: dict[int, dict[str, Any]] = {}
        for r in range(board.world):
            key = f"state/{r}"
            if not board.store.check([key]):
                return  # a rank that never published: its watchdog is off, nothing to compare
            states[r] = json.loads(board.store.get(key))
        fresh = 10 * self.interval + 5
        for s in states.values():
            if s["kind"] == "run" or now - s["t"] > fresh or now - s["since"] < _bound / 2:
                return  # some rank is working (or not watched): not a deadlock, maybe slow
        if len({(s["op"], s["site"]) for s in states.values()}) == 1:
            return  # all in the same call at the same line: slow, not mismatched
        lines = [
            f"  rank {r}: waits {now - s['since']:.0f}s in {_where(s).describe()}" for r, s in sorted(states.items())
        ]
        self.report = (
            "lplugins: collective mismatch -- the ranks wait in different collectives and none can complete:\n"
            + "\n".join(lines)
            + "\nEvery rank must make the same collective calls in the same order: a collective under"
            " `if trainer.is_global_zero:` (save_checkpoint, barrier, self.log(..., sync_dist=True)) deadlocks;"
            " call it on every rank, or use lplugins.callbacks.request_checkpoint / rank_zero_block."
            f" (Detected by the lplugins collective watchdog after {_bound:g}s; {TIMEOUT_VAR}=0 turns it off.)"
        )
        log.error("[rank %d] %s", board.rank, self.report)
        _install_excepthook()
        board.store.set(f"mismatch/{board.rank}", "1")
        if board.rank == board.world - 1:
            self._stop_this_rank(board)

    def _stop_this_rank(self, board: Board) -> None:
        """Exit this process so the other ranks' collectives fail now (gloo cannot be aborted from a thread)."""
        deadline = time.monotonic() + max(5.0, 5 * self.interval)
        while time.monotonic() < deadline:  # let the others log their report first
            if all(board.store.check([f"mismatch/{r}"]) for r in range(board.world)):
                break
            time.sleep(0.1)
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        sys.stderr.write(
            f"lplugins [rank {board.rank}]: stopping this rank (exit status {EXIT_STATUS}) so the others do"
            f" not wait for the process-group timeout. Its main thread was here:\n{stack}{self.report}\n"
        )
        for handler in [*log.handlers, *logging.getLogger().handlers]:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STATUS)


def _where(state: dict[str, Any]) -> Where:
    return Where(**{k: state.get(k, "") for k in ("kind", "op", "via", "site", "inside")})


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


_hook_installed = False


class _NoteFilter(logging.Filter):
    """On torch's c10d logger, which a failing collective logs to inside its ``except``: note what we know."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = sys.exc_info()[1]
        if error is not None:
            note_peer_failures(error)
        return True


def _install_excepthook() -> None:
    """Attach what the watchdog knows to the error it causes: at the failing collective, and at top level.

    Installed only once there is something to say (a mismatch, a peer's failure): no cost before.
    """
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    try:  # torch's collectives log their error through this logger, in their `except` block
        from torch.distributed import c10d_logger

        c10d_logger._c10d_logger.addFilter(_NoteFilter())
    except (ImportError, AttributeError):  # another torch: the excepthook below still prints it
        pass
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        note_peer_failures(value)
        previous(kind, value, tb)

    sys.excepthook = hook


def arm(timeout: float, interval: float | None = None) -> None:
    """Watch for collective mismatches in this process from now on (idempotent); ``timeout=0`` stops watching.

    Args:
        timeout: The bound in seconds: ranks all waiting this long in different collectives are a mismatch.
        interval: Seconds between samples (default: 1, or less for a bound under 10 s).
    """
    global _bound, _thread
    with _lock:
        _bound = timeout
        if timeout <= 0:
            if _thread is not None:
                _thread.stopped.set()
                _thread = None
            _board_module.configure(timeout, watched=False)
            return
        _board_module.configure(timeout, watched=True)
        if _thread is not None and _thread.is_alive():
            return
        _thread = _Watchdog(interval or min(1.0, timeout / 10))
        _thread.start()
    atexit.register(disarm)


def disarm() -> None:
    """Stop the watchdog thread (at exit, before the process group goes)."""
    global _thread
    with _lock:
        thread, _thread = _thread, None
        _board_module.configure(_bound, watched=False)
    if thread is not None:
        thread.stopped.set()
        if thread is not threading.current_thread():
            thread.join(timeout=2)
