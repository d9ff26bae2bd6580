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

The **failure board** carries a rank's real error to the others: :func:`agree` (what
``lplugins.callbacks`` uses to agree on a failed save or load) posts each rank's answer in the
store; a rank whose main thread is stuck in a strategy's own collective (DeepSpeed's final barrier)
is answered for by its watchdog, so the failing rank raises its real error within seconds, and the
stuck rank's error, when its collective fails, carries the real one.

Torch is imported inside functions: importing this module stays light.
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
import weakref
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

from lplugins._log import announce, log

__all__ = [
    "Agreement", "Board", "TIMEOUT_VAR", "Where", "add_note", "agree", "arm", "bound", "disarm", "note_peer_failures",
    "set_attempt", "stop_signal",
]  # fmt: skip

#: The environment variable for the bound (seconds; ``0`` turns the watchdog off), read by ``lplugins._env``.
TIMEOUT_VAR = "LPLUGINS_COLLECTIVE_TIMEOUT"
#: The bound when the variable is not set.
DEFAULT_TIMEOUT = 30.0
#: The exit status of the rank the watchdog stops after a mismatch.
EXIT_STATUS = 1
#: A rank's watchdog republishes its state at least every this many samples (its heartbeat).
HEARTBEAT_INTERVALS = 5
#: Seconds without a heartbeat after which an agreement stops waiting for a rank (its process is gone).
SILENT_RANK_S = 90.0
#: Under torchelastic: seconds a rank that waits in an agreement when a stop signal arrives gives the ranks
#: that have not answered to show they got the signal too (a whole-group stop) before it ends itself.
STOP_GRACE_S = 2.0
#: ... and how old the heartbeat of a rank on another node must be to count it gone (two heartbeats missed).
STALE_HEARTBEAT_S = 2 * HEARTBEAT_INTERVALS + 2.0
#: Seconds rank 0 waits, after an agreement, for every rank to say it has read the answers.
RELEASE_WAIT_S = 10.0

#: The ``torch.distributed`` functions that are collectives (the outermost one on the stack is named).
COLLECTIVES = frozenset(
    {
        "barrier", "monitored_barrier", "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_object",
        "all_gather_into_tensor", "all_gather_coalesced", "broadcast", "broadcast_object_list", "reduce",
        "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
        "all_to_all", "all_to_all_single", "send", "recv", "send_object_list", "recv_object_list",
        "batch_isend_irecv", "wait",
    }
)  # fmt: skip
_LIBRARY_PACKAGES = (
    "torch", "lightning", "lightning_fabric", "lightning_utilities", "pytorch_lightning", "deepspeed",
    "torchmetrics", "lplugins",
)  # fmt: skip

_bound: float = DEFAULT_TIMEOUT
_lock = threading.Lock()
_thread: _Watchdog | None = None
_board: Board | None = None
#: The torchelastic attempt whose store keys the default group uses (set by lplugins' strategies).
_attempt: str | None = None
_announced = False
#: ``(signal, monotonic time)`` of the first stop signal this process received under torchelastic.
_stop: tuple[int, float] | None = None


def bound() -> float:
    """The current bound in seconds (0: the watchdog is off)."""
    return _bound


# ------------------------------------------------------------------------------------- the stack
@dataclass(frozen=True)
class Where:
    """What a rank's main thread is doing, as the watchdog sees it.

    Attributes:
        kind: ``"run"``, ``"collective"`` (a ``torch.distributed`` call or lplugins' agreement) or
            ``"backward"`` (no progress inside a backward pass: DDP's gradient all-reduce).
        op: The collective (``"torch.distributed.barrier()"``); empty when running.
        via: The library call user code made to get there (``"Trainer.save_checkpoint"``), if any.
        inside: The library function that called the collective (``"DeepSpeedEngine.save_checkpoint"``), if
            not user code itself.
        site: ``file:line`` of the user code it is waiting in (the innermost frame when none is).
    """

    kind: str
    op: str = ""
    via: str = ""
    site: str = ""
    inside: str = ""

    @property
    def blocked(self) -> bool:
        """Whether this state waits for other ranks."""
        return self.kind != "run"

    def describe(self) -> str:
        """``torch.distributed.barrier() in DDPStrategy.barrier (through Trainer.save_checkpoint) at train.py:42``."""
        inside = f" in {self.inside}" if self.inside and self.inside != self.via else ""
        via = f" (through {self.via})" if self.via else ""
        return f"{self.op}{inside}{via} at {self.site}" if self.site else f"{self.op}{inside}{via}"


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


