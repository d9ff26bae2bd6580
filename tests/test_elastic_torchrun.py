"""Restarts under torchrun: a killed worker or a lost node, and the job goes on by itself to the same final step.

Real ``torchrun`` (TorchElastic, c10d rendezvous on 127.0.0.1, gloo, torchrun's default environment:
the rendezvous TCPStore shared across rounds) runs a plain script: a stock Trainer from
``lplugins.compose(strategy="ddp_timeout")``, a ``durable_checkpoint`` and ``fit(ckpt_path="latest")``.
Without lplugins' per-attempt store a restarted rank reads its dead peer's old address from that
store; the script makes rank 0 of a restarted attempt start late (as a slow node does), so such a
rank reads it every time (Gloo ``connectFullMesh failed ... Connection refused``) and the restarts
run out.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from lplugins._coord import elastic
from lplugins.strategies import _elastic
from tests._dist import ROOT, free_port

TRAIN = r"""
import faulthandler, json, os, signal, time
faulthandler.register(signal.SIGUSR2, all_threads=True)  # the tests ask a stalled worker where it is
if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
    time.sleep(float(os.environ.get("SLOW_RANK0", "0")))  # a slow node: its peers start first
import lightning.pytorch as pl
import lplugins
from tests.models import Regression, regression_loader

local = int(os.environ["LOCAL_WORLD_SIZE"])
nodes = int(os.environ["WORLD_SIZE"]) // local

