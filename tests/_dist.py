"""Helpers for tests that run real multi-process jobs (gloo on CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from lplugins._fork.ranks import free_port, json_objects

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> Result:
        assert self.returncode == 0, f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        return self

    def json_objects(self) -> list[dict[str, Any]]:
        """Every JSON object the ranks printed on stdout, in order (:func:`lplugins._fork.ranks.json_objects`)."""
        return json_objects(self.stdout)


#: How :func:`run_script` starts a job unless told: ``"launcher"`` (``python job.py``, as users run it: one
#: process, Lightning starts the others), ``"warm"`` (every rank forked from a warm server) or ``"together"``
#: (every rank a fresh interpreter at once). ``LPLUGINS_TEST_START`` sets it for a whole run.
DEFAULT_START = os.environ.get("LPLUGINS_TEST_START", "launcher")
#: How :func:`run_together` starts a job unless told (``LPLUGINS_TEST_START`` sets it for a whole run).
TOGETHER_START = os.environ.get("LPLUGINS_TEST_START", "warm")
STARTS = ("warm", "together", "launcher")


#: With ``start="together"``, how long the other ranks may run on after rank 0 has ended.
OTHERS_GRACE_S = 20.0


def run_script(
    source: str,
    tmp_path: Path,
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    name: str = "job.py",
    ranks: int = 2,
    start: str | None = None,
) -> Result:
    """Write ``source`` to ``tmp_path/name`` and run it with this interpreter, in ``tmp_path``.

    ``start="warm"`` (the default) starts ``ranks`` processes as ``"together"`` does, but each is forked from
    a server that has already imported torch, Lightning and lplugins (:mod:`lplugins._fork.ranks`): about
    8 CPU-seconds less per rank; everything else (processes, gloo, files, signals, exits) is real.
    ``start="launcher"`` runs one process, and Lightning's launcher starts the other ranks when the script
    reaches ``fit`` (``python train.py`` with ``devices=2``, as users run it). ``start="together"`` starts all
    ``ranks`` processes at once, each with ``LOCAL_RANK``/``NODE_RANK`` set, as torchrun or a cluster would:
    Lightning then starts none, and the ranks import torch and Lightning side by side instead of one after
    the other (about 5 s less per job on 2 cores). Every Trainer in such a script must use ``ranks`` devices.
    Default: ``launcher`` (``LPLUGINS_TEST_START`` sets it for a whole run); :func:`run_together` starts
    ``warm``.

    Each process runs in its own session; on timeout every process group (Lightning's launcher children
    included) is killed and the test fails. ``MASTER_ADDR``/``MASTER_PORT`` are set to a free localhost
    port unless ``env`` gives them. The result has rank 0's exit code (another rank's, when rank 0's is 0),
    and every rank's output, rank 0's first.
    """
    start = start or DEFAULT_START
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LOCAL_RANK", "NODE_RANK"))}
    full_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"})
    full_env.setdefault("OMP_NUM_THREADS", "1")
    # the scripts import the shared test models (tests/models.py) as ``tests.models``
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    if env:
        full_env.update(env)
    if start == "warm":
        from lplugins._fork.ranks import run_ranks

        ranked = run_ranks(
            script,
            ranks=ranks,
            args=args or [],
            cwd=tmp_path,
            env=full_env,
            timeout=timeout,
            others_grace=OTHERS_GRACE_S,
        )
        return Result(ranked.returncode, ranked.stdout, ranked.stderr)
    envs = [full_env]
    if start == "together":
        envs = [{**full_env, "LOCAL_RANK": str(r), "NODE_RANK": "0"} for r in range(ranks)]
    # files, not pipes: a rank blocked on a full pipe nobody reads yet would hold up the others
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in envs]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *(args or [])],
            cwd=tmp_path,
            env=e,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        for e, (out, err) in zip(envs, files, strict=True)
    ]
    try:
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                if i == 0:  # as under the launcher, rank 0's end ends the job: the others get a little longer
                    deadline = min(deadline, time.monotonic() + OTHERS_GRACE_S)
            except subprocess.TimeoutExpired:
                if i > 0:
                    break
                for other in procs:
                    _kill_group(other)
                    other.wait()
                out, err = _read(files)
                raise AssertionError(
                    f"{name} did not finish within {timeout}s (killed)\n--- stdout\n{out}\n--- stderr\n{err}"
                ) from None
        codes = [proc.poll() for proc in procs]  # None: still running after rank 0's end and the grace
    finally:
        for proc in procs:
            _kill_group(proc)  # reap any launcher child that outlived its parent
            proc.wait()
    out, err = _read(files)
    return Result(codes[0] or next((c for c in codes if c), 0) or 0, out, err)


def run_together(source: str, tmp_path: Path, **kwargs: Any) -> Result:
    """:func:`run_script` with every rank started at once (warm unless ``LPLUGINS_TEST_START`` says otherwise)."""
    return run_script(source, tmp_path, start=kwargs.pop("start", TOGETHER_START), **kwargs)


def run_launched(
    source: str, tmp_path: Path, *, deadline: float, env: dict[str, str] | None = None, args: list[str] | None = None
) -> dict[str, Any]:
    """Two ranks as torchrun starts them (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``), forked warm, each given until
    ``deadline`` seconds and killed then: what ``tests/test_watchdog.py``'s ``LAUNCH`` prefix did with two fresh
    interpreters. Writes ``rank<r>.log`` (each rank's output) and returns ``{"codes": [...], "seconds": s}``
    (``None``: killed at the deadline), also written to ``launch.json``.
    """
    from lplugins._fork.ranks import run_ranks

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(source))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LOCAL_RANK", "NODE_RANK"))}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    began = time.monotonic()
    ranked = run_ranks(
        script,
        args=args or (),
        cwd=tmp_path,
        env=full_env,
        timeout=deadline,
        others_grace=deadline,
        world_vars=True,
        kill_at_timeout=True,
    )
    launch = {"codes": ranked.returncodes, "seconds": time.monotonic() - began}
    for r, (out, err) in enumerate(ranked.outputs):
        (tmp_path / f"rank{r}.log").write_text(out + err)
    (tmp_path / "launch.json").write_text(json.dumps(launch))
    return launch


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(files: list[tuple[Any, Any]]) -> tuple[str, str]:
    """Every process's stdout and stderr, rank 0's first (the files are closed)."""
    texts = []
    for out, err in files:
        for f in (out, err):
            f.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    return "".join(o for o, _ in texts), "".join(e for _, e in texts)


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as a module (e.g. ``mirror_pl``, the twins' generator)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
