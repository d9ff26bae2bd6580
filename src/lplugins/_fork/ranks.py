"""Run a script as N ranks forked from a warm fork server, as torchrun would start them: the test launcher.

Every rank is a real process with ``LOCAL_RANK``/``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set, so
Lightning starts no process of its own and the ranks meet over gloo on a free localhost port; only the
imports are skipped. Each rank leads its own session, so a timeout kills it with everything it started
(DataLoader workers, a launcher's children). One server is kept per set of warm modules for the life of
this process (closed at exit): :data:`LIGHTNING_MODULES` for ``lightning.pytorch`` scripts,
:data:`PYTORCH_LIGHTNING_MODULES` for ``pytorch_lightning`` ones, since which namespace is imported is
what lplugins reads when a script does not say.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lplugins._fork.client import Forked, ForkServer
from lplugins._fork.server import kill_marked

#: What a ``lightning.pytorch`` script's ranks find imported.
LIGHTNING_MODULES = (
    "torch",
    "torch.distributed",
    "torch.utils.data",
    "torchmetrics",
    "lightning.pytorch",
    "lplugins",
    "lplugins.callbacks",
    "lplugins.strategies",
)
#: What a ``pytorch_lightning`` script's ranks find imported.
PYTORCH_LIGHTNING_MODULES = (
    "torch",
    "torch.distributed",
    "torch.utils.data",
    "torchmetrics",
    "pytorch_lightning",
    "lplugins",
)
#: The variable each rank of a job is started with (the job's mark): what the ranks start is found by it.
JOB_VAR = "LPLUGINS_FORK_JOB"
#: Seconds for a server to import everything before it is given up on.
READY_TIMEOUT_S = 180.0

_servers: dict[tuple[str, ...], ForkServer] = {}


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def modules_for(source: str) -> tuple[str, ...]:
    """The warm modules for a script: :data:`PYTORCH_LIGHTNING_MODULES` when it imports only that namespace."""
    pl = re.search(r"^\s*(from|import)\s+pytorch_lightning\b", source, re.M)
    lightning = re.search(r"^\s*(from\s+lightning(\.pytorch)?\s+import|import\s+lightning)\b", source, re.M)
    return PYTORCH_LIGHTNING_MODULES if pl and not lightning else LIGHTNING_MODULES


def server(modules: Sequence[str] = LIGHTNING_MODULES) -> ForkServer:
    """This process's warm server for ``modules`` (started on first use, closed at exit).

    Raises:
        ForkServerError: It could not be started (its output is in the message).
    """
    key = tuple(modules)
    found = _servers.get(key)
    if found is not None and found.alive():
        return found
    started = ForkServer(key, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    started.wait_ready(READY_TIMEOUT_S)
    if not _servers:
        atexit.register(close_all)
    _servers[key] = started
    return started


def close_all() -> None:
    """Close every warm server of this process (what each still runs is ended)."""
    while _servers:
        _servers.popitem()[1].close()


@dataclass
class Ranks:
    """What the ranks of one job did: an exit code each (``None``: still running when it was stopped)."""

    returncodes: list[int | None]
    outputs: list[tuple[str, str]]  # (stdout, stderr), by rank

    @property
    def returncode(self) -> int:
        """Rank 0's exit code, or else the first other non-zero one (``0``: every rank succeeded).

        A rank still running when the job was stopped (``None``: killed after rank 0's end and the grace)
        counts as killed: ``-9``.
        """
        codes = [-signal.SIGKILL if c is None else c for c in self.returncodes]
        return codes[0] or next((c for c in codes if c), 0) or 0

    @property
    def stdout(self) -> str:
        return "".join(out for out, _ in self.outputs)

    @property
    def stderr(self) -> str:
        return "".join(err for _, err in self.outputs)

    def check(self) -> Ranks:
        """``self``, or an :class:`AssertionError` with every rank's output when a rank failed or never ended."""
        hung = [r for r, c in enumerate(self.returncodes) if c is None]
        why = f" (rank {hung[0]} was still running after rank 0 had ended: killed)" if hung else ""
        assert self.returncode == 0, (
            f"exit {self.returncode}{why}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        )
        return self

    def json_objects(self) -> list[dict[str, Any]]:
        """Every JSON object the ranks printed on stdout, in rank order."""
        return json_objects(self.stdout)


def json_objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object in ``text``, in order, each decoded where it starts (ranks that share one output
    may put two objects on one line, ``{...}{...}``, before either newline)."""
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    at = text.find("{")
    while at != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            at = text.find("{", at + 1)
            continue
        if isinstance(value, dict):
            found.append(value)
        at = text.find("{", end)
    return found


def _kill(procs: Sequence[Forked]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): not waited on for ever
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a group member that outlived its leader
        except (ProcessLookupError, PermissionError):
            pass


def run_ranks(
    script: str | os.PathLike[str],
    *,
    ranks: int = 2,
    args: Sequence[str] = (),
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    others_grace: float = 20.0,
    start_timeout: float = 60.0,
    modules: Sequence[str] | None = None,
    world_vars: bool = False,
    kill_at_timeout: bool = False,
) -> Ranks:
    """Run ``python script *args`` as ``ranks`` processes forked from a warm server; wait for them.

    Args:
        script: The script's path.
        ranks: How many ranks (each gets ``LOCAL_RANK``; ``NODE_RANK`` is 0).
        args: The script's arguments.
        cwd: The ranks' working directory (default: the script's folder).
        env: Their environment (default: this process's); ``MASTER_ADDR``/``MASTER_PORT`` (a free port)
            and ``PYTHONUNBUFFERED`` are added unless given.
        timeout: Seconds for rank 0 to end; then every rank is killed and :class:`AssertionError` raised
            with their output.
        others_grace: Seconds the other ranks may run on after rank 0 has ended, as under a launcher
            (then they are killed, and their code is ``None``).
        start_timeout: Seconds for a rank to reach the script's first line.
        modules: The warm modules (default: by the script's imports, :func:`modules_for`).
        world_vars: Also set ``RANK`` and ``WORLD_SIZE``, as torchrun does.
        kill_at_timeout: At ``timeout``, kill every rank and return (a rank killed has the code ``None``)
            instead of raising: for a test whose job is expected to hang.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks={ranks!r} must be an int >= 1")
    path = Path(script).resolve()
    base = {**(os.environ if env is None else env)}
    base.setdefault("MASTER_ADDR", "127.0.0.1")
    base.setdefault("MASTER_PORT", str(free_port()))
    base.setdefault("PYTHONUNBUFFERED", "1")
    job = base[JOB_VAR] = f"{os.getpid()}-{time.monotonic_ns()}"  # what the ranks start carries it: ended with them
    warm = server(modules if modules is not None else modules_for(path.read_text(errors="replace")))
    with tempfile.TemporaryDirectory(prefix="lplugins-ranks-") as logs:
        files = [(Path(logs, f"{r}.out"), Path(logs, f"{r}.err")) for r in range(ranks)]
        procs: list[Forked] = []
        try:
            for rank, (out, err) in enumerate(files):
                rank_env = {**base, "LOCAL_RANK": str(rank), "NODE_RANK": "0"}
                if world_vars:
                    rank_env.update(RANK=str(rank), WORLD_SIZE=str(ranks))
                argv = [str(path), *map(str, args)]
                procs.append(
                    warm.fork(
                        argv,
                        env=rank_env,
                        cwd=cwd or path.parent,
                        stdout=out,
                        stderr=err,
                        new_session=True,
                        timeout=start_timeout,
                    )
                )
            codes = _wait(procs, files, path.name, timeout, others_grace, kill_at_timeout)
        finally:
            _kill(procs)
            kill_marked(JOB_VAR, job)  # a process a rank started that left its session
        outputs = [(_read(out), _read(err)) for out, err in files]
    return Ranks(codes, outputs)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _wait(
    procs: Sequence[Forked],
    files: Sequence[tuple[Path, Path]],
    name: str,
    timeout: float,
    others_grace: float,
    kill_at_timeout: bool,
) -> list[int | None]:
    deadline = time.monotonic() + timeout
    for i, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if i == 0:  # as under a launcher, rank 0's end ends the job: the others get a little longer
                deadline = min(deadline, time.monotonic() + others_grace)
        except subprocess.TimeoutExpired:
            if i > 0 or kill_at_timeout:
                break
            _kill(procs)
            out = "".join(_read(o) for o, _ in files)
            err = "".join(_read(e) for _, e in files)
            raise AssertionError(
                f"{name} did not finish within {timeout}s (killed)\n--- stdout\n{out}\n--- stderr\n{err}"
            ) from None
    return [proc.poll() for proc in procs]
