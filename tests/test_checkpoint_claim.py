"""Two jobs on one checkpoint directory: the second is refused at start (naming the first) unless it takes over;
a claim left by a killed job is taken over on its own. Real processes (a 2-rank gloo job for the refusal)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lplugins.callbacks import CheckpointClaimError, CheckpointConfigError, DurableCheckpoint
from lplugins.callbacks._claim import CLAIM, Claim, DirectoryClaim
from lplugins.callbacks._storages import open_storage
from tests._dist import ROOT, free_port, run_script, run_together

JOB = r"""
import json, os, sys, time
import lightning.pytorch as pl
from lplugins.callbacks import CheckpointClaimError, DurableCheckpoint
from tests.models import Regression, regression_loader

d, devices, max_steps, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
take_over = sys.argv[4] == "1"

class Report(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        print(json.dumps({"rank": trainer.global_rank, "start": trainer.global_step}), flush=True)
    def on_train_batch_end(self, trainer, *args):
        # step 1 is saved (this runs before DurableCheckpoint's step-2 save): say so, then wait for the test
        if hold != "-" and trainer.global_step == 2:
            open(hold + ".ready", "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(hold + ".go") and time.monotonic() < deadline:
                time.sleep(0.05)

trainer = pl.Trainer(
    accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=max_steps,
    callbacks=[DurableCheckpoint(d, every_n_steps=1, keep_last=None, take_over=take_over), Report()],
    logger=False, enable_progress_bar=False, enable_model_summary=False,
)
try:
    trainer.fit(Regression(), regression_loader(64, batch_size=4), ckpt_path="latest")
except CheckpointClaimError as err:
    print(json.dumps({"rank": trainer.global_rank, "refused": str(err), "step": trainer.global_step}), flush=True)
    sys.exit(3)
print(json.dumps({"rank": trainer.global_rank, "end": trainer.global_step}), flush=True)
"""


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """Run JOB in the background (its own session), single-process."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LOCAL_RANK", "NODE_RANK"))}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    return subprocess.Popen(
        [sys.executable, str(script), *args], cwd=tmp_path, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the first job ended early: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def records(out: str) -> list[dict[str, object]]:
    """The flat JSON records the ranks print (two ranks share one stdout: their lines may run together)."""
    return [json.loads(found) for found in re.findall(r"\{\"[^{}]*\}", out)]


def checkpoints(d: Path) -> set[str]:
    return {name for name in os.listdir(d) if name.endswith(".ckpt")}


def test_take_over_must_be_a_bool() -> None:
    with pytest.raises(CheckpointConfigError, match="take_over"):
        DurableCheckpoint("ckpts", take_over="yes")  # type: ignore[arg-type]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_second_job_is_refused_before_training_naming_the_first_and_takes_over_only_when_told(
    tmp_path: Path,
) -> None:
    d, hold = tmp_path / "ckpts", tmp_path / "a"
    first = start(tmp_path, str(d), "1", "4", "0", str(hold))
    try:
        wait_for(Path(str(hold) + ".ready"), first)
        claim = Claim.parse((d / CLAIM).read_bytes())
        assert (claim.host, claim.pid) == (socket.gethostname(), first.pid)
        before = checkpoints(d)
        # a 2-rank job on the same directory: refused on both ranks, before any step, nothing touched
        (tmp_path / "b").mkdir()
        second = run_together(JOB, tmp_path / "b", timeout=200, args=[str(d), "2", "4", "0", "-"])
        assert second.returncode == 3, second.stderr
        refusals = records(second.stdout)
        assert sorted(r["rank"] for r in refusals) == [0, 1] and all(r["step"] == 0 for r in refusals), refusals
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(claim.started))
        for r in refusals:
            text = str(r["refused"])
            assert f"is in use by another job (host {socket.gethostname()}, pid {first.pid}, started {started}" in text
            assert "take_over=True" in text
        assert checkpoints(d) == before and Claim.parse((d / CLAIM).read_bytes()).token == claim.token
        # told to take over: it does, resumes from the first job's newest checkpoint, and says so once
        (tmp_path / "c").mkdir()
        third = run_script(JOB, tmp_path / "c", timeout=200, args=[str(d), "1", "3", "1", "-"]).check()
        assert records(third.stdout)[0] == {"rank": 0, "start": 1}
        said = [line for line in third.stderr.splitlines() if "took over" in line]
        assert len(said) == 1 and f"pid {first.pid}" in said[0] and "take_over=True" in said[0], third.stderr
        assert not (d / CLAIM).exists()  # released at its clean end
    finally:
        Path(str(hold) + ".go").touch()
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert "took checkpoint directory" in err  # the first job learnt it lost the directory
    assert before <= checkpoints(d)  # nothing committed by either job was lost
    assert not (d / CLAIM).exists()  # the first job did not write its lost claim back


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_claim_of_a_killed_job_is_taken_over_automatically_and_said_once(tmp_path: Path) -> None:
    d, hold = tmp_path / "ckpts", tmp_path / "a"
    first = start(tmp_path, str(d), "1", "50", "0", str(hold))
    try:
        wait_for(Path(str(hold) + ".ready"), first)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert Claim.parse((d / CLAIM).read_bytes()).pid == first.pid  # left behind by the kill
    (tmp_path / "b").mkdir()
    second = run_together(JOB, tmp_path / "b", timeout=200, args=[str(d), "2", "4", "0", "-"]).check()
    starts = [r for r in records(second.stdout) if "start" in r]
    assert sorted((r["rank"], r["start"]) for r in starts) == [(0, 1), (1, 1)]  # nothing committed was lost
    said = [line for line in second.stderr.splitlines() if "took over" in line]
    assert len(said) == 1, second.stderr
    assert f"pid {first.pid}" in said[0] and f"process {first.pid} is not running on this host" in said[0]
    assert not (d / CLAIM).exists()


