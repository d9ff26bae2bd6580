"""The fork server of ``lplugins ft run``: import the heavy modules once, fork each replica group from them.

``python -m lplugins._cli.ft_zygote CMD_FD EVENT_FD`` imports torch, Lightning, torchft and lplugins
(and loads lplugins' plugins) once, before any group trains, says ``{"ready": ...}`` on ``EVENT_FD``,
then reads one JSON request a line from ``CMD_FD``: ``{"replica": 2, "argv": ["train.py", ...], "log":
path or null}``. For each it forks a child that sets ``REPLICA_GROUP_ID``, sends its output to ``log``
and runs ``train.py`` as ``__main__``, exactly as ``python train.py ...`` would, and answers
``{"started": pid}``; when a child ends it says ``{"exit": pid, "returncode": code}`` (``-N``: killed by
signal N, as :class:`subprocess.Popen` reports it).

A replacement group therefore starts training with no import at all: nothing competes for the CPU
with the groups that train, and no spare has to be warmed up again after each loss. A fork is
copy-on-write: the children share the imported modules' memory until they write to it.

The server itself never computes: an OpenMP thread pool used before a fork hangs the child's first
parallel region, so it only imports (torch creates its pool's threads at import, unused; each child
builds its own). It is one thread: the requests and the children's exits are served in one loop.
When ``CMD_FD`` closes (the launcher is gone), it sends SIGTERM to the children still running and
exits once they have.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import sys
import time
import traceback
from typing import Any

from lplugins.strategies._ft_env import REPLICA_ID_VAR

#: What is imported before any group starts (what a ``ft_ddp`` training script and its set-up use).
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


def warm() -> float:
    """Import :data:`WARM_MODULES` (a missing optional one is skipped) and load the plugins; the seconds taken."""
    began = time.monotonic()
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # the script imports what it needs itself, and says what is missing
            pass
    import lplugins

    lplugins.load()  # once: compose() in every child finds the plugins loaded
    return time.monotonic() - began


def _child(request: dict[str, Any], keep_closed: tuple[int, ...]) -> None:
    """In the forked child: become ``python script.py args`` for one replica group; never returns."""
    for fd in keep_closed:
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter has
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if request.get("log"):
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
    os.environ[REPLICA_ID_VAR] = str(request["replica"])
    if "numpy" in sys.modules:  # numpy's global generator was seeded once, in the server: not shared
        sys.modules["numpy"].random.seed()
    argv = [str(arg) for arg in request["argv"]]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    code: Any = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:
        code = done.code
    except BaseException:  # reported as `python script.py` would, then exit 1
        traceback.print_exc()
        code = 1
    sys.exit(code)  # a normal interpreter exit: the script's atexit handlers run, buffers are flushed


def _send(events: int, message: dict[str, Any]) -> None:
    os.write(events, (json.dumps(message) + "\n").encode())


def serve(commands: int, events: int) -> None:
    """Warm up, then fork a replica group per request and report the children's exits, until ``commands`` closes."""
    took = warm()
    _send(events, {"ready": round(took, 3), "pid": os.getpid()})
    children: set[int] = set()
    pending = b""
    open_ = True
    while open_ or children:
        readable = select.select([commands] if open_ else [], [], [], 0.02)[0]
        if readable:
            chunk = os.read(commands, 65536)
            if not chunk:
                open_ = False
                for pid in children:  # the launcher is gone: do not leave its groups behind
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, (commands, events))
                children.add(pid)
                _send(events, {"started": pid, "replica": request["replica"]})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(events, {"exit": pid, "returncode": os.waitstatus_to_exitcode(status)})


def main() -> None:
    """``python -m lplugins._cli.ft_zygote CMD_FD EVENT_FD`` (started by the launcher)."""
    serve(int(sys.argv[1]), int(sys.argv[2]))


if __name__ == "__main__":
    main()
