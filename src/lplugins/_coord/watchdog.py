"""The collective watchdog: a rank that fails, dies, hangs or waits in a collective the others do not call is named.

One daemon thread per process, started by :func:`arm` when a multi-process run begins (the
``CollectiveWatch`` callback that ``Trainer()`` gets through lplugins' ``callbacks_factory`` entry point,
``compose`` or ``attach``: never while a Trainer is only built) and stopped and joined by :func:`pause`
when the run ends, waits for a multi-process default group to exist and then, every ``interval``
(0.5 s for the default 5 s bound):

* samples the main thread's Python stack (``sys._current_frames()``; nothing is wrapped, so a
  training step costs nothing extra) and classifies it (:func:`lplugins._coord.stacks.classify`):
  running, fetching a batch, waiting in a collective (which one, its sequence number, from which
  line of user code), or stalled in a backward pass (DDP's all-reduce runs in C++; a main thread
  whose CPU time does not move there is waiting);
* publishes that state to the process group's store (its heartbeat; out of band: nothing it does
  can pair with a collective), re-arms this rank's C-level GIL timer, reads the failure board
  (:class:`Board`) and judges the other ranks' states (:mod:`lplugins._coord.faults`).

A **mismatch** is every rank waiting for at least the bound in collectives that are not the same
call (operation, line, tensor shape, sequence number). Then every rank logs the same report and
the highest rank exits, so that the others' pending collectives fail at once ("Connection closed by
peer") instead of at the process-group timeout; the report is printed again under their traceback.
The other faults (a rank failed, ended, holds the GIL, stalls fetching data, ended with fewer
collectives than another) are verdicts of :mod:`lplugins._coord.faults`. The bounds adapt to the
step time (:mod:`lplugins._coord.settings`).

May import: the logger, the board, ``_excepthook``, ``faults``, ``mismatch``, ``procs``, ``settings``,
``stacks``; torch and ``_lightning.runtime`` (its one torch private) inside functions.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from lplugins._coord import _excepthook, faults, mismatch, procs
from lplugins._coord import board as _board_module
from lplugins._coord.board import DEFAULT_TIMEOUT, Board, add_note, current_board
from lplugins._coord.settings import COLLECTIVE_VAR, DEFAULT_COLLECTIVE_S, DEFAULT_HEARTBEAT_S, STACKS_VAR, Adaptive
from lplugins._coord.stacks import Where, classify, in_batch_loop, thread_cpu_seconds
from lplugins._log import announce, log

__all__ = [
    "DEFAULT_TIMEOUT", "EXIT_STATUS", "TIMEOUT_VAR", "arm", "bound", "disarm", "finish", "note_peer_failures",
    "pause", "stacks_dir",
]  # fmt: skip

#: The environment variable for the collective bound's floor (seconds, ``auto`` or ``off``; see ``settings``).
TIMEOUT_VAR = COLLECTIVE_VAR
#: The exit status of a rank the watchdog stops.
EXIT_STATUS = faults.EXIT_STATUS
#: Seconds a rank that ends cleanly waits (at most) to see whether another rank still waits for it.
GOODBYE_WAIT_S = 3.0

_bound: float = DEFAULT_COLLECTIVE_S
_log_dir: str | None = None
_lock = threading.Lock()
_thread: _Watchdog | None = None
#: The thread :func:`pause` stopped: its board and stack file serve :func:`finish` and the exception hook later.
_parked: _Watchdog | None = None
_announced = False


def bound() -> float:
    """The current bound in seconds (0: the watchdog is off)."""
    return _bound


def note_peer_failures(err: BaseException) -> BaseException:
    """Add to ``err`` (a collective that failed) what the watchdog knows: other ranks' errors, a mismatch report."""
    notes = []
    board = _board_module._board
    if board is not None and not board.dead:
        try:
            board.read_failures()  # a peer's failure posted since the last sample
        except Exception:  # the store is gone: what is known is enough
            pass
    if board is not None and _thread is not None and _thread.verdict is None and _thread.report is None:
        _diagnose(_thread, board, err)
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


