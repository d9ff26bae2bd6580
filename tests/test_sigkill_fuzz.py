"""SIGKILLs across strategies and moments: ``benchmarks/sigkill_fuzz.py`` at a small count (full figure:
docs/benchmarks.md). One kill of each strategy (DDP sync and async, FSDP2, ZeRO-2) at each moment (training,
mid-save, resume, a retention delete, one rank in the failure agreement), each followed by a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import ROOT, run_script


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_every_kill_resumes_at_the_newest_committed_step_with_nothing_partial_and_no_hang(tmp_path: Path) -> None:
    script = (ROOT / "benchmarks" / "sigkill_fuzz.py").read_text()
    result = run_script(
        script, tmp_path, timeout=880, args=["--kills", "20", "--workdir", str(tmp_path / "w"), "--hang-after", "150"]
    )
    tally = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stderr[-4000:]
    assert tally["kills"] == 20 and set(tally["kills_per_strategy"].values()) == {5}
    assert tally["resume_failures"] == 0 and tally["partial_visible"] == 0 and tally["hangs"] == 0
    assert tally["resumes_at_newest"] == tally["resumes_checked"] >= 10
    assert tally["median_steps_lost"] <= 1
    assert tally["final_runs_ok"] == tally["final_runs"] == 4
    for moment in ("mid_save", "retention_delete", "agreement"):
        assert tally["kills_per_moment"][moment]["landed"] >= 1, tally["kills_per_moment"]
    assert tally["survivor_exits"] == tally["kills_per_moment"]["agreement"]["kills"]
