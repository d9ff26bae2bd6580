"""The fork server's process: import the heavy modules once, then fork each requested process from them.

``python -m lplugins._fork.server CMD_FD EVENT_FD [--load] MODULE...`` imports the modules (a missing
one is skipped: the script imports what it needs and says what is missing), runs ``lplugins.load()``
with ``--load``, checks that forking is safe, says ``{"ready": seconds, "pid": pid}`` on ``EVENT_FD``
(or ``{"refused": [reasons]}`` and exits 3), then reads one JSON request a line from ``CMD_FD``::

    {"id": any, "argv": ["job.py", ...], "env": {...} or null, "env_update": {...}, "cwd": path or null,
     "stdout": path or null, "stderr": path or null, "new_session": false}

For each it forks a child that becomes ``python job.py ...`` run in ``cwd`` with ``env`` (the server's
own, updated by ``env_update``, when ``env`` is null), its output appended to the files, and answers
``{"started": pid, "id": id}``; the child says ``{"running": pid, "id": id}`` just before the script's
first line runs (it may come first: the two are written by two processes). When a child ends the server
says ``{"exit": pid, "returncode": code}`` (``-N``: killed by signal N, as :class:`subprocess.Popen`
reports it). When ``CMD_FD`` closes (the client is gone) it sends SIGTERM to
the children still running and their process groups, SIGKILL after :data:`GRACE_S`, and once they have
ended, SIGKILL to every process still carrying its mark (:data:`MARK_VAR`: what they started, a
process that left their session included), then exits.

Forking is safe only from a process with one thread and no process group: a lock held by another
thread stays held in the child for ever, and a child cannot use its parent's gloo or NCCL connections.
The server therefore refuses to serve when an import started a Python thread, added a native thread
beyond the idle one ``import torch`` itself starts, or initialised ``torch.distributed``. It never
computes (an OpenMP pool used before a fork hangs the child's first parallel region).
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import importlib.machinery
import io
import json
import os
import random
import select
import signal
import sys
import threading
import time
import types
from collections.abc import Sequence
from typing import Any

#: Seconds between the SIGTERM sent to the children left when the client has gone and a SIGKILL.
GRACE_S = 10.0
#: The variable every child is started with (this server's mark): what they start is found by it at the end.
MARK_VAR = "LPLUGINS_FORK_SERVER"
_mark = f"{os.getpid()}-{os.urandom(6).hex()}"


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: only Python's own count is known
        return threading.active_count()


def warm(modules: Sequence[str], load: bool = False) -> tuple[float, list[str]]:
    """Import ``modules`` (and ``lplugins.load()`` with ``load``): the seconds taken and why forking is unsafe."""
    began = time.monotonic()
    baseline = _native_threads()
    heavy = ("torch", "lightning", "pytorch_lightning", "lplugins", "torchmetrics", "torchft", "deepspeed")
    if any(m.split(".")[0] in heavy for m in modules):  # torch starts one idle native thread at import (OMP)
        try:
            importlib.import_module("torch")
        except ImportError:
            pass
        baseline = _native_threads()
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if load:  # lplugins itself, as a module named on the command line (this module sits below it)
        importlib.import_module("lplugins").load()
    return time.monotonic() - began, fork_hazards(baseline)


def fork_hazards(native_baseline: int) -> list[str]:
    """Why a fork of this process would hang or corrupt its child (empty: it is safe)."""
    found = []
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        found.append(f"Python threads are running: {', '.join(sorted(others))}")
    native = _native_threads()
    if not others and native > native_baseline:
        found.append(f"{native - native_baseline} native thread(s) beyond torch's own were started at import")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        found.append("a torch.distributed process group is initialised")
    return found


def _send(events: int, message: dict[str, Any]) -> None:
    try:
        os.write(events, (json.dumps(message) + "\n").encode())
    except OSError:  # the client has gone (a broken pipe): its processes are ended all the same
        pass


def _streams(env: dict[str, str]) -> None:
    """Fresh ``sys.stdout``/``sys.stderr`` over fds 1 and 2, buffered as a new interpreter's would be."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    out = open(1, "wb", buffering=0 if unbuffered else -1, closefd=False)
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", errors="strict", write_through=unbuffered)
    err = open(2, "wb", buffering=0, closefd=False)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace", write_through=True)


def _reseed() -> None:
    """What a fresh interpreter draws at random is drawn again: not shared by the children of one server.

    Python's and NumPy's generators, torch's CPU generator and ``multiprocessing``'s authentication key.
    (``hash()`` of a ``str`` is fixed for the life of an interpreter: it stays the server's, whatever
    ``PYTHONHASHSEED`` a child is given.)
    """
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].default_generator.seed()
    if "multiprocessing" in sys.modules:
        sys.modules["multiprocessing"].current_process().authkey = os.urandom(32)


