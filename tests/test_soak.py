"""Clean runs end well on every rank: `benchmarks/soak_clean.py` at a small count (full figure: docs/benchmarks.md).

One run of each combination of strategy (DDP sync and async DurableCheckpoint, FSDP2, ZeRO-2) and ending
(``max_steps``, ``validate`` after ``fit``, ``EarlyStopping``, ``should_stop`` set on one rank only),
then the same again resuming with ``ckpt_path="latest"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import ROOT, run_script


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_clean_runs_exit_zero_on_every_rank_and_leave_nothing_behind(tmp_path: Path) -> None:
    script = (ROOT / "benchmarks" / "soak_clean.py").read_text()
    result = run_script(
        script, tmp_path, timeout=880, args=["--runs", "32", "--workdir", str(tmp_path / "w"), "--timeout", "150"]
    )
    tally = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stderr[-4000:]
    assert tally["runs_clean"] == tally["runs"] == 32 and tally["hangs"] == 0
    assert set(tally["runs_per_strategy"].values()) == {8} and set(tally["runs_per_ending"].values()) == {8}