_fork_guard = procs.fork_guard  # the watchdog samples under its lock: a fork never copies a tick half-done


class _Watchdog(threading.Thread):
    def __init__(self, interval: float, heartbeat: float) -> None:
        super().__init__(name="lplugins-collective-watchdog", daemon=True)
        self.interval = interval
        self.stopped = threading.Event()
        self.board: Board | None = None
        self.state: _State | None = None
        self.report: str | None = None
        self.cpu: tuple[float, float] | None = None  # (wall, main-thread CPU seconds) at the last sample
        self.collective = Adaptive(_bound)  # the collective bound: max(floor, 3 x the longest step seen)
        self.learning = False  # whether the steps are measured: from the first sample inside a batch loop on
        self.heartbeat = Adaptive(heartbeat)  # the GIL bound: max(floor, 3 x the longest sample delay seen)
        self.seq: int | None = None
        self.seq_at = 0.0
        self.last_tick: float | None = None
        self.clock = faults.PeerClock()
        self.states: dict[int, dict[str, Any]] = {}
        self.stack_file: faults.StackFile | None = None
        self.verdict: faults.Verdict | None = None
        self.exit_at: float | None = None

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            armed = False
            try:
                with _fork_guard.lock:  # a fork (a DataLoader worker) never copies this thread mid-tick
                    armed = self.tick()
            except Exception as err:  # a watchdog never takes the process down
                if self.board is not None and not self.board.dead:
                    self.board.dead = True  # most likely rank 0's process (the store) is gone
                    log.debug("lplugins: collective watchdog stopped watching: %r", err)
                    self._store_lost(self.board)
            if (not armed or self.stopped.is_set()) and self.stack_file is not None:
                faulthandler.cancel_dump_traceback_later()  # no more samples: no GIL timer either
            if self.exit_at is not None and time.monotonic() >= self.exit_at and not self.stopped.is_set():
                self._stop_this_rank_for_verdict()

    def tick(self) -> bool:
        board = self.board
        if board is None or board.dead:
            if board is not None and board.is_for(_default_group()):
                return False  # the store is gone: nothing more to learn
            board = self.board = current_board()
            if board is None:
                return False
            self.state = None
            self.learning = False  # a new process group: its set-up is not a step
            self._open_stack_file(board)
            _install_excepthook()  # an uncaught exception is posted for the other ranks
            global _announced
            if not _announced:
                _announced = True
                announce(
                    "lplugins: collective watchdog on: a rank that fails, dies, holds the GIL, stalls, or waits in a"
                    " collective the other ranks do not call is named on every rank (which rank, collective, line)"
                    " and the job is stopped; thresholds %gs/%gs (they adapt to the step time); %s=off turns it off.",
                    _bound, self.heartbeat.floor, TIMEOUT_VAR,
                )  # fmt: skip
        if not board.is_for(_default_group()):
            self.board = None
            return False
        now, mono = time.time(), time.monotonic()
        if self.last_tick is not None:  # how late this sample is: how long the main thread kept the GIL
            self.heartbeat.observe(max(0.0, mono - self.last_tick - self.interval))
        self.last_tick = mono
        where, anchor = self.sample(board)
        seq = _seq()
        if not self.learning and in_batch_loop(sys._current_frames().get(threading.main_thread().ident or -1)):
            self.learning, self.seq, self.seq_at = True, seq, mono  # set-up is over: steps are measured from here
        if seq != self.seq:  # a collective completed (or started) since the last sample: a step's length
            if self.seq is not None and self.learning:  # a gap in set-up (an engine built, a restore) is no step
                self.collective.observe(mono - self.seq_at)
            self.seq, self.seq_at = seq, mono
        if self.state is None or self.state.where != where or self.state.anchor is not anchor:
            self.state = _State(where, now, 0.0, anchor)  # a new call: waiting in every step is not stuck
        state = self.state
        mine = {**asdict(where), "seq": seq, "since": state.since, "t": now, "hb": self.heartbeat.value}
        board.store.set(f"state/{board.rank}", json.dumps(mine))  # every sample: the heartbeat
        state.t = now
        if self.stack_file is not None:
            self.stack_file.note(faults.describe(mine), self.heartbeat.value)
        for record in board.read_failures():
            if record.get("kind") in ("fatal", "verdict"):
                board.store.add(f"ack/{record['index']}", 1)
                if self.verdict is None:
                    self._declare(board, faults.Verdict(record["where"], record["rank"], record["error"]), post=False)
            elif where.blocked:
                self._log_failure(board, record, where)
        if where.blocked and board.failures and now - state.since >= self.interval:
            board.answer_for_main(where)
        bound = self.collective.value
        if where.blocked and now - state.since >= bound and self.report is None and self.verdict is None:
            self.check_mismatch(board, now, bound)
        if self.verdict is None and self.report is None:
            self.states = self._read_states(board)
            verdict = faults.judge(board, mine, self.states, self.clock, mono, bound, self.interval, stacks_dir())
            if verdict is not None:
                self._declare(board, verdict, post=True)
        return True

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
        return where, (frame if where.kind != "run" else None)

    def _open_stack_file(self, board: Board) -> None:
        if self.stack_file is not None:
            self.stack_file.close()
            self.stack_file = None
        try:
            self.stack_file = faults.StackFile(stacks_dir(), board.rank)
        except OSError as err:
            log.warning("lplugins: no stack file for rank %d in %s: %s", board.rank, stacks_dir(), err)

    def _read_states(self, board: Board) -> dict[int, dict[str, Any]]:
        keys = [f"state/{r}" for r in range(board.world)]
        store = board.store
        if store.check(keys):
            return {r: json.loads(v) for r, v in enumerate(store.multi_get(keys))}
        return {r: json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}

    def _store_lost(self, board: Board) -> None:
        """The store went away: rank 0's process (its host) ended. A rank waiting for it names it."""
        if board.rank == 0 or self.verdict is not None or self.state is None or not self.state.where.blocked:
            return  # a clean end of rank 0 while this rank runs on: its next collective tells
        try:
            ended = board._ended(0)
        except Exception:  # its place was never read: nothing to judge by
            return
        if ended:
            last = self.states.get(0)
            seen = f"; it was last seen {faults.describe(last)}" if last else ""
            text = (
                f"rank 0's process ended (it hosted the process group's store){seen}. This rank waits"
                f" {self.state.where.describe()} (collective #{self.seq})."
            )
            self._declare(board, faults.Verdict("ended", 0, text), post=False)

    def _declare(self, board: Board, verdict: faults.Verdict, post: bool) -> None:
        """Log ``verdict``, post it for the other ranks, write this rank's stack, and plan this rank's end."""
        self.verdict = verdict
        if post:
            try:
                board.post_failure(verdict.text, verdict.kind, -1, kind="verdict", rank=verdict.rank)
            except Exception:  # the store is gone: every rank judges for itself
                pass
        log.error("lplugins [rank %d]: %s", board.rank, verdict.text)
        self.report = self.report or f"lplugins: {verdict.text}"
        _install_excepthook()
        if self.stack_file is not None:
            self.stack_file.dump(f"lplugins [rank {board.rank}]: {verdict.text}")
        waiting = self.state is not None and self.state.where.kind != "run"
        if verdict.rank == board.rank:  # the cause: the others wait for this process to go
            delay = 2 * self.interval + 0.5 if board.rank == 0 else 0.0  # rank 0 hosts the store: let them read
        else:  # this rank's own collective usually fails first (an error with the verdict as its note)
            delay = 1.0 if waiting else faults.GRACE_S
        self.exit_at = time.monotonic() + delay

    def _stop_this_rank_for_verdict(self) -> None:
        board = self.board
        text = self.verdict.text if self.verdict is not None else (self.report or "")
        faults.stop_process(
            board.rank if board is not None else -1, f"stopping this rank (exit status 1): {text[:200]}..."
        )

    def _log_failure(self, board: Board, record: dict[str, Any], where: Where) -> None:
        log.error(
            "lplugins [rank %d]: rank %d failed in %s: %s -- this rank waits in %s; it stops when rank %d does.",
            board.rank, record["rank"], record["where"], record["error"], where.describe(), record["rank"],
        )  # fmt: skip

    def check_mismatch(self, board: Board, now: float, bound: float) -> None:
        report = mismatch.report(board, now, bound, self.interval)
        if report is None:
            return
        self.report = report
        log.error("[rank %d] %s", board.rank, report)
        _install_excepthook()
        if self.stack_file is not None:
            self.stack_file.dump(f"lplugins [rank {board.rank}]: {report}")
        board.store.set(f"mismatch/{board.rank}", "1")
        if board.rank == board.world - 1:
            mismatch.stop_this_rank(board, report, self.interval)
        else:  # its collective fails once the highest rank has gone; if it does not, it goes too
            self.exit_at = time.monotonic() + max(5.0, 5 * self.interval) + 3.0


