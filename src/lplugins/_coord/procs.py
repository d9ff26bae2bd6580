"""Whether a process on this host is still alive: its pid, and its start time (a reused pid is another process).

Used where lplugins learns that another rank's or another job's process ended without waiting for a
timeout: the failure board (a rank killed inside an agreement) and the checkpoint directory's claim.
Linux reads ``/proc``; elsewhere a pid that exists counts as alive.
"""

from __future__ import annotations

import os
import socket

__all__ = ["host", "proc_start", "running"]


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
