"""The client's end of the fork server: start it, ask it for a process, hear of each process's exit.

:class:`ForkServer` starts ``python -m lplugins._fork.server`` with a pipe each way, and one daemon
thread reads its events. :meth:`ForkServer.fork` returns a :class:`Forked`, the part of
:class:`subprocess.Popen` a launcher uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``).
Nothing is waited on for ever: a server that does not get ready, or a child that does not reach its
script, within its timeout raises :class:`ForkServerError` with what it printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class ForkServerError(RuntimeError):
    """The fork server refused to serve, died, or a process it forked did not start in time."""


def _tail(path: str | os.PathLike[str] | None, limit: int = 4000) -> str:
    if path is None:
        return ""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


class Forked:
    """A process forked by the fork server: the part of :class:`subprocess.Popen` a launcher uses."""

    def __init__(self, pid: int, server: ForkServer, new_session: bool) -> None:
        self.pid = pid
        self.new_session = new_session
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
                    raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0.0)
                if not self._server.changed.wait(0.1 if left is None else min(left, 0.1)) and not self._server.alive():
                    self._server.exits.setdefault(self.pid, -signal.SIGKILL)  # the server died: so did it
        return self._server.exits[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL it (and, when it leads its own session, every process in its group)."""
        if self.new_session and self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
                return
            except (ProcessLookupError, PermissionError):
                pass
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Start a fork server that imports ``modules`` (and runs ``lplugins.load()`` with ``load``).

    Args:
        modules: What the server imports before any fork (a missing one is skipped).
        python: The interpreter (default: this one).
        env: The server's environment, which each child starts from (default: this process's).
        load: Whether the server also runs ``lplugins.load()`` (then no child needs to).
        log: Where the server's own output goes, and that of a child not told otherwise (default: a
            temporary file, quoted in errors).
        inherit: Send that output to this process's standard output and error instead of ``log``.
    """

    def __init__(
        self,
        modules: Sequence[str],
        *,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        load: bool = False,
        log: str | os.PathLike[str] | None = None,
        inherit: bool = False,
    ) -> None:
        self._own_log = log is None
        self.log_path = Path(tempfile.mkstemp(prefix="lplugins-forkserver-", suffix=".log")[1] if log is None else log)
        commands_r, self._commands = os.pipe()
        self._events, events_w = os.pipe()
        args = [python or sys.executable, "-m", "lplugins._fork.server", str(commands_r), str(events_w)]
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                [*args, *(["--load"] if load else []), *modules],
                env=dict(os.environ if env is None else env),
                stdin=subprocess.DEVNULL,
                stdout=None if inherit else out,
                stderr=None if inherit else out,
                pass_fds=(commands_r, events_w),
            )
        os.close(commands_r)
        os.close(events_w)
        self.changed = threading.Condition()
        self.exits: dict[int, int] = {}
        self.ready: float | None = None
        self.refused: list[str] | None = None
        self._started: dict[int, int] = {}  # request number -> pid
        self._running: set[int] = set()  # request numbers whose child reached its script
        self._requests = 0
        self._reader = threading.Thread(target=self._read, name="lplugins-forkserver-events", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with os.fdopen(self._events, "rb") as events:
            for line in events:
                try:
                    message: dict[str, Any] = json.loads(line)
                except ValueError:
                    continue
                with self.changed:
                    if "ready" in message:
                        self.ready = float(message["ready"])
                    elif "refused" in message:
                        self.refused = [str(r) for r in message["refused"]]
                    elif "started" in message:  # always before that child's exit (one writer: the server)
                        pid = int(message["started"])
                        self.exits.pop(pid, None)  # a pid used again: what its last owner did is not this one's
                        self._started[int(message["id"])] = pid
                    elif "running" in message:
                        self._running.add(int(message["id"]))
                    elif "exit" in message:
                        self.exits[int(message["exit"])] = int(message["returncode"])
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float) -> float:
        """Wait until the server has imported everything; the seconds its imports took.

        Raises:
            ForkServerError: It refused (a thread or a process group at fork time), died, or was not
                ready within ``timeout`` seconds (then it is killed); the message holds its output.
        """
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.ready is None and self.refused is None and self.alive() and time.monotonic() < deadline:
                self.changed.wait(0.1)
        if self.ready is not None and self.alive():
            return self.ready
        if self.refused is not None:
            why = "refused to fork: " + "; ".join(self.refused)
        elif self.alive():
            why = f"was not ready within {timeout:g}s (killed)"
        else:
            why = f"exited with {self.process.poll()} before it was ready"
        message = f"the fork server {why}\n--- its output\n{_tail(self.log_path)}"
        self.close(timeout=1.0)
        raise ForkServerError(message)

    def fork(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        env_update: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdout: str | os.PathLike[str] | None = None,
        stderr: str | os.PathLike[str] | None = None,
        new_session: bool = False,
        timeout: float = 30.0,
    ) -> Forked:
        """A new process running ``argv`` (``["job.py", *args]``) as ``python job.py *args`` would.

        Args:
            argv: The script and its arguments.
            env: Its whole environment (default: the server's, updated by ``env_update``).
            env_update: Variables set on top of ``env``.
            cwd: Its working directory (default: the server's).
            stdout: A file its standard output is appended to (default: the server's log).
            stderr: The same for standard error (it may be the same file as ``stdout``).
            new_session: Whether it leads a session of its own (so :meth:`Forked.kill` ends its children too).
            timeout: Seconds for it to reach its script's first line.

        Raises:
            ForkServerError: The server is not serving, or the process did not reach its script within
                ``timeout`` (then it is killed); the message holds its output.
        """
        if self.ready is None or not self.alive():
            raise ForkServerError("the fork server is not serving (call wait_ready first; it may have died)")
        with self.changed:
            self._requests += 1
            number = self._requests
        request = {
            "id": number,
            "argv": [str(a) for a in argv],
            "env": None if env is None else dict(env),
            "env_update": dict(env_update or {}),
            "cwd": None if cwd is None else str(cwd),
            "stdout": None if stdout is None else str(stdout),
            "stderr": None if stderr is None else str(stderr),
            "new_session": new_session,
        }
        try:
            os.write(self._commands, (json.dumps(request) + "\n").encode())
        except OSError as error:
            raise ForkServerError(f"the fork server is not serving: {error}") from None
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.alive() and time.monotonic() < deadline:
                pid = self._started.get(number)
                if pid is not None and (number in self._running or pid in self.exits):
                    break
                self.changed.wait(0.05)
            pid = self._started.get(number)
        if pid is not None and number in self._running:
            return Forked(pid, self, new_session)
        if pid is not None and pid not in self.exits:
            Forked(pid, self, new_session).kill()
        what = "exited before it ran" if pid is not None and pid in self.exits else f"did not start within {timeout:g}s"
        output = "\n".join(t for t in (_tail(stdout), _tail(stderr) if stderr != stdout else "") if t)
        raise ForkServerError(f"{list(argv)!r} {what}\n--- its output\n{output or _tail(self.log_path)}")

    def close(self, timeout: float = 15.0) -> None:
        """Close the requests (the server ends what still runs, then exits); kill it if it does not in time."""
        try:
            os.close(self._commands)
        except OSError:
            pass
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)
