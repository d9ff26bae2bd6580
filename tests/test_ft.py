"""``ft_ddp`` (torchft): bad settings refused before training, and real replica groups on CPU (gloo).

The multi-process tests start torchft's lighthouse and the replica groups with the launcher behind
``lplugins ft run`` (:class:`~lplugins._cli.ft_launch.Launcher`); each group is a real process
running a real Trainer. Nothing of torch.distributed, torchft or Lightning is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import lplugins
from lplugins.strategies._ft_env import FTConfigError, FTUnavailableError
from tests._dist import ROOT, free_port

pytest.importorskip("torchft")


def _unreachable() -> str:
    return f"http://127.0.0.1:{free_port()}"


# ------------------------------------------------------------------------------- refused at compose
def test_an_unreachable_lighthouse_is_refused_naming_the_setting_and_the_fix() -> None:
    address = _unreachable()
    spec = {"name": "ft_ddp", "lighthouse": address, "replica_id": 0, "num_replica_groups": 2}
    with pytest.raises(FTConfigError, match=r"lighthouse='http://127\.0\.0\.1:\d+': no torchft lighthouse") as err:
        lplugins.compose(strategy=spec, accelerator="cpu")
    assert "lplugins ft lighthouse" in str(err.value) and "lplugins ft run --replicas N" in str(err.value)


def test_without_a_lighthouse_setting_the_error_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(FTConfigError, match="set TORCHFT_LIGHTHOUSE") as err:
        lplugins.compose(strategy="ft_ddp", accelerator="cpu")
    assert "lplugins ft run --replicas N -- python train.py" in str(err.value)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", _unreachable())
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    with pytest.raises(FTConfigError, match=r"^TORCHFT_LIGHTHOUSE='http://127\.0\.0\.1:\d+': no torchft lighthouse"):
        lplugins.compose(strategy="ft_ddp", accelerator="cpu")


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        (
            {"replica_id": 3, "num_replica_groups": 3},
            r"replica_id=3 \(REPLICA_GROUP_ID\) is out of range .* allowed 0\.\.2",
        ),
        ({"replica_id": 0, "num_replica_groups": 0}, r"num_replica_groups=0 .* at least 1 replica group"),
        ({"replica_id": 0, "num_replica_groups": 3, "min_replicas": 4}, r"min_replicas=4 .* between 1 and"),
        ({"num_replica_groups": 3}, r"REPLICA_GROUP_ID not set"),
        ({"replica_id": 0, "num_replica_groups": 2, "max_steps": 0}, r"max_steps=0 must be a positive int"),
        ({"step_retries": -1}, r"step_retries=-1 must be an int >= 0"),
        ({"reduce_dtype": "int64"}, r"reduce_dtype='int64' is not a floating-point dtype: use None .* or 'float64'"),
        ({"heartbeat_interval": 0}, r"heartbeat_interval=0 must be a positive number of seconds"),
        ({"allreduce_timeout": 0}, r"allreduce_timeout=0 is not allowed: it must be 'auto' .* or a positive"),
        ({"allreduce_timeout": float("nan")}, r"allreduce_timeout=nan is not allowed"),
        ({"allreduce_timeout": "fast"}, r"allreduce_timeout='fast' is not allowed"),
    ],
)
def test_wrong_replica_counts_are_refused(monkeypatch: pytest.MonkeyPatch, params: dict[str, Any], needle: str) -> None:
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    monkeypatch.delenv("NUM_REPLICA_GROUPS", raising=False)
    with pytest.raises(FTConfigError, match=needle):
        lplugins.compose(strategy={"name": "ft_ddp", "lighthouse": _unreachable(), **params}, accelerator="cpu")


@pytest.mark.parametrize(
    ("trainer", "needle"),
    [
        ({"devices": 2}, r"one process per replica group; got devices=2\. Use devices=1"),
        ({"num_nodes": 2}, r"got num_nodes=2"),
        ({"accelerator": "gpu"}, r"runs on CPU \(gloo\) in this release; got accelerator='gpu'"),
    ],
)
def test_trainer_arguments_it_cannot_run_are_refused(trainer: dict[str, Any], needle: str) -> None:
    spec = {"name": "ft_ddp", "lighthouse": _unreachable(), "replica_id": 0, "num_replica_groups": 2}
    with pytest.raises(FTConfigError, match=needle):
        lplugins.compose(strategy=spec, **{"accelerator": "cpu", **trainer})


def test_ft_hsdp_is_refused_with_the_reason() -> None:
    with pytest.raises(FTConfigError, match=r"'ft_hsdp' .* CUDA device mesh .* On CPU use strategy='ft_ddp'"):
        lplugins.compose(strategy="ft_hsdp", accelerator="cpu")


def test_the_launcher_refuses_bad_counts(capsys: pytest.CaptureFixture[str]) -> None:
    from lplugins.cli import main

    assert main(["ft", "run", "--replicas", "2", "--min-replicas", "3", "--", sys.executable, "x.py"]) == 2
    assert "min_replicas=3 is more than the job's 2 replica groups" in capsys.readouterr().err
    assert main(["ft", "run", "--replicas", "0", "--", sys.executable, "x.py"]) == 2
    assert "replicas=0 must be an int >= 1" in capsys.readouterr().err
    address = _unreachable()
    assert main(["ft", "run", "--replicas", "1", "--lighthouse", address, "--", sys.executable, "x.py"]) == 2
    assert f"--lighthouse={address!r}: no torchft lighthouse answers there" in capsys.readouterr().err


HIDE_TORCHFT = """
import importlib.abc, sys