def _seq() -> int | None:
    """The default group's collective sequence number: how many collectives this rank has started."""
    try:
        from lplugins._lightning.runtime import collective_sequence

        return collective_sequence()
    except Exception:  # another backend or torch: the messages say "#None"
        return None


def stacks_dir() -> str:
    """Where each rank's stack file goes: ``LPLUGINS_STACKS_DIR``, else ``<log dir>/lplugins-stacks``."""
    return os.environ.get(STACKS_VAR) or os.path.join(_log_dir or os.getcwd(), "lplugins-stacks")


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _install_excepthook() -> None:
    """Attach what the watchdog knows to the error it causes, at the failing collective and at top level."""
    _excepthook.install(note_peer_failures, _post_fatal)


def _diagnose(thread: _Watchdog, board: Board, err: BaseException) -> None:
    """A collective of this rank failed (``err``): name the rank that caused it, if known (``faults.diagnose``)."""
    verdict = faults.diagnose(board, thread.states, thread.clock, err, _seq(), stacks_dir())
    if verdict is not None:
        thread._declare(board, verdict[0], post=verdict[1])


def _post_fatal(err: BaseException, tb: Any) -> None:
    """This process ends with an uncaught exception: tell the other ranks (which, what, where), write its stack."""
    thread, board = _thread or _parked, _board_module._board
    if thread is None or board is None or board.dead or thread.verdict is not None or thread.report is not None:
        return  # a verdict (or a mismatch) already is the story
    if any(r.get("kind") == "verdict" for r in board.failures.values()):
        return  # this rank was stopped by a verdict: that is the story
    text, _ = faults.fatal_text(board.rank, err, tb, _seq())
    thread.verdict = faults.Verdict("failed", board.rank, text)
    detail = "".join(traceback.format_exception(err))
    faults.publish(board, thread.stack_file, thread.verdict, "fatal", thread.interval, detail)


