"""``lplugins ft run``: a torchft lighthouse and N replica groups on this machine, each restarted when it dies.

The lighthouse is torchft's own (``torchft._torchft.LighthouseServer``, run inside the launcher) unless
``lighthouse=`` names one that runs elsewhere (the multi-host form: one lighthouse, one launcher per
host with its own ``first_replica``). Each replica group is one process running the command with
``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``LPLUGINS_FT_MIN_REPLICAS`` set.

A group that exits with a non-zero status (or a signal) is started again with the same id, up to
``max_restarts`` times in all, until the first group finishes cleanly. For a ``python script.py ...``
command the groups are forked from a *fork server* (:mod:`lplugins._fork`) that imported torch,
Lightning, torchft and lplugins (and loaded the plugins) once, before any group trained: a restarted
group starts with no import, and nothing is imported while the others train (a fork is copy-on-write:
the groups share the imported modules' memory until they write to it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lplugins._fork.client import Forked, ForkServer, ForkServerError
from lplugins.strategies import _ft_env
from lplugins.strategies._ft_env import FTConfigError

__all__ = ["Launcher", "ReplicaEvent", "start_lighthouse"]


def _positive(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FTConfigError(f"{name}={value!r} must be an int >= {minimum}.")
    return value


def start_lighthouse(
    *,
    min_replicas: int,
    port: int = 0,
    heartbeat_timeout_ms: int = 1000,
    join_timeout_ms: int = 60000,
    quorum_tick_ms: int = 10,
) -> Any:
    """Start torchft's lighthouse in this process; ``server.address()`` is its URL.

    A quorum that waits for a lost group forms at the first quorum tick after the group's heartbeat
    timed out: a short tick (10 ms; torchft's default is 100) keeps that wait near the heartbeat timeout.

    Raises:
        FTUnavailableError: torchft is not installed.
    """
    _ft_env.require("ft_ddp")
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


@dataclass(frozen=True)
class ReplicaEvent:
    """One thing that happened to a replica group: ``"start"``, ``"exit"`` (with its status) or ``"restart"``."""

    time: float
    replica: int
    kind: str
    pid: int
    returncode: int | None = None


#: What the fork server imports before any group starts (what a ``ft_ddp`` training script and its set-up use).
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.utils.data",
    "lightning.pytorch",
    "lightning.pytorch.loggers",
    "torchft",
    "torchft.checkpointing.http_transport",
    "lplugins",
    "lplugins.strategies.ft",
    "lplugins.callbacks",
)


@dataclass
class _Slot:
    replica: int
    process: subprocess.Popen[bytes] | Forked | None = None
    done: bool = False
    returncode: int | None = None
    log: IO[bytes] | None = field(default=None, repr=False)


def _forkable(command: Sequence[str]) -> bool:
    """Whether the groups can be forked from the fork server: a ``python script.py args`` command."""
    return len(command) >= 2 and Path(command[0]).name.startswith("python") and command[1].endswith(".py")


class Launcher:
    """Start a lighthouse (or use one) and ``replicas`` replica groups running ``command``; restart lost ones.

    Args:
        command: The command each replica group runs (``["python", "train.py", ...]``).
        replicas: How many replica groups to start here.
        lighthouse: A running lighthouse's URL; ``None``: start one here.
        min_replicas: The fewest groups a step commits with (and the lighthouse's first quorum size).
        first_replica: The id of the first group started here (multi-host: each host its own range).
        total_replicas: The job's number of groups (default ``first_replica + replicas``).
        max_restarts: How many restarts in all, for all groups together.
        port: The port of the lighthouse started here (``0``: any free one).
        heartbeat_timeout_ms: How long without a heartbeat before the lighthouse drops a group (the
            groups heartbeat every quarter of it: ``LPLUGINS_FT_HEARTBEAT_MS``, unless set).
        quorum_tick_ms: How often the lighthouse checks whether a quorum can form.
        spare: Fork the groups from a fork server that imported torch, Lightning, torchft and lplugins
            once (only for ``python script.py`` commands; otherwise, or when it fails, each group is a
            fresh ``command``).
        env: Extra environment for every group.
        log_dir: Where each process's output goes (``replica_<id>.<n>.log``); ``None``: inherited.

    Raises:
        FTConfigError: a count is out of range, or ``lighthouse`` does not answer.
    """

    def __init__(
        self,
        command: Sequence[str],
        replicas: int,
        *,
        lighthouse: str | None = None,
        min_replicas: int = 1,
        first_replica: int = 0,
        total_replicas: int | None = None,
        max_restarts: int = 10,
        port: int = 0,
        heartbeat_timeout_ms: int = 1000,
        quorum_tick_ms: int = 10,
        spare: bool = True,
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not command:
            raise FTConfigError("No command to run: `lplugins ft run --replicas N -- python train.py`.")
        self.command = list(command)
        self.replicas = _positive("replicas", replicas)
        self.first_replica = _positive("first_replica", first_replica, 0)
        self.total_replicas = _positive(
            "total_replicas", first_replica + replicas if total_replicas is None else total_replicas
        )
        if self.first_replica + self.replicas > self.total_replicas:
            raise FTConfigError(
                f"replicas={replicas} from first_replica={first_replica} need ids up to "
                f"{first_replica + replicas - 1}, but total_replicas={self.total_replicas} allows "
                f"0..{self.total_replicas - 1}."
            )
        self.min_replicas = _positive("min_replicas", min_replicas)
        if self.min_replicas > self.total_replicas:
            raise FTConfigError(
                f"min_replicas={min_replicas} is more than the job's {self.total_replicas} replica groups: "
                "no step could ever commit. Use --min-replicas between 1 and --replicas (--total-replicas)."
            )
        self.max_restarts = _positive("max_restarts", max_restarts, 0)
        self.heartbeat_timeout_ms = _positive("heartbeat_timeout_ms", heartbeat_timeout_ms)
        self.quorum_tick_ms = _positive("quorum_tick_ms", quorum_tick_ms)
        if lighthouse is not None:
            _ft_env.check_lighthouse(lighthouse, setting="--lighthouse")
        else:
            _ft_env.require("ft_ddp")
        self.lighthouse = lighthouse
        self.port = _positive("port", port, 0)
        self.env = dict(env or {})
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.forking = bool(spare) and _forkable(self.command)
        self.events: list[ReplicaEvent] = []
        self.restarts = 0
        self._server: Any = None
        self._slots = [_Slot(first_replica + i) for i in range(replicas)]
        self._forks: ForkServer | None = None
        self._runs: dict[int, int] = {}

    # ----------------------------------------------------------------------------------- starting
    def start(self) -> str:
        """Start the lighthouse (unless given), the fork server and every replica group; the lighthouse URL."""
        if self.lighthouse is None:
            self._server = start_lighthouse(
                min_replicas=self.min_replicas,
                port=self.port,
                heartbeat_timeout_ms=self.heartbeat_timeout_ms,
                quorum_tick_ms=self.quorum_tick_ms,
            )
            self.lighthouse = str(self._server.address())
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.forking:
            log = None if self.log_dir is None else self.log_dir / "forkserver.log"
            self._forks = ForkServer(
                WARM_MODULES, python=self.command[0], env=self._environment(), load=True, log=log, inherit=log is None
            )
            try:
                self._forks.wait_ready(timeout=300)
            except ForkServerError as error:
                print(f"lplugins ft: each group imports on its own: {error}", file=sys.stderr)
                self._forks = None
        for slot in self._slots:
            self._launch(slot)
        return self.lighthouse

    def _environment(self) -> dict[str, str]:
        return {
            _ft_env.HEARTBEAT_VAR: str(max(10, self.heartbeat_timeout_ms // 4)),
            **os.environ,
            **self.env,
            _ft_env.LIGHTHOUSE_VAR: str(self.lighthouse),
            _ft_env.NUM_REPLICAS_VAR: str(self.total_replicas),
            _ft_env.MIN_REPLICAS_VAR: str(self.min_replicas),
        }

    def _output(self, name: str) -> IO[bytes] | None:
        if self.log_dir is None:
            return None
        return open(self.log_dir / f"{name}.log", "ab")  # closed when the process is replaced

    def _launch(self, slot: _Slot) -> None:
        run = self._runs.get(slot.replica, 0)
        self._runs[slot.replica] = run + 1
        if slot.log is not None:
            slot.log.close()
        name = f"replica_{slot.replica}.{run}"
        forked = None
        if self._forks is not None:
            path = None if self.log_dir is None else self.log_dir / f"{name}.log"
            try:
                forked = self._forks.fork(
                    self.command[1:], env_update={_ft_env.REPLICA_ID_VAR: str(slot.replica)}, stdout=path, stderr=path
                )
            except ForkServerError:
                forked = None
        if forked is not None:
            slot.process, slot.log = forked, None
            self.events.append(ReplicaEvent(time.time(), slot.replica, "start", forked.pid))
            return
        slot.log = self._output(name)
        env = {**self._environment(), _ft_env.REPLICA_ID_VAR: str(slot.replica)}
        slot.process = subprocess.Popen(self.command, env=env, stdout=slot.log, stderr=slot.log)
        self.events.append(ReplicaEvent(time.time(), slot.replica, "start", slot.process.pid))

    # ------------------------------------------------------------------------------------ running
    def _finished_cleanly(self) -> bool:
        return any(slot.done and slot.returncode == 0 for slot in self._slots)

    def pid(self, replica: int) -> int | None:
        """The pid of replica group ``replica``'s running process (``None`` when none runs)."""
        for slot in self._slots:
            if slot.replica == replica and slot.process is not None and slot.process.poll() is None:
                return int(slot.process.pid)
        return None

    def poll(self) -> bool:
        """Restart lost groups; ``True`` once every group has finished (cleanly or out of restarts)."""
        for slot in self._slots:
            if slot.done or slot.process is None:
                continue
            code = slot.process.poll()
            if code is None:
                continue
            self.events.append(ReplicaEvent(time.time(), slot.replica, "exit", slot.process.pid, code))
            if code != 0 and self.restarts < self.max_restarts and not self._finished_cleanly():
                self.restarts += 1
                self.events.append(ReplicaEvent(time.time(), slot.replica, "restart", slot.process.pid, code))
                self._launch(slot)
            else:
                slot.done, slot.returncode = True, code
        return all(slot.done for slot in self._slots)

    def wait(self, poll_interval: float = 0.05) -> int:
        """Poll until every group has finished; 0 when each one's last run exited cleanly."""
        while not self.poll():
            time.sleep(poll_interval)
        return 0 if all(slot.returncode == 0 for slot in self._slots) else 1

    def stop(self) -> None:
        """Stop every process this launcher started (SIGTERM, then SIGKILL) and the lighthouse."""
        processes = [slot.process for slot in self._slots if slot.process is not None]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.time() + 5
        for process in processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._forks is not None:
            self._forks.close()
            self._forks = None
        for slot in self._slots:
            if slot.log is not None:
                slot.log.close()
                slot.log = None
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def run(self) -> int:
        """Start, wait, stop: what ``lplugins ft run`` does; the exit status."""
        self.start()
        print(
            f"lplugins ft: lighthouse {self.lighthouse}; replica groups {self.first_replica}.."
            f"{self.first_replica + self.replicas - 1} of {self.total_replicas}",
            file=sys.stderr,
            flush=True,
        )
        try:
            return self.wait()
        finally:
            self.stop()