class HideTorchft(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchft" or name.startswith("torchft."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideTorchft())
"""


@pytest.mark.timeout(120)
def test_without_the_extra_the_names_are_unavailable_and_refused(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(HIDE_TORCHFT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    script = (
        "import lplugins\n"
        "print('D', lplugins.load().registry('strategy').get('ft_ddp').description)\n"
        "try:\n    lplugins.compose(strategy='ft_ddp', accelerator='cpu')\n"
        "except lplugins.CompositionError as e:\n    print('E', type(e).__name__, e)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=100)
    assert 'D unavailable: torchft is not installed (pip install "lplugins[ft]")' in result.stdout, result.stderr
    assert (
        "E FTUnavailableError strategy 'ft_ddp' needs torchft, the PyTorch fault-tolerance engine: torchft is not "
        'installed (pip install "lplugins[ft]"). Install it with: pip install "lplugins[ft]"' in result.stdout
    ), result.stdout + result.stderr
    assert issubclass(FTUnavailableError, lplugins.CompositionError)


# ------------------------------------------------------------------------------ real replica groups
TRAIN = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, IterableDataset
    import lplugins
    from lplugins.callbacks import DurableCheckpoint

    out, max_steps, phase = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    replica = int(os.environ["REPLICA_GROUP_ID"])
    torch.set_num_threads(1)
    if phase == "first" and replica == 1:
        time.sleep(3)  # starts late: with min_replicas=1, group 0 must still not train alone

    class Ticks(IterableDataset):
        def __iter__(self):
            while True:
                yield 0

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)
            self.micro = 0

        def training_step(self, batch, batch_idx):
            k, self.micro = self.micro % 2, self.micro + 1  # the micro-batch in the accumulation window
            g = torch.Generator().manual_seed(1000 * self.trainer.strategy.ft_step + 10 * replica + k)
            x = torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(self.net(x), x.sum(1, keepdim=True))
            self.log("loss", loss, on_step=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    strategy = {"name": "ft_ddp", "max_steps": max_steps, "init_sync": False}
    trainer = pl.Trainer(**lplugins.compose(
        strategy=strategy, accelerator="cpu", accumulate_grad_batches=2, max_epochs=1, log_every_n_steps=1,
        logger=CSVLogger(out, name=f"{phase}_replica_{replica}", version=0),
        callbacks=[DurableCheckpoint(f"{out}/{phase}_ckpt_{replica}", every_n_steps=2)],
        enable_progress_bar=False, enable_model_summary=False,
    ))
    module = Module()
    trainer.fit(module, DataLoader(Ticks(), batch_size=None), ckpt_path=resume)
    params = [p.detach().double().flatten().tolist() for p in module.net.parameters()]
    with open(f"{out}/{phase}_final_{replica}.json", "w") as f:
        json.dump({"params": params, "ft_step": trainer.strategy.ft_step, "global_step": trainer.global_step}, f)
    """
)


