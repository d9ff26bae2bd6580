"""The main job: `lplugins demo`, shortened by flags, then resumed."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port


def _demo(out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lplugins", "demo", "--out", str(out), "--samples", "512", *flags]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, start_new_session=True)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_demo_runs_on_two_processes_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    ramp = '{"name": "ramp", "start": 64, "target": 128, "over": 256, "unit": "samples", "kind": "stepwise", '
    ramp += '"increment": 64}'
    first = _demo(out, "--epochs", "2", "--schedule", ramp)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = first.stdout
    assert summary.count("lplugins demo: done") == 1  # the summary is printed once, by rank 0
    assert "ddp_timeout -> DDPStrategy, 2 CPU process(es)" in summary
    assert "auto -> 32-true (CPU" in summary
    assert (out / "demo.png").stat().st_size > 1000
    rows = list(csv.DictReader((out / "logs" / "version_0" / "metrics.csv").open()))
    factors = [float(r["demo/accumulation_factor"]) for r in rows if r.get("demo/accumulation_factor")]
    assert factors[0] == 1.0 and max(factors) > 1.0  # the ramp ramped
    assert any(r.get("val/acc") for r in rows)
    steps_first = int(summary.split("steps:")[1].split()[0])

    resumed = _demo(out, "--epochs", "3", "--resume", "--schedule", ramp)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps_resumed = int(resumed.stdout.split("steps:")[1].split()[0])
    assert steps_resumed > steps_first
    assert (out / "logs" / "version_0" / "metrics.csv").exists()  # the first run's log is kept
    assert (out / "logs" / "version_1" / "metrics.csv").exists()


def test_demo_help_explains_the_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lplugins", "demo", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--devices", "--strategy", "--precision", "--schedule", "--out", "--resume"):
        assert flag in out
    assert "generated data" in out


def test_demo_resume_without_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    result = _demo(tmp_path / "empty", "--resume", "--devices", "1")
    assert result.returncode != 0
    assert "--resume given but no valid checkpoint" in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--devices", "0"), "lplugins: error: demo: --devices 0 is not allowed; it must be an int >= 1."),
        (("--epochs", "0"), "lplugins: error: demo: --epochs 0 is not allowed; it must be an int >= 1."),
        (("--max-steps", "0"), "lplugins: error: demo: --max-steps 0 is not allowed; it must be -1 (no limit)"),
        (("--strategy", "dpp"), "lplugins: error: Unknown strategy 'dpp'."),
        (("--schedule", "0"), "lplugins: error: accumulate_grad_batches=0 is not allowed"),
    ],
)
def test_bad_demo_flags_are_one_line_errors(tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    result = _demo(tmp_path / "out", *flags)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(message), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