def _site(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _qualname(frame: FrameType) -> str:
    return getattr(frame.f_code, "co_qualname", frame.f_code.co_name)


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
    else:
        return Where("run")
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
    if kind == "backward":
        via = ""  # whatever called fit: not what waits
    logged = _logged_metric(frames)
    if logged is not None:
        via, site = logged[0], logged[1] or site
    return Where(kind, op, via, site or _site(frames[0]), inside)


def _in_backward(frames: list[FrameType]) -> bool:
    f = frames[0]
    return f.f_code.co_name in ("_engine_run_backward", "backward") and f"{os.sep}autograd{os.sep}" in (
        f.f_code.co_filename
    )


def _logged_metric(frames: list[FrameType]) -> tuple[str, str] | None:
    """``self.log(name, ..., sync_dist=True)`` synced after the hook returned: the call and, if found, its line."""
    for f in frames:
        meta = getattr(f.f_locals.get("self"), "meta", None)
        name, fx = getattr(meta, "name", None), getattr(meta, "fx", None)
        if isinstance(name, str) and isinstance(fx, str) and getattr(meta, "sync", None) is not None:
            call = f"the sync_dist of self.log({name!r}, ...) in {fx}"
            return call, _find_log_line(frames, name, fx)
    return None


def _find_log_line(frames: list[FrameType], name: str, fx: str) -> str:
    import inspect

    for f in frames:
        trainer = getattr(f.f_locals.get("self"), "trainer", None)
        module = getattr(trainer, "lightning_module", None)
        hook = getattr(type(module), fx, None) if module is not None else None
        if hook is None:
            continue
        try:
            lines, first = inspect.getsourcelines(hook)
            file = inspect.getsourcefile(hook) or "?"
        except (OSError, TypeError):
            return ""
        for offset, line in enumerate(lines):
            if "log" in line and (f'"{name}"' in line or f"'{name}'" in line):
                return f"{file}:{first + offset}"
        return f"{file}:{first}"
    return ""


def _thread_cpu_seconds(native_id: int | None) -> float | None:
    """CPU time of one thread of this process (Linux), ``None`` where it cannot be read."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# ------------------------------------------------------------------------------------- the board
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

        # the default store, the one the group was made with: set/get/add never pair with collectives
        base = dist.distributed_c10d._get_default_store()
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
        self.prefix = _store_prefix()

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
    def post_failure(self, text: str, where: str, round_: int) -> None:
        record = {"rank": self.rank, "error": text, "where": where, "round": round_}
        index = int(self.store.add("failures", 1))
        self.store.set(f"failure/{index}", json.dumps(record))
        self.failures[index] = record

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
                self.failures[self.seen] = record
                new.append(record)
            return new

    def failure_text(self, exclude: int | None = None) -> str:
        lines = [
            f"rank {r['rank']} failed in {r['where']}: {r['error']}"
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
            if _stop is not None and time.monotonic() - _stop[1] >= STOP_GRACE_S:
                self._end_if_peers_gone(answers)
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

    def _end_if_peers_gone(self, answers: dict[int, dict[str, Any]]) -> None:
        """Under a torchelastic stop signal: end this process now if a rank that has not answered did not get it.

        torchrun sends its stop signal to every worker of the group when it stops them all (the whole
        job ends: each rank posts ``signalled/<rank>``, the agreement goes on and the preemption save
        follows, as everywhere) and to the survivors only when a worker died: a rank that neither
        answered nor got the signal is then gone, and this rank cannot get past the agreement without
        it. It ends the way the signal would end a process without lplugins' handler, at once instead
        of at torchrun's SIGKILL (30 s later). Nothing committed is touched; the save it waited in was
        not committed by this rank (rank 0 commits after the agreement, or before it, whole).
        """
        assert _stop is not None
        gone = [
            r for r in range(self.world) if r not in answers and not self.store.check([f"signalled/{r}"])
        ]  # fmt: skip
        # a rank on another node gets the signal from its own agent, maybe seconds later: gone only once its
        # heartbeat is stale too (this node's agent signals all its workers at once)
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or self.world)
        gone = [r for r in gone if r // local == self.rank // local or self._heartbeat_age(r) > STALE_HEARTBEAT_S]
        if not gone:
            return
        import signal

        signum = _stop[0]
        name = signal.Signals(signum).name
        sys.stderr.write(
            f"lplugins [rank {self.rank}]: {name} from torchelastic while waiting in {self.waiting or 'an agreement'}"
            f" for rank(s) {', '.join(map(str, gone))}, which neither answered nor got the signal (their process"
            f" ended): ending this worker now for torchrun's restart (committed checkpoints are intact)\n"
        )
        for handler in [*log.handlers, *logging.getLogger().handlers]:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # the status torchrun sees for a worker its signal ended
        time.sleep(5)
        os._exit(128 + signum)

    def _heartbeat_age(self, rank: int) -> float:
        """Seconds since ``rank``'s watchdog last published its state (infinite when it never did)."""
        if not self.store.check([f"state/{rank}"]):
            return float("inf")
        return time.time() - float(json.loads(self.store.get(f"state/{rank}"))["t"])

    def _silent(self, rank: int) -> bool:
        """Whether ``rank``'s watchdog published a heartbeat once and then none for :data:`SILENT_RANK_S`."""
        if _thread is None or not self.store.check([f"state/{rank}"]):
            return False  # no watchdog here or there: nothing to judge by
        state = json.loads(self.store.get(f"state/{rank}"))
        return bool(time.time() - state["t"] > max(SILENT_RANK_S, 3 * _bound))

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


def set_attempt(token: str | None) -> None:
    """Say that the default group was made through a per-attempt store (``token``: the attempt's).

    lplugins' strategies call it after initialising the group under torchelastic; the failure board
    then knows its keys cannot meet an earlier attempt's.
    """
    global _attempt
    _attempt = token


def stop_signal(signum: int | None) -> None:
    """Note torchrun's stop signal (SIGTERM) under torchelastic (from lplugins' preemption-signal handler).

    Outside torchelastic it does nothing: the signal is a preemption, saved at the next step boundary.
    Under torchelastic it posts ``signalled/<rank>`` on the failure board (the other ranks then know
    this one is alive and stopping too), and from then on an agreement this rank waits in ends the
    process once a rank that has not answered has not got the signal either (see
    :meth:`Board._end_if_peers_gone`) instead of waiting for torchrun's SIGKILL. ``None`` forgets
    the signal (a new fit).
    """
    global _stop
    if signum is None:
        _stop = None
        return
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    if _stop is None:
        _stop = (signum, time.monotonic())
    board = _board
    if board is not None and not board.dead:
        try:
            board.store.set(f"signalled/{board.rank}", "1")
        except Exception:  # the store is gone: the agreement learns that itself
            pass


def _store_prefix() -> str:
    """The failure board's keys in the default group's store, apart from any earlier torchelastic attempt's.

    A group lplugins made under torchelastic already uses a store of its own attempt. Any other group
    under torchelastic (a stock Lightning strategy) shares torch's store with earlier attempts: the
    board's keys then carry the run id and this agent's restart count, and one warning names the fix.
    """
    if _attempt is not None or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return "lplugins/"
    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    announce(
        "lplugins: this process group was not made by an lplugins strategy; under torchrun its store keys are "
        "shared with the previous attempt's, so after a restart a rank can read a dead rank's address (Gloo "
        "'connectFullMesh failed ... Connection refused') or hang in init_process_group. Use "
        "strategy='ddp_timeout' (or 'fsdp2', 'deepspeed_*') instead of 'ddp', or set "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun; see docs/scaling-out.md"
    )
    return f"lplugins/{run_id}/r{restart}/"


def _current_board() -> Board | None:
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

    board = _current_board()
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


def note_peer_failures(err: BaseException) -> BaseException:
    """Add to ``err`` (a collective that failed) what the watchdog knows: other ranks' errors, a mismatch report."""
    notes = []
    board = _board
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


# ------------------------------------------------------------------------------------- the thread
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
            board = self.board = _current_board()
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
        wall, cpu = time.monotonic(), _thread_cpu_seconds(main.native_id)
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
            return
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
    if thread is not None:
        thread.stopped.set()
        if thread is not threading.current_thread():
            thread.join(timeout=2)