def _replay(steps: int) -> list[list[float]]:
    """One process: every step the mean over both groups of their 2 micro-batches' gradients (each / 2)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        for replica in (0, 1):
            for k in (0, 1):
                g = torch.Generator().manual_seed(1000 * step + 10 * replica + k)
                x = torch.randn(8, 4, generator=g)
                (torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True)) / 2 / 2).backward()
        optimizer.step()
    return [p.detach().double().flatten().tolist() for p in net.parameters()]


def _launch(tmp_path: Path, *args: str, timeout: float = 150) -> None:
    from lplugins._cli.ft_launch import Launcher

    launcher = Launcher(
        [sys.executable, str(tmp_path / "train.py"), str(tmp_path), *args],
        2,
        min_replicas=1,  # the start barrier, not min_replicas, makes the first step wait for both groups
        max_restarts=0,  # both groups forked from the fork server (the second phase: fresh processes)
        heartbeat_timeout_ms=10_000,  # no group is lost here: a heartbeat late on a loaded machine drops none
        env={"RUST_LOG": "warn", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        log_dir=tmp_path / "logs",
    )
    launcher.start()
    deadline = time.monotonic() + timeout
    try:
        while not launcher.poll():
            assert time.monotonic() < deadline, f"replica groups did not finish in {timeout}s"
            time.sleep(0.05)
    finally:
        launcher.stop()
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert all(e.returncode == 0 for e in launcher.events if e.kind == "exit"), logs


def _launch_cli(tmp_path: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """The documented command, ``lplugins ft run``, in its own session (killed whole on a timeout)."""
    command = [sys.executable, "-m", "lplugins", "ft", "run", "--replicas", "2", "--min-replicas", "2"]
    command += ["--max-restarts", "0", "--no-spare", "--log-dir", str(tmp_path / "cli_logs")]
    command += ["--", sys.executable, str(tmp_path / "train.py"), str(tmp_path), *args]
    env = {**os.environ, "RUST_LOG": "warn", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()  # the launcher stops its groups on SIGTERM
        try:
            process.wait(timeout=10)
        finally:
            os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"lplugins ft run did not finish in {timeout}s\n{err[-3000:]}") from None
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((tmp_path / "cli_logs").glob("*.log")))
    assert process.returncode == 0, err[-3000:] + logs
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _metric_rows(path: Path) -> int:
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    column = lines[0].split(",").index("loss") if lines and "loss" in lines[0].split(",") else None
    return 0 if column is None else sum(1 for line in lines[1:] if line.split(",")[column])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(330)
def test_two_replica_groups_accumulate_log_once_checkpoint_and_resume_from_disk(tmp_path: Path) -> None:
    """2 groups, accumulate_grad_batches=2, min_replicas=1, group 1 starting 3 s late: the first step waits for
    both (without the start barrier group 0 trains alone), both end with the replay's parameters; only the leader logs;
    each group's DurableCheckpoint commits; every group lost, both resume one group's checkpoint (started
    the second time by the documented command, ``lplugins ft run``)."""
    from lplugins.callbacks import latest_checkpoint

    (tmp_path / "train.py").write_text(TRAIN)
    _launch(tmp_path, "4", "first")
    assert (
        "ft_ddp: the job's step 0 starts with 2 of 2 replica groups"
        in (tmp_path / "logs" / "replica_0.0.log").read_text()
    )
    expected = _replay(4)
    for replica in (0, 1):
        final = json.loads((tmp_path / f"first_final_{replica}.json").read_text())
        assert final["ft_step"] == 4 and final["global_step"] == 4
        for got, want in zip(final["params"], expected, strict=True):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6, rtol=0), (replica, got, want)
        assert latest_checkpoint(tmp_path / f"first_ckpt_{replica}") is not None
    # rank-zero logging follows the leader (replica 0, the lowest id in every quorum): logged once
    leader = _metric_rows(tmp_path / "first_replica_0" / "version_0" / "metrics.csv")
    other = _metric_rows(tmp_path / "first_replica_1" / "version_0" / "metrics.csv")
    assert leader >= 4 and other == 0, (leader, other)

    # every group lost: both start again from group 0's newest checkpoint (step 4) and go on to step 6
    newest = latest_checkpoint(tmp_path / "first_ckpt_0")
    assert newest is not None and Path(newest).name.startswith("step=000000004-")
    result = _launch_cli(tmp_path, "6", "second", newest)
    assert "lplugins ft: lighthouse http://" in result.stderr
    expected = _replay(6)
    for replica in (0, 1):
        final = json.loads((tmp_path / f"second_final_{replica}.json").read_text())
        assert final["ft_step"] == 6, final
        for got, want in zip(final["params"], expected, strict=True):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6, rtol=0), (replica, got, want)


KILL_ARGS = ("--kills", "3", "--interval", "3", "--hidden", "128", "--batch", "32", "--after", "10")
KILL_ARGS += ("--reduce-dtype", "float64")  # the mean does not depend on who sums first: the replay is exact


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.extended  # covered in the default tier by the two-group test (same strategy, launcher, replay)
@pytest.mark.timeout(600)
def test_killed_groups_rejoin_from_a_peer_and_match_the_replay() -> None:
    """3 groups, 3 SIGKILLs of a random group restarted by the launcher (benchmarks/bench_ft.py), float64 sums."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_ft.py"), *KILL_ARGS],
        capture_output=True,
        text=True,
        timeout=560,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-5000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["kills"] == 3 and figures["launcher_status"] == 0
    assert figures["rejoins_with_state_from_peer"] == 3, figures
    assert figures["disk_reads_on_recovery_path"] == 0, figures
    assert figures["steps_ambiguous"] == 0 and figures["final_groups_compared"] == 3, figures
    assert figures["max_abs_diff_vs_replay"] <= 1e-6, figures