if os.environ.get("DIE_IN_SAVE") == os.environ["RANK"] and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    # this rank dies inside the write of its DIE_IN_SAVE_AT-th save (the others wait in the save's agreement)
    import signal
    from lplugins.callbacks import _writer

    write_file, saves = _writer.CheckpointWriter.write_file, []

    def dying_write(self, record, checkpoint):
        saves.append(record.name)
        if len(saves) == int(os.environ.get("DIE_IN_SAVE_AT", "2")):
            if os.environ.get("SLOW_IN_SAVE"):  # alive, only slow: the test stops the whole job meanwhile
                open("in_save", "w").close()
                from lplugins.callbacks import DurableCheckpoint
                cb = next(c for c in trainer.callbacks if isinstance(c, DurableCheckpoint))
                deadline = time.monotonic() + float(os.environ["SLOW_IN_SAVE"])  # a cap: the write waits for
                while cb._signals.received is None and time.monotonic() < deadline:  # the signal, however late
                    time.sleep(0.05)
                return write_file(self, record, checkpoint)
            time.sleep(1.0)  # the other ranks reach the agreement
            with open("died_at", "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return write_file(self, record, checkpoint)

    _writer.CheckpointWriter.write_file = dying_write


class StepLog(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.is_global_zero:
            with open("steps.jsonl", "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "world": trainer.world_size,
                                    "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}) + "\n")
        # SLOW_WHEN_ALONE: a lone node trains slowly, so a node that joins finds the job still running
        alone = trainer.world_size == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0"
        time.sleep(float(os.environ.get("SLOW_WHEN_ALONE", "0.05")) if alone else 0.05)


kwargs = lplugins.compose(
    strategy=os.environ.get("STRATEGY", "ddp_timeout"), accelerator="cpu", devices=local, num_nodes=nodes,
    max_steps=int(os.environ["STEPS"]),
    callbacks=[{"name": "durable_checkpoint", "dirpath": "ck", "every_n_steps": 5}],
    logger=False, enable_progress_bar=False, enable_model_summary=False,
)
kwargs["callbacks"].append(StepLog())
trainer = pl.Trainer(**kwargs)
trainer.fit(Regression(hidden=(16,), seed=0), regression_loader(n=4096, batch_size=8), ckpt_path="latest")
if trainer.is_global_zero:
    print("FINAL_STEP", trainer.global_step, flush=True)
"""

STEPS = 60
#: torch's switch for a fresh store per rendezvous round; the tests run without it, as users do
_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "TORCHELASTIC_", "LOCAL_", "GROUP_", "ROLE_"))
        and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", _NO_SHARED_STORE)
    }
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "STEPS": str(STEPS), **extra})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def _torchrun(tmp_path: Path, args: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
    (tmp_path / "train.py").write_text(TRAIN)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *args,
            "--max-restarts=3",
            "--monitor-interval=0.5",
            "train.py",
        ],
        cwd=tmp_path,
        env=env,
        stdout=open(tmp_path / log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts each worker in a session of its own)."""
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            kids += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _descendants(k)]


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v[5:]) for v in env if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for torchrun to reap it has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_all(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def _stalled(tmp_path: Path, proc: subprocess.Popen[bytes], log: str, what: str) -> str:
    """``what``, the stacks of ``proc``'s live workers (asked with SIGUSR2) and the end of its log."""
    for pid in _descendants(proc.pid):
        if _rank_of(pid) is not None:
            try:
                os.kill(pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
    time.sleep(2)
    return f"{what}\n{(tmp_path / log).read_text(errors='replace')[-8000:]}"


def _committed(ck: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in ck.glob("*.commit") if (m := re.search(r"step=(\d+)", p.name)))


def _wait_for_commit(tmp_path: Path, procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
    while not _committed(tmp_path / "ck"):
        assert all(p.poll() is None for p in procs), "the job ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint was committed in time"
        time.sleep(0.05)


def _steps(tmp_path: Path) -> list[dict[str, int]]:
    return [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]


def _resumed_from(log: str) -> int:
    match = re.search(r"ckpt_path='latest': resuming from \S*step=(\d+)", log)
    assert match, log[-3000:]
    return int(match.group(1))


# ------------------------------------------------------------------------------------------ unit level
def _attempt(port: int, world: int, label: str, order: list[int]) -> list[str]:
    """Every rank of one attempt runs the handshake in a thread with a store client of its own, started in ``order``."""
    from torch.distributed import TCPStore

    tokens: dict[int, str] = {}

    def rank(r: int) -> None:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        tokens[r] = _elastic.attempt_token(store, r, world, "job", timedelta(seconds=20), label=label)

    threads = []
    for r in order:
        threads.append(threading.Thread(target=rank, args=(r,)))
        threads[-1].start()
        time.sleep(0.05)  # the later ones find the earlier ones' keys (and the previous attempt's) in place
    for t in threads:
        t.join(timeout=30)
    return [tokens[r] for r in range(world)]


def test_each_attempt_gets_a_store_prefix_of_its_own() -> None:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    first = _attempt(server.port, 3, "r0", order=[0, 1, 2])
    # the restarted attempt: ranks 1 and 2 start before rank 0, while the first attempt's keys are all there
    second = _attempt(server.port, 3, "r1", order=[2, 1, 0])
    # the same restart count again (a restart for a node joining does not count): still a prefix of its own
    third = _attempt(server.port, 2, "r1", order=[1, 0])
    for tokens in (first, second, third):
        assert len(set(tokens)) == 1, tokens  # every rank of an attempt agrees
    assert first[0].startswith("r0.") and second[0].startswith("r1.") and third[0].startswith("r1.")
    prefixes = {_elastic.attempt_prefix("job", t[0]) for t in (first, second, third)}
    assert len(prefixes) == 3, prefixes


def test_failure_board_keys_are_per_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic, "_attempt", None)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert elastic.store_prefix() == "lplugins/"
    # a stock strategy's group under torchelastic: the board keys carry the run and the restart
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert elastic.store_prefix() == "lplugins/job/r2/"
    # a group lplugins made: the whole store is the attempt's already
    elastic.set_attempt("r2.abc")
    assert elastic.store_prefix() == "lplugins/"


def test_sigterm_is_a_stop_only_under_torchelastic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside torchrun SIGTERM stays a preemption signal only (a save at the next step, as on SLURM)."""
    from lplugins.callbacks._preemption import PreemptionSignals

    monkeypatch.setattr(elastic, "_stop", None)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    signals = PreemptionSignals(["SIGTERM", "SIGUSR1"])
    signals._on_signal(signal.SIGTERM, None)
    assert signals.received == signal.SIGTERM and elastic._stop is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    signals._on_signal(signal.SIGUSR1, None)  # not torchrun's stop signal
    assert elastic._stop is None
    signals._on_signal(signal.SIGTERM, None)
    assert elastic._stop is not None and elastic._stop[0] == signal.SIGTERM
    signals.install()  # a new fit forgets it
    try:
        assert elastic._stop is None
    finally:
        signals.restore()


# ------------------------------------------------------------------------------------------ real torchrun
@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_killed_worker_is_restarted_and_the_job_completes(tmp_path: Path) -> None:
    port = free_port()
    args = ["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    job = _torchrun(tmp_path, args, _env(SLOW_RANK0="3"), "out.log")
    try:
        _wait_for_commit(tmp_path, [job], time.monotonic() + 90)
        workers = [pid for pid in _descendants(job.pid) if _rank_of(pid) == 1]
        assert workers, "rank 1 not found"
        os.kill(workers[0], signal.SIGKILL)
        committed_at_kill = max(_committed(tmp_path / "ck"))
        job.wait(timeout=120)
    finally:
        _kill_all(job)
    log = (tmp_path / "out.log").read_text(errors="replace")
    assert job.returncode == 0, log[-5000:]
    assert f"FINAL_STEP {STEPS}" in log
    resumed = _resumed_from(log)
    assert resumed >= committed_at_kill
    after = [s for s in _steps(tmp_path) if s["restart"] == 1]
    assert after and after[0]["step"] == resumed + 1 and after[-1]["step"] == STEPS
    assert "connectFullMesh failed" not in log


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_survivor_of_a_death_during_a_save_exits_at_torchruns_sigterm(tmp_path: Path) -> None:
    """Rank 0 dies while it writes a checkpoint; rank 1 waits in the save's agreement for it.

    torchrun SIGTERMs the survivor to restart the group. lplugins' preemption handler alone only
    notes the signal (a SLURM-style save at the next step), so the survivor would wait for its dead
    peer until torchrun's SIGKILL, 30 s later; under torchelastic it ends at once (its peer neither
    answered nor got the signal), and the restart resumes from the last commit, uncommitted save unseen.
    """
    port = free_port()
    args = ["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    job = _torchrun(tmp_path, args, _env(DIE_IN_SAVE="0", DIE_IN_SAVE_AT="2"), "out.log")
    try:
        deadline = time.monotonic() + 120
        survivor = None
        while not (tmp_path / "died_at").exists() or not (tmp_path / "died_at").read_text():
            assert job.poll() is None and time.monotonic() < deadline, "rank 0 did not reach its second save"
            survivor = survivor or next((p for p in _descendants(job.pid) if _rank_of(p) == 1), None)
            time.sleep(0.05)
        committed_at_kill = _committed(tmp_path / "ck")
        assert survivor is not None, "rank 1's process was never seen"
        while _alive(survivor):  # only the survivor's end is timed: a restart's imports are not what is tested
            assert time.monotonic() < deadline, "the survivor never ended"
            time.sleep(0.05)
        death_to_end = time.time() - float((tmp_path / "died_at").read_text())
        job.wait(timeout=120)
    finally:
        _kill_all(job)
    log = (tmp_path / "out.log").read_text(errors="replace")
    assert job.returncode == 0, log[-5000:]
    assert f"FINAL_STEP {STEPS}" in log
    assert committed_at_kill == [5]  # the save at step 10 died with rank 0: never committed
    # the survivor ends at once: it sees rank 0's process has ended (same host), or, when torchrun's SIGTERM
    # comes first, because rank 0 neither answered nor got the signal
    noticed = "rank(s) 0 stopped answering (their process ended" in log
    signalled = (
        "lplugins [rank 1]: SIGTERM from torchelastic while waiting in lplugins' agreement on saving" in log
        and "for rank(s) 0, which neither answered nor got the signal" in log
    )
    assert noticed or signalled, log[-5000:]
    assert _resumed_from(log) == 5
    # without the fix the survivor lives until torchrun's SIGKILL, 30 s after its SIGTERM
    assert death_to_end < 20, (death_to_end, log[-5000:])


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_whole_job_stopped_during_a_save_still_saves_and_stops(tmp_path: Path) -> None:
    """torchrun itself gets SIGTERM (a preempted pod) while rank 1 waits in a save's agreement for rank 0.

    Every rank gets the signal and says so on the board: rank 1 keeps waiting, the save commits,
    and the preemption save and stop follow at the next step, as outside torchelastic.
    """
    port = free_port()
    args = ["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    job = _torchrun(tmp_path, args, _env(DIE_IN_SAVE="0", DIE_IN_SAVE_AT="2", SLOW_IN_SAVE="60"), "out.log")
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "in_save").exists():
            assert job.poll() is None and time.monotonic() < deadline, "rank 0 did not reach its second save"
            time.sleep(0.05)
        time.sleep(0.5)  # rank 1 reaches the agreement
        os.kill(job.pid, signal.SIGTERM)
        job.wait(timeout=60)
    finally:
        _kill_all(job)
    log = (tmp_path / "out.log").read_text(errors="replace")
    assert "neither answered nor got the signal" not in log, log[-5000:]
    assert "DurableCheckpoint: preemption checkpoint saved at step 11; stopping." in log, log[-5000:]
    assert _committed(tmp_path / "ck") == [5, 10, 11]


def _node(tmp_path: Path, port: int, name: str, *, host: bool, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """One torchrun agent of ``--nnodes=1:2`` with one worker: a "node" on this machine."""
    conf = f"is_host={int(host)},last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5"
    args = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    return _torchrun(tmp_path, [*args, f"--rdzv-conf={conf}"], env, f"{name}.log")


@pytest.mark.distributed
@pytest.mark.extended  # covered by test_a_node_lost_then_one_joining_the_job_shrinks_and_grows (its first half)
@pytest.mark.timeout(150)
def test_lost_node_the_job_continues_on_the_other(tmp_path: Path) -> None:
    """Two torchrun agents as two nodes (``--nnodes=1:2``); one is killed with its worker."""
    port = free_port()

    first = _node(tmp_path, port, "first", host=True, env=_env())  # hosts the rendezvous store: it must stay
    second = _node(tmp_path, port, "second", host=False, env=_env())
    try:
        _wait_for_commit(tmp_path, [first, second], time.monotonic() + 90)
        _kill_all(second)  # the whole node: its agent and its worker
        first.wait(timeout=120)
    finally:
        _kill_all(first, second)
    log = (tmp_path / "first.log").read_text(errors="replace")
    assert first.returncode == 0, log[-5000:]
    assert f"FINAL_STEP {STEPS}" in log
    steps = _steps(tmp_path)
    assert steps[0]["world"] == 2 and steps[-1] == {"step": STEPS, "world": 1, "restart": 1}
    resumed = _resumed_from(log)
    assert next(s["step"] for s in steps if s["restart"] == 1) == resumed + 1


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_node_lost_then_one_joining_the_job_shrinks_and_grows(tmp_path: Path) -> None:
    """2 nodes -> 1 (one killed) -> 2 (a new one joins), to the same final step.

    torch 2.13's shared rendezvous store cannot take a node that joins a running job (the joining
    agent waits for a ``MASTER_ADDR`` key the running ones never write again; torchrun's agents, before
    any lplugins code): a job that is to grow runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
    """
    port = free_port()
    env = _env(**{_NO_SHARED_STORE: "1", "SLOW_WHEN_ALONE": "0.3", "STEPS": "200"})
    first = _node(tmp_path, port, "first", host=True, env=env)
    second = _node(tmp_path, port, "second", host=False, env=env)
    third = None
    try:
        _wait_for_commit(tmp_path, [first, second], time.monotonic() + 90)
        _kill_all(second)
        deadline = time.monotonic() + 90
        while not any(s["world"] == 1 for s in _steps(tmp_path)):  # the job goes on alone
            assert first.poll() is None, (tmp_path / "first.log").read_text(errors="replace")[-8000:]
            if time.monotonic() > deadline:
                pytest.fail(_stalled(tmp_path, first, "first.log", "the job did not go on with one node"))
            time.sleep(0.1)
        third = _node(tmp_path, port, "third", host=False, env=env)
        first.wait(timeout=150)
        third.wait(timeout=30)
    finally:
        _kill_all(first, second, *([third] if third else []))
    log = (tmp_path / "first.log").read_text(errors="replace")
    assert first.returncode == 0 and third.returncode == 0, log[-5000:]
    # after the node joins, rank 0 of the grown job runs on whichever node the rendezvous made first
    log += (tmp_path / "third.log").read_text(errors="replace")
    assert "FINAL_STEP 200" in log
    worlds = [s["world"] for s in _steps(tmp_path)]
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2  # shrank, then grew back
    resumes = re.findall(r"resuming a checkpoint written by (\d) rank\(s\) on (\d) rank", log)
    assert ("2", "1") in resumes and ("1", "2") in resumes, resumes