def arm(
    timeout: float,
    interval: float | None = None,
    *,
    heartbeat: float = DEFAULT_HEARTBEAT_S,
    log_dir: str | None = None,
) -> None:
    """Watch for hangs and failures across ranks in this process from now on (idempotent); ``timeout=0`` stops.

    Args:
        timeout: The floor of ``collective_timeout`` in seconds (:mod:`lplugins._coord.settings`); 0: off.
        interval: Seconds between samples (default: 1, or a tenth of a bound under 10 s).
        heartbeat: The floor of ``heartbeat_timeout`` (a main thread holding the GIL this long ends its rank).
        log_dir: Where the stack files go (``<log_dir>/lplugins-stacks``; ``LPLUGINS_STACKS_DIR`` wins).
    """
    global _bound, _thread, _log_dir, _parked
    with _lock:
        _bound = timeout
        if _parked is not None:  # a new run: the last one's end is over
            _close_stack_file(_parked)
            _parked = None
        if log_dir is not None:
            _log_dir = log_dir
        if timeout <= 0:
            if _thread is not None:
                _thread.stopped.set()
                if _thread is not threading.current_thread():
                    _thread.join(timeout=2)  # its last sample may re-arm the GIL timer: close after it
                _close_stack_file(_thread)
                _thread = None
            _board_module.configure(timeout, watched=False)
            return
        _board_module.configure(timeout, watched=True)
        if _thread is not None and _thread.is_alive():
            _thread.collective.floor = timeout
            _thread.heartbeat.floor = heartbeat
            return
        _thread = _Watchdog(interval or min(1.0, timeout / 10), heartbeat)
        _thread.start()
        try:  # the board and the exception hook now, not at the first sample: a failure in the first steps
            if current_board() is not None:  # is posted for the other ranks all the same
                _install_excepthook()
        except Exception:  # torch.distributed unavailable: the thread finds out for itself
            pass
    atexit.register(_at_exit)