LEADER_TRAIN = textwrap.dedent(
    """
    import os, signal, sys, json
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, IterableDataset
    import lplugins

    out = sys.argv[1]
    replica = int(os.environ["REPLICA_GROUP_ID"])
    torch.set_num_threads(1)

    class Ticks(IterableDataset):
        def __iter__(self):
            while True:
                yield 0

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            g = torch.Generator().manual_seed(1000 * self.trainer.strategy.ft_step + replica)
            x = torch.randn(8, 4, generator=g)
            return torch.nn.functional.mse_loss(self.net(x), x.sum(1, keepdim=True))

        def on_train_batch_end(self, *_):
            strategy = self.trainer.strategy
            if strategy.last_step is None or strategy.last_step is getattr(self, "seen", None):
                return  # a micro-batch that did not end its accumulation window
            self.seen = strategy.last_step
            step, committed = strategy.last_step[:2]
            if committed:
                self.log("job_step", float(step), on_step=True)
                with open(f"{out}/loop_{replica}_{os.getpid()}.jsonl", "a") as f:  # where the loop stands
                    row = {"step": step, "global_step": self.trainer.global_step,
                           "factor": self.trainer.accumulate_grad_batches}
                    f.write(json.dumps(row) + "\\n")
            first_run = not os.path.exists(f"{out}/killed")
            if replica == 0 and first_run and step >= 3:  # the leader is lost
                with open(f"{out}/killed", "w") as f:
                    f.write(str(step))
                os.kill(os.getpid(), signal.SIGKILL)
            if replica == 0 and not first_run and committed and not os.path.exists(f"{out}/rejoined"):
                with open(f"{out}/rejoined.tmp", "w") as f:
                    f.write(str(step))
                os.replace(f"{out}/rejoined.tmp", f"{out}/rejoined")
            if os.path.exists(f"{out}/rejoined"):
                with open(f"{out}/rejoined") as f:
                    if strategy.ft_step >= max(int(f.read()) + 6, 16):
                        self.trainer.should_stop = True

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(**lplugins.compose(
        strategy={"name": "ft_ddp", "max_steps": 20000, "init_sync": False},
        accelerator="cpu",
        precision="bf16-mixed",
        accumulate_grad_batches={"name": "step", "schedule": {0: 2, 12: 1}},  # keyed by step: changes later
        max_epochs=1, log_every_n_steps=1,
        logger=CSVLogger(out, name=f"replica_{replica}", version=os.getpid()),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ))
    module = Module()
    trainer.fit(module, DataLoader(Ticks(), batch_size=None))
    with open(f"{out}/final_{replica}.json", "w") as f:
        json.dump([p.detach().double().flatten().tolist() for p in module.net.parameters()], f)
    """
)


