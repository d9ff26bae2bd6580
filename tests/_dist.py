"""Helpers for tests that run real multi-process jobs (gloo on CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> Result:
        assert self.returncode == 0, f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        return self

    def json_objects(self) -> list[dict[str, Any]]:
        """Every JSON object the ranks printed on stdout, in order.

        Ranks share one stdout pipe and write unbuffered, so one rank's object can land on the same
        line as another's (``{...}{...}``) before either newline; each object is decoded where it
        starts, whatever precedes or follows it on the line.
        """
        decoder = json.JSONDecoder()
        found: list[dict[str, Any]] = []
        at = self.stdout.find("{")
        while at != -1:
            try:
                value, end = decoder.raw_decode(self.stdout, at)
            except json.JSONDecodeError:
                at = self.stdout.find("{", at + 1)
                continue
            if isinstance(value, dict):
                found.append(value)
            at = self.stdout.find("{", end)
        return found


def run_script(
    source: str,
    tmp_path: Path,
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    name: str = "job.py",
) -> Result:
    """Write ``source`` to ``tmp_path/name`` and run it with this interpreter, in ``tmp_path``.

    The script runs in its own session; on timeout the whole process group (Lightning's launcher
    children included) is killed and the test fails. ``MASTER_ADDR``/``MASTER_PORT`` are set to a
    free localhost port unless ``env`` gives them.
    """
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LOCAL_RANK", "NODE_RANK"))}
    full_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"})
    full_env.setdefault("OMP_NUM_THREADS", "1")
    # the scripts import the shared test models (tests/models.py) as ``tests.models``
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    if env:
        full_env.update(env)
    proc = subprocess.Popen(
        [sys.executable, str(script), *(args or [])],
        cwd=tmp_path,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{name} did not finish within {timeout}s (killed)\n--- stdout\n{out}\n--- stderr\n{err}"
        ) from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # reap any launcher child that outlived its parent
        except ProcessLookupError:
            pass
    return Result(proc.returncode, out, err)


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as a module (e.g. ``mirror_pl``, the twins' generator)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