def test_claims_from_another_host_are_judged_by_their_heartbeat(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    storage.makedirs()

    def plant(heartbeat_age: float) -> Claim:
        other = Claim("elsewhere", 4242, time.time() - 100, "t" * 32, time.time() - heartbeat_age)
        (tmp_path / CLAIM).write_bytes(other.to_json())
        return other

    # a heartbeat older than the lease: stale at once
    plant(heartbeat_age=60)
    mine = DirectoryClaim(storage, take_over=False, lease=15, heartbeat=0.2)
    assert mine.acquire() is None
    assert Claim.parse((tmp_path / CLAIM).read_bytes()).token == mine.claim.token
    mine.release()
    assert not (tmp_path / CLAIM).exists()
    # a fresh heartbeat that never beats again: watched until the lease runs out, then taken over
    t0 = time.monotonic()  # before the planted heartbeat: the lease is counted from it
    plant(heartbeat_age=0)
    mine = DirectoryClaim(storage, take_over=False, lease=1.0, heartbeat=0.2)
    assert mine.acquire() is None
    assert 0.5 < time.monotonic() - t0 < 5
    mine.release()
    # a claim that keeps beating: live, refused, naming it
    other = DirectoryClaim(storage, take_over=False, lease=5.0, heartbeat=0.1)  # 50 beats per lease: live however
    other.claim.host = "elsewhere"  # loaded the machine
    assert other.acquire() is None
    try:
        refusal = DirectoryClaim(storage, take_over=False, lease=5.0, heartbeat=0.1).acquire()
        assert refusal is not None and "in use by another job (host elsewhere, pid" in refusal
        with pytest.raises(CheckpointClaimError):
            raise CheckpointClaimError(refusal)
    finally:
        other.release()


@pytest.mark.parametrize("taker_ended", [True, False])
def test_a_job_taken_over_between_two_heartbeats_says_so_once_at_its_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, taker_ended: bool
) -> None:
    storage = open_storage(str(tmp_path))
    storage.makedirs()
    first = DirectoryClaim(storage, take_over=False, heartbeat=3600)  # no heartbeat in this test
    assert first.acquire() is None
    taker = DirectoryClaim(storage, take_over=True, heartbeat=3600)
    assert taker.acquire() is None
    if taker_ended:
        taker.release()  # the claim file is gone again before the first job looks
    with caplog.at_level("WARNING", logger="lplugins"):
        first.release()
        first.release()
    said = [r.getMessage() for r in caplog.records if "took checkpoint directory" in r.getMessage()]
    assert len(said) == 1 and ("since ended" in said[0]) == taker_ended, said
    assert (tmp_path / CLAIM).exists() != taker_ended  # the taker's claim is not removed by the first job
    if not taker_ended:
        taker.release()
