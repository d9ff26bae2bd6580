"""Whether a process on this host is still alive: its pid, and its start time (a reused pid is another process).

Used where lplugins learns that another rank's or another job's process ended without waiting for a
timeout: the failure board (a rank killed inside an agreement) and the checkpoint directory's claim.
Linux reads ``/proc``; elsewhere a pid that exists counts as alive. :data:`fork_guard` holds forks
back while the watchdog thread samples (a child must not inherit a lock that thread holds).
"""

from __future__ import annotations

import os
import socket
import threading

__all__ = ["ForkGuard", "fork_guard", "host", "proc_start", "running"]


def host() -> str:
    """This machine's name and this process's pid namespace: two processes can see each other's pids only
    when both match (containers on one machine may share a hostname, not their pids)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


def proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), or None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def running(pid: int, start: str | None = None) -> bool:
    """Whether ``pid`` is a live process on this host (and, given its ``start``, the same one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False  # killed, not reaped yet
    except (OSError, IndexError):
        pass
    found = proc_start(pid)
    return start is None or found is None or found == start


class ForkGuard:
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


fork_guard = ForkGuard()
os.register_at_fork(
    before=fork_guard.before,
    after_in_parent=fork_guard.after_in_parent,
    after_in_child=fork_guard.after_in_child,
)
