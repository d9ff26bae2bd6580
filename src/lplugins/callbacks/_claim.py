"""The claim on a checkpoint directory: one job writes a ``dirpath`` at a time.

Two jobs started with the same ``dirpath`` would delete each other's checkpoints (retention), remove
each other's saves in flight (the cleanup of leftovers at start) and interleave their commits. So at
the start of ``fit``, before anything in the directory is touched, global rank 0 claims the directory
by writing :data:`CLAIM` (host, pid, start time, a token) and keeps a heartbeat in it on a
background thread; the decision travels to every rank, and all ranks refuse together.

A claim is *stale* -- taken over automatically, said once on rank zero -- when its process is gone
(same host: the pid is not running, or is another process now) or when its heartbeat is older than
:data:`LEASE_SECONDS` (any host; a claim from another host with a fresh heartbeat is watched until it
either beats, live, or the lease runs out, stale). A live claim is refused with
:class:`~lplugins.callbacks.CheckpointClaimError` naming the other job, unless ``take_over=True``.
The claim is removed when the job tears down (a clean end, an exception, a preemption exit).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from lplugins._coord.procs import proc_start, running
from lplugins._log import announce
from lplugins.callbacks._errors import CheckpointClaimError

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lplugins.callbacks._storage import Storage

__all__ = ["CLAIM", "HEARTBEAT_SECONDS", "LEASE_SECONDS", "Claim", "DirectoryClaim", "claim_directory"]

log = logging.getLogger("lplugins")

#: The claim file in the checkpoint directory (never a checkpoint name, never a temporary entry).
CLAIM = ".lplugins-claim.json"
#: How often the holder rewrites its heartbeat.
HEARTBEAT_SECONDS = 2.0
#: A claim whose heartbeat is older than this is stale.
LEASE_SECONDS = 15.0
_NEW = CLAIM + ".new."  # a heartbeat being written: written whole, then renamed over the claim


@dataclass
class Claim:
    """What :data:`CLAIM` holds: who writes the directory, and when it last said so."""

    host: str
    pid: int
    started: float
    token: str
    heartbeat: float
    proc_start: str | None = None

    @classmethod
    def mine(cls) -> Claim:
        t = time.time()
        return cls(socket.gethostname(), os.getpid(), t, uuid.uuid4().hex, t, proc_start(os.getpid()))

    @classmethod
    def parse(cls, raw: bytes) -> Claim:
        """Raises ValueError when ``raw`` is not a claim."""
        try:
            data: Any = json.loads(raw)
            claim = cls(**data)
        except (TypeError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise ValueError(f"not a claim: {err}") from None
        if not (isinstance(claim.host, str) and isinstance(claim.pid, int) and isinstance(claim.token, str)):
            raise ValueError("not a claim: a field has the wrong type")
        if not all(isinstance(v, (int, float)) for v in (claim.started, claim.heartbeat)):
            raise ValueError("not a claim: a field has the wrong type")
        return claim

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, started {started}"

    def stale_because(self, lease: float, now: float | None = None) -> str | None:
        """Why this claim is stale without watching it (None: it may be live)."""
        if self.host == socket.gethostname() and not running(self.pid, self.proc_start):
            return f"process {self.pid} is not running on this host"
        age = (time.time() if now is None else now) - self.heartbeat
        if age > lease:
            return f"its last heartbeat is {age:.0f}s old (lease {lease:.0f}s)"
        return None


class DirectoryClaim:
    """Rank 0's claim on a checkpoint directory (see the module docstring).

    Args:
        storage: The checkpoint directory.
        take_over: Take the directory over from a live claim too (the other job must be stopped).
        lease: Seconds after which a claim's heartbeat counts as stale.
        heartbeat: Seconds between heartbeats.
    """

    def __init__(
        self, storage: Storage, take_over: bool, lease: float = LEASE_SECONDS, heartbeat: float = HEARTBEAT_SECONDS
    ) -> None:
        self.storage = storage
        self.take_over = take_over
        self.lease = lease
        self.interval = heartbeat
        self.claim = Claim.mine()
        self.lost: Claim | None = None  # the claim that replaced ours while we ran
        self.taken_over = False  # another job took the directory over while we ran (said once)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ reading
    def _read(self) -> tuple[Claim | None, str | None]:
        """(the claim in the directory, why it cannot be read); (None, None) when there is none."""
        try:
            raw = self.storage.read_bytes(CLAIM)
        except FileNotFoundError:
            return None, None
        except OSError as err:
            return None, f"unreadable ({err})"
        try:
            return Claim.parse(raw), None
        except ValueError as err:
            return None, str(err)

    # ------------------------------------------------------------------------------------ acquiring
    def acquire(self) -> str | None:
        """Claim the directory: None when it is ours now, else the refusal (the other job named)."""
        for name in self.storage.listdir():
            if name.startswith(_NEW):
                self.storage.remove(name)  # a heartbeat a killed job was writing
        other, problem = self._read()
        if other is None and problem is None:
            if self._create():
                self._start()
                return None
            other, problem = self._read()  # another job created it first
        if other is not None and other.token == self.claim.token:
            return None
        reason: str | None
        if other is None:
            reason = f"the claim file is {problem}" if problem else "it was released meanwhile"
        else:
            reason = other.stale_because(self.lease) or self._watch(other)
        if reason is None and not self.take_over:
            assert other is not None
            age = time.time() - other.heartbeat
            return (
                f"DurableCheckpoint: dirpath={self.storage.dirpath!r} is in use by another job ({other.describe()},"
                f" last heartbeat {age:.0f}s ago). Two jobs writing one checkpoint directory would delete each"
                " other's checkpoints. Stop that job or give this one another dirpath; to take the directory over"
                " anyway (only once that job is stopped), pass DurableCheckpoint(..., take_over=True)."
            )
        whose = other.describe() if other is not None else "unknown job"
        why = reason if reason is not None else "take_over=True (the other job looked live)"
        self._write()
        self._start()
        announce(
            "lplugins: DurableCheckpoint took over %s from %s: %s", self.storage.dirpath, whose, why
        )  # fmt: skip
        return None

    def _watch(self, other: Claim) -> str | None:
        """Watch a claim from another host until it beats (None: live) or its lease runs out (why it is stale)."""
        if other.host == socket.gethostname() or self.take_over:
            return None  # a running process here is live; take_over does not wait
        deadline = other.heartbeat + self.lease
        while time.time() <= deadline:
            time.sleep(min(self.interval, max(0.05, deadline - time.time())))
            now, _ = self._read()
            if now is None or now.token != other.token:
                return "it was released or replaced" if now is None else None
            if now.heartbeat != other.heartbeat:
                return None
        return f"no heartbeat for {self.lease:.0f}s (lease)"

    def _create(self) -> bool:
        """Create the claim file if there is none (exclusive); False when another job did first."""
        tmp = f"{_NEW}{uuid.uuid4().hex[:12]}"
        self.storage.write_small(tmp, self.claim.to_json())
        try:
            self.storage.rename(tmp, CLAIM)  # refuses to replace an existing claim
        except FileExistsError:
            self.storage.remove(tmp)
            return False
        return True

    def _write(self) -> None:
        """Write (or replace) the claim with ours, atomically."""
        self.claim.heartbeat = time.time()
        tmp = f"{_NEW}{uuid.uuid4().hex[:12]}"
        self.storage.write_small(tmp, self.claim.to_json())
        self._replace(tmp)

    def _replace(self, tmp: str) -> None:
        from lplugins.callbacks._storage import is_remote

        if not is_remote(self.storage.dirpath):
            os.replace(self.storage.path(tmp), self.storage.path(CLAIM))  # atomic: a reader sees one whole claim
            return
        self.storage.remove(CLAIM)  # object stores: no atomic replace (a reader in between sees no claim)
        self.storage.rename(tmp, CLAIM, sync_dir=False)

    # ------------------------------------------------------------------------------------ heartbeat
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="lplugins-checkpoint-claim", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                if self._stop.is_set():
                    return
                now, problem = self._read()
                if problem is None and (now is None or now.token != self.claim.token):
                    self._lost(now)  # replaced, or removed by a job that took it over and ended: never rewritten
                    return
                try:
                    self._write()
                except OSError as err:  # a missed beat; the lease is several beats long
                    log.warning(
                        "lplugins: DurableCheckpoint: claim heartbeat in %s failed: %s", self.storage.dirpath, err
                    )

    def release(self) -> None:
        """Stop the heartbeat and remove the claim if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            now, problem = self._read()
            if now is not None and now.token == self.claim.token:
                self.storage.remove(CLAIM)
            elif problem is None and not self.taken_over:  # taken over (and maybe ended) between two beats
                self._lost(now)

    def _lost(self, now: Claim | None) -> None:
        """Say, once, that another job took the directory over (``now``: its claim, None once it has ended)."""
        self.lost, self.taken_over = now, True
        log.warning(
            "lplugins: DurableCheckpoint: another job (%s) took checkpoint directory %s over from this"
            " one; this job no longer holds it.",
            now.describe() if now is not None else "since ended", self.storage.dirpath,
        )  # fmt: skip


def claim_directory(trainer: Trainer, storage: Storage, take_over: bool) -> DirectoryClaim | None:
    """Rank 0 claims ``storage`` for this job; every rank raises if it is refused (a collective).

    Returns:
        The claim on rank 0 (release it at teardown); None on the other ranks.

    Raises:
        CheckpointClaimError: another job holds the directory (on every rank, naming that job).
    """
    from lplugins.callbacks._collective import broadcast

    claim = DirectoryClaim(storage, take_over) if trainer.is_global_zero else None
    refusal = None
    if claim is not None:
        try:
            refusal = claim.acquire()
        except OSError as err:
            refusal = f"DurableCheckpoint: could not claim dirpath={storage.dirpath!r}: {err}"
    refusal = broadcast(trainer, refusal)
    if refusal is not None:
        raise CheckpointClaimError(refusal)
    return claim
