"""docs/how-to/hydra.md, executed: its config files and train.py written out as shown, run with Hydra twice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra")

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "how-to" / "hydra.md"


def _files() -> dict[str, str]:
    """Every code block of the page that starts with ``# <path>``, by path."""
    blocks = re.findall(r"```(?:yaml|python)\n# (\S+)\n(.*?)```", PAGE.read_text(), flags=re.S)
    return {path: body for path, body in blocks}


def _run(project: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    return subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=project, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hydra_how_to_runs_and_resumes(tmp_path: Path) -> None:
    files = _files()
    assert set(files) == {
        "configs/trainer/default.yaml",
        "configs/callbacks/default.yaml",
        "train.py",
        "configs/train.yaml",
    }
    for rel, body in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(body)

    first = _run(tmp_path, "trainer.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "done: step 4" in first.stdout
    assert "precision='auto' chose '32-true'" in first.stderr + first.stdout
    assert sorted(p.name for p in (tmp_path / "ckpts").glob("*.ckpt")), "DurableCheckpoint wrote nothing"

    second = _run(tmp_path, "ckpt_path=latest")  # max_steps 6 from the config: two more steps
    assert second.returncode == 0, second.stderr[-3000:]
    assert "done: step 6" in second.stdout
    assert "resuming from" in second.stderr + second.stdout

    wrong = _run(tmp_path, "trainer.strategy=deepspeed_stage2_cpu")
    assert wrong.returncode != 0
    assert "Did you mean 'deepspeed_stage_2_cpu'" in wrong.stderr
