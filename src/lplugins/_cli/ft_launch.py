"""``lplugins ft run``: a torchft lighthouse and N replica groups on this machine, each restarted when it dies.

The lighthouse is torchft's own (``torchft._torchft.LighthouseServer``, run inside the launcher) unless
``lighthouse=`` names one that runs elsewhere (the multi-host form: one lighthouse, one launcher per
host with its own ``first_replica``). Each replica group is one process running the command with
``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``LPLUGINS_FT_MIN_REPLICAS`` set.

A group that exits with a non-zero status (or a signal) is started again with the same id, up to
``max_restarts`` times in all, until the first group finishes cleanly. For a ``python script.py ...``
command the groups are forked from a *fork server* (:mod:`lplugins._cli.ft_zygote`) that imported
torch, Lightning, torchft and lplugins once, before any group trained: a restarted group starts with
no import, and nothing is imported while the others train.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

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


class _Forked:
    """A replica group forked by the fork server: the part of :class:`subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int, server: _ForkServer) -> None:
        self.pid = pid
        self._server = server

    @property
    def returncode(self) -> int | None:
        return self._server.exits.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server.changed:
            while self.pid not in self._server.exits:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"replica group pid {self.pid}", timeout or 0.0)
                if not self._server.changed.wait(0.1 if left is None else min(left, 0.1)) and not self._server.alive():
                    self._server.exits.setdefault(self.pid, -signal.SIGKILL)  # the server died: so did it
        return self._server.exits[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ForkServer:
    """The launcher's end of :mod:`lplugins._cli.ft_zygote`: start it, ask it to fork a group, hear of exits."""

    def __init__(self, python: str, env: Mapping[str, str], log: IO[bytes] | None) -> None:
        commands_r, self._commands = os.pipe()
        self._events, events_w = os.pipe()
        self.process = subprocess.Popen(
            [python, "-m", "lplugins._cli.ft_zygote", str(commands_r), str(events_w)],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(commands_r, events_w),
        )
        os.close(commands_r)
        os.close(events_w)
        self.changed = threading.Condition()
        self.exits: dict[int, int] = {}
        self.ready: float | None = None
        self._started: list[int] = []
        self._reader = threading.Thread(target=self._read, name="lplugins-ft-forkserver", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with os.fdopen(self._events, "rb") as events:
            for line in events:
                message = json.loads(line)
                with self.changed:
                    if "ready" in message:
                        self.ready = float(message["ready"])
                    elif "started" in message:
                        self._started.append(int(message["started"]))
                    elif "exit" in message:
                        self.exits[int(message["exit"])] = int(message["returncode"])
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server has imported everything (``False``: it died, or not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.ready is None and self.alive() and time.monotonic() < deadline:
                self.changed.wait(0.1)
        return self.ready is not None and self.alive()

    def fork(self, replica: int, argv: Sequence[str], log: Path | None, timeout: float = 10.0) -> _Forked | None:
        """A new replica group running ``argv`` (``script.py args``); ``None`` when the server cannot."""
        if self.ready is None or not self.alive():
            return None
        request = {"replica": replica, "argv": list(argv), "log": None if log is None else str(log)}
        with self.changed:
            before = len(self._started)
            try:
                os.write(self._commands, (json.dumps(request) + "\n").encode())
            except OSError:
                return None
            deadline = time.monotonic() + timeout
            while len(self._started) == before and self.alive() and time.monotonic() < deadline:
                self.changed.wait(0.05)
            if len(self._started) == before:
                return None
            return _Forked(self._started[before], self)

    def close(self, timeout: float = 10.0) -> None:
        """Close its requests (it sends SIGTERM to the groups still running, then exits); kill it if it does not."""
        try:
            os.close(self._commands)
        except OSError:
            pass
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class _Slot:
    replica: int
    process: subprocess.Popen[bytes] | _Forked | None = None
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
        self._forks: _ForkServer | None = None
        self._forks_log: IO[bytes] | None = None
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
            self._forks_log = self._output("forkserver")
            self._forks = _ForkServer(self.command[0], self._environment(), self._forks_log)
            if not self._forks.wait_ready(timeout=300):
                print("lplugins ft: the fork server did not start; each group imports on its own", file=sys.stderr)
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
            forked = self._forks.fork(slot.replica, self.command[1:], path)
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
        if self._forks_log is not None:
            self._forks_log.close()
            self._forks_log = None
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
