"""The warm launcher (lplugins._fork, the ``lplugins_launch`` fixture): real processes forked from a server that has
imported torch, Lightning and lplugins, with real exits, signals, output and gloo; and its refusals."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lplugins._fork.client import ForkServer, ForkServerError
from lplugins._fork.ranks import LIGHTNING_MODULES, PYTORCH_LIGHTNING_MODULES, modules_for, run_ranks

pytestmark = pytest.mark.distributed

DDP_JOB = """
import json, os, random, sys
warm = "lightning.pytorch" in sys.modules  # before this script imported anything
import torch
import lightning.pytorch as pl
from tests.models import Regression, regression_loader

trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Regression()
trainer.fit(model, regression_loader(32, batch_size=4))
total = trainer.strategy.reduce(torch.tensor(float(trainer.global_rank + 1)), reduce_op="sum")
weights = float(sum(p.sum() for p in model.parameters()))
print(json.dumps({"rank": trainer.global_rank, "warm": warm, "sum": total.item(), "weights": weights,
                  "random": random.random(), "argv": sys.argv[1:], "cwd": os.getcwd(),
                  "local_rank": os.environ["LOCAL_RANK"], "mine": os.environ.get("MINE")}), flush=True)
"""


@pytest.mark.timeout(180)
def test_two_warm_ranks_train_ddp_over_gloo_with_their_own_env_and_randomness(
    lplugins_launch: Any, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "MINE": "yes"}
    first = lplugins_launch(DDP_JOB, args=["--flag", "x y"], env=env).check()
    again = lplugins_launch(DDP_JOB, env=env).check()
    records = sorted(first.json_objects(), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1]
    assert [r["local_rank"] for r in records] == ["0", "1"]
    assert all(r["warm"] for r in records)  # forked from the server: Lightning was already imported
    assert all(r["sum"] == 3.0 for r in records)  # a real all-reduce between the two processes
    assert records[0]["weights"] == records[1]["weights"]  # DDP kept the replicas equal
    assert all(r["argv"] == ["--flag", "x y"] and r["cwd"] == str(tmp_path) and r["mine"] == "yes" for r in records)
    # Python's generator is reseeded in each process: not shared by the ranks, nor by two jobs
    draws = [r["random"] for r in records] + [r["random"] for r in again.json_objects()]
    assert len(set(draws)) == 4


EXITS = """
import os, signal, sys
how = sys.argv[1]
print("started", how, flush=True)
if how == "code":
    sys.exit(7)
if how == "signal":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "raise":
    raise RuntimeError("boom from the script")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "code"), [("code", 7), ("signal", -signal.SIGKILL), ("raise", 1), ("none", 0)])
def test_exit_codes_signals_and_tracebacks_are_those_of_python_script_py(
    lplugins_launch: Any, how: str, code: int
) -> None:
    ranks = lplugins_launch(EXITS, ranks=1, args=[how])
    assert ranks.returncodes == [code]
    assert ranks.stdout == f"started {how}\n"
    if how == "raise":
        # the traceback starts at the script, as a fresh interpreter's would: no frame of the fork server
        assert "RuntimeError: boom from the script" in ranks.stderr
        assert 'job.py", line 10, in <module>' in ranks.stderr
        assert "_fork" not in ranks.stderr and "runpy" not in ranks.stderr
    else:
        assert ranks.stderr == ""


@pytest.mark.timeout(120)
def test_a_job_past_its_timeout_is_killed_with_everything_it_started_and_its_output_reported(
    lplugins_launch: Any, tmp_path: Path
) -> None:
    hang = """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open("pids", "w").write(f"{child.pid}")
    print("hanging now", flush=True)
    time.sleep(600)
    """
    began = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)did not finish within 3s \(killed\).*hanging now"):
        lplugins_launch(hang, ranks=2, timeout=3)
    assert time.monotonic() - began < 30
    grandchild = int((tmp_path / "pids").read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "a process the rank started outlived the job"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_scripts_get_the_server_of_the_namespace_they_import() -> None:
    assert modules_for("import lightning.pytorch as pl\n") == LIGHTNING_MODULES
    assert modules_for("from lightning.pytorch import Trainer\n") == LIGHTNING_MODULES
    assert modules_for("import pytorch_lightning as pl\n") == PYTORCH_LIGHTNING_MODULES
    assert modules_for("from pytorch_lightning import Trainer\nimport lightning.pytorch\n") == LIGHTNING_MODULES
    assert "lightning.pytorch" not in PYTORCH_LIGHTNING_MODULES


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (
            "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), name='leaky-poller', daemon=True)"
            ".start()\n",
            r"refused to fork: Python threads are running: leaky-poller",
        ),
        (
            "import datetime, torch.distributed as dist\n"
            "dist.init_process_group('gloo', init_method='file://' + __file__ + '.store', rank=0, world_size=1,"
            " timeout=datetime.timedelta(seconds=30))\n",
            r"refused to fork: .*a torch.distributed process group is initialised",
        ),
    ],
    ids=["thread", "process-group"],
)
def test_a_server_with_a_thread_or_a_process_group_is_refused_with_the_reason(
    tmp_path: Path, source: str, reason: str
) -> None:
    (tmp_path / "hazard.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    server = ForkServer(("torch", "hazard"), env=env)
    with pytest.raises(ForkServerError, match=reason):
        server.wait_ready(120)
    assert server.process.poll() is not None  # it exits: nothing is left to fork from


@pytest.mark.timeout(120)
def test_a_child_that_does_not_reach_its_script_is_reported_never_waited_on(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    server = ForkServer(("json",))
    try:
        server.wait_ready(60)
        # its set-up fails (no such folder): reported with what it printed, at once
        with pytest.raises(ForkServerError, match=r"(?s)exited before it ran.*cannot start.*No such file"):
            server.fork([str(script)], cwd=tmp_path / "missing", stderr=tmp_path / "err", timeout=30)
        # the server is stopped: no child can start; the request times out instead of waiting for ever
        os.kill(server.process.pid, signal.SIGSTOP)
        began = time.monotonic()
        try:
            with pytest.raises(ForkServerError, match=r"did not start within 1s"):
                server.fork([str(script)], timeout=1)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert time.monotonic() - began < 10
        forked = server.fork([str(script)], stdout=tmp_path / "out", timeout=30)
        assert forked.wait(30) == 0
        assert "ran\n" in (tmp_path / "out").read_text()
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_run_ranks_refuses_a_bad_rank_count(tmp_path: Path) -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=rf"ranks={bad!r} must be an int >= 1"):
            run_ranks(tmp_path / "job.py", ranks=bad)  # type: ignore[arg-type]