def _redirect(fd: int, path: str | None) -> None:
    if path is None:
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _child(request: dict[str, Any], commands: int, events: int) -> None:
    """In the forked child: become ``python script.py args``; never returns (exits through ``sys.exit``)."""
    os.close(commands)
    main = threading.main_thread()
    if main.native_id != threading.get_native_id() and hasattr(main, "_set_native_id"):
        main._set_native_id()  # CPython 3.11 keeps the parent's after os.fork(): the watchdog reads this thread's CPU
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter has
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        if request.get("new_session"):
            os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        _redirect(1, request.get("stdout"))
        _redirect(2, request.get("stderr"))
        env = request.get("env")
        env = dict(os.environ) if env is None else {str(k): str(v) for k, v in env.items()}
        env.update({str(k): str(v) for k, v in (request.get("env_update") or {}).items()})
        env[MARK_VAR] = _mark  # what this child starts carries it: ended with the server (kill_marked)
        os.environ.clear()
        os.environ.update(env)
        if request.get("cwd"):
            os.chdir(request["cwd"])
        _streams(env)
        argv = [str(arg) for arg in request["argv"]]
        sys.argv = argv
        # as `python script.py` builds it: the script's folder first, then PYTHONPATH's entries
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path[1:]]
        sys.path[0:1] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
        sys.orig_argv = [sys.executable, *argv]
        _reseed()
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
        _send(events, {"running": os.getpid(), "id": request.get("id")})  # may come before the server's "started"
        os.close(events)
    except BaseException as error:  # the set-up failed: say so where the output goes, exit as a shell would
        print(f"lplugins fork server: cannot start {request.get('argv')!r}: {error!r}", file=sys.stderr, flush=True)
        os._exit(127)
    code = _run_main(argv)
    if code is _INTERRUPTED:  # as Python ends on an uncaught KeyboardInterrupt: exit handlers, then SIGINT
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(code)  # a normal interpreter exit: the script's atexit handlers run, buffers are flushed


_INTERRUPTED = object()


def _run_main(argv: list[str]) -> Any:
    """Run ``argv[0]`` as ``__main__``, as ``python script.py`` does; its exit code (or :data:`_INTERRUPTED`)."""
    path = os.path.abspath(argv[0])
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as err:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {err.errno}] {err.strerror}", file=sys.stderr)
        return 2
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__spec__ = None
    main.__dict__.update(__builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main  # for good: a thread or an exit handler still pickles by __main__ after the end
    try:
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as done:
        return done.code
    except BaseException as error:  # to sys.excepthook (the script's own, or lplugins' watchdog's) from its frames
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        sys.excepthook(type(error), error.with_traceback(tb), tb)  # tb None: a SyntaxError, as Python prints it
        return _INTERRUPTED if isinstance(error, KeyboardInterrupt) else 1
    return 0


def kill_marked(var: str, value: str) -> int:
    """SIGKILL every process of this user that started with ``var=value`` in its environment; how many.

    A process that left its session (``setsid``) and its parent still carries the environment it was started
    with: that is how the processes a job started are found when their process groups are not enough.
    """
    needle = f"{var}={value}".encode()
    killed = 0
    try:
        entries = os.listdir("/proc")
    except OSError:  # not Linux: process groups only
        return 0
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                found = needle in f.read().split(b"\0")
            if found:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
        except OSError:  # gone, or not ours
            continue
    return killed


def _signal_all(children: set[int], sig: int) -> None:
    """``sig`` to each child, and to its process group where it leads one (what it started, unless that left)."""
    for pid in children:
        for send in (os.killpg, os.kill):
            try:
                send(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def serve(commands: int, events: int, modules: Sequence[str], load: bool = False) -> None:
    """Warm up, then fork a process per request and report the children's exits, until ``commands`` closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the client's terminal: the client closes us
    took, hazards = warm(modules, load)
    if hazards:
        _send(events, {"refused": hazards, "pid": os.getpid()})
        sys.exit(3)
    _send(events, {"ready": round(took, 3), "pid": os.getpid()})
    children: set[int] = set()
    pending = b""
    closed_at: float | None = None
    while closed_at is None or children:
        readable = select.select([commands] if closed_at is None else [], [], [], 0.02)[0]
        if readable:
            chunk = os.read(commands, 65536)
            if not chunk:  # the client is gone: do not leave its processes behind
                closed_at = time.monotonic()
                _signal_all(children, signal.SIGTERM)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, commands, events)
                children.add(pid)
                _send(events, {"started": pid, "id": request.get("id")})
        if closed_at is not None and time.monotonic() - closed_at > GRACE_S:
            _signal_all(children, signal.SIGKILL)
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
    kill_marked(MARK_VAR, _mark)  # the client has gone: nothing its jobs started outlives the server


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lplugins._fork.server CMD_FD EVENT_FD [--load] MODULE...`` (started by the client)."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands, events = int(args[0]), int(args[1])
    load = "--load" in args[2:]
    serve(commands, events, [a for a in args[2:] if a != "--load"], load=load)


if __name__ == "__main__":
    main()