def _logged_steps(path: Path) -> list[int]:
    lines = path.read_text().splitlines()
    if not lines or "job_step" not in lines[0].split(","):
        return []
    column = lines[0].split(",").index("job_step")
    return [int(float(line.split(",")[column])) for line in lines[1:] if line.split(",")[column]]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.extended  # a restart without the fork server (a fresh interpreter's imports): tens of seconds
@pytest.mark.timeout(300)
def test_the_leader_is_lost_logging_follows_the_new_leader_once_with_a_schedule_and_a_precision_name(
    tmp_path: Path,
) -> None:
    """2 groups under ``lplugins ft run``'s launcher; group 0 (the leader) is SIGKILLed at step 3 and restarted.

    The rejoined group continues at its peer's loop position: the same ``trainer.global_step`` and the same
    factor of the step-keyed accumulation schedule (``{0: 2, 12: 1}``) at every step both ran.

    Group 1 leads while group 0 is down, group 0 leads again once it has rejoined; every step after the
    kill is logged exactly once, by the group that led it (group 1's rows,
    held in memory by its CSVLogger, are written when it stops leading). A named accumulation schedule
    and a precision name are in the Trainer, and both groups end with the same parameters.
    """
    from lplugins._cli.ft_launch import Launcher

    (tmp_path / "train.py").write_text(LEADER_TRAIN)
    launcher = Launcher(
        [sys.executable, str(tmp_path / "train.py"), str(tmp_path)],
        2,
        min_replicas=1,
        max_restarts=1,
        spare=False,
        heartbeat_timeout_ms=500,
        env={"RUST_LOG": "warn", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        log_dir=tmp_path / "logs",
    )
    launcher.start()
    deadline = time.monotonic() + 240
    try:
        while not launcher.poll():
            assert time.monotonic() < deadline, "replica groups did not finish in 240s"
            time.sleep(0.05)
    finally:
        launcher.stop()
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    exits = [e.returncode for e in launcher.events if e.kind == "exit"]
    assert sorted(exits) == [-signal.SIGKILL, 0, 0], logs
    runs = {path.parent: _logged_steps(path) for path in tmp_path.glob("replica_*/version_*/metrics.csv")}
    by_replica_1 = [step for run, steps in runs.items() if run.parent.name == "replica_1" for step in steps]
    pid_0 = {e.pid for e in launcher.events if e.replica == 0 and e.kind == "start"}
    restarted = [e.pid for e in launcher.events if e.replica == 0 and e.kind == "start"][-1]  # the restarted one
    by_new_0 = runs.get(tmp_path / "replica_0" / f"version_{restarted}", [])
    killed, rejoined = (int((tmp_path / name).read_text()) for name in ("killed", "rejoined"))
    # (before the kill both groups may have logged: with min_replicas=1 each can start in a quorum of its own)
    assert [s for s in by_replica_1 if killed < s < rejoined], (runs, logs)  # group 1 led while group 0 was down
    assert by_new_0 and min(by_new_0) <= rejoined + 1, (runs, logs)  # group 0 leads again once it has rejoined
    every = sorted(step for steps in runs.values() for step in steps if step > killed)
    assert every == list(range(killed + 1, every[-1] + 1)), runs  # after the kill: each step once, none missing
    assert every[-1] >= rejoined + 5
    finals = [json.loads((tmp_path / f"final_{replica}.json").read_text()) for replica in (0, 1)]
    assert finals[0] == finals[1]
    # the rejoined group goes on at the peer's loop position (Lightning's global step, the schedule's step)
    loops = {
        p.stem.split("_", 2)[2]: [json.loads(x) for x in p.read_text().splitlines()] for p in tmp_path.glob("loop_*")
    }
    new_0 = {r["step"]: r for r in loops[str(restarted)]}
    peer = {r["step"]: r for pid, rows in loops.items() if int(pid) not in pid_0 for r in rows}
    shared = sorted(set(new_0) & set(peer))
    assert shared and shared[-1] >= 12, (shared, logs)  # past the schedule's change
    for step in shared:
        assert new_0[step]["global_step"] == peer[step]["global_step"], (step, new_0[step], peer[step])
        if step > shared[0]:  # its first window was sized before the state arrived (within that step)
            assert new_0[step]["factor"] == peer[step]["factor"], (step, new_0[step], peer[step])