def _close_stack_file(thread: _Watchdog) -> None:
    if thread.stack_file is not None:
        thread.stack_file.close(keep=thread.verdict is not None or thread.report is not None)
        thread.stack_file = None


def _at_exit() -> None:
    """:func:`finish` at this process's end; a process that ends for a fault already named skips the last
    garbage collection of the interpreter's finalization (``gc.freeze``), which walks every object torch and
    Lightning made and took seconds on a loaded machine (6 s seen), when every rank should end at once."""
    thread = _thread or _parked
    faulted = thread is not None and (thread.verdict is not None or thread.report is not None)
    finish()
    if faulted:
        gc.freeze()


def finish() -> None:
    """This rank's work is over (at its process's end, or where a process ends without ``atexit``, such as a Ray
    worker, after its training function returned): say so on the board, fail if another rank still waits for a
    collective of ours, and stop watching (a clean end removes this rank's stack file)."""
    thread = _thread or _parked
    if (
        thread is not None
        and thread.board is not None
        and not thread.board.dead
        and thread.verdict is None
        and thread.report is None
    ):
        thread.stopped.set()
        with _fork_guard.lock:  # the last sample is over
            pass
        faulthandler.cancel_dump_traceback_later()
        board = thread.board
        try:
            board.read_failures()  # a failure on the board (e.g. a failed save): not a clean end, not uneven data
            wait = max(GOODBYE_WAIT_S, 6 * thread.interval)
            verdict = None if board.failures else faults.uneven(board, _seq() or 0, wait, thread.interval)
        except Exception:  # the store is gone: the others' collectives tell them
            verdict = None
        if verdict is not None:
            thread.verdict = verdict
            faults.publish(board, thread.stack_file, verdict, "verdict", thread.interval)
            faults.stop_process(board.rank, f"stopping this rank (exit status 1): {verdict.text[:200]}...")
    disarm()


def disarm() -> None:
    """Stop the watchdog thread (at exit, before the process group goes)."""
    global _thread, _parked
    with _lock:
        thread, _thread = _thread, None
        parked, _parked = _parked, None
        _board_module.configure(_bound, watched=False)
    if thread is not None:
        thread.stopped.set()
        if thread is not threading.current_thread():
            thread.join(timeout=2)
        _close_stack_file(thread)
    if parked is not None and parked is not thread:
        _close_stack_file(parked)


def pause() -> None:
    """A run is over (its teardown, or an exception on its way out): stop and join the thread now.

    What :func:`finish` (at this process's end: is another rank still waiting for us?) and the exception hook
    (tell the other ranks why this one ends) need is kept: the board and the stack file, not the thread. A
    thread that has judged a fault keeps running: it is what stops this rank, and the process is ending.
    """
    global _thread, _parked
    with _lock:
        thread = _thread
        if thread is None or thread.exit_at is not None or thread.report is not None:
            return
        _thread, _parked = None, thread
        _board_module.configure(_bound, watched=False)
    thread.stopped.set()
    if thread is not threading.current_thread():
        thread.join(timeout=2)
    faulthandler.cancel_dump_traceback_later()
