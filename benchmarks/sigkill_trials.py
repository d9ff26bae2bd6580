"""SIGKILL fault injection for DurableCheckpoint: kill a 2-process DDP run (gloo, CPU) at random moments
during saves, then resume it, many times.

Each trial forks two ranks from this already-imported process (so a trial costs a second, not an
interpreter start), trains a tiny model saving every step (sync and async trials alternate), kills
both ranks with SIGKILL -- half of the kills at a random instant, half the instant a temporary
checkpoint file appears, i.e. mid-write -- and then checks the directory: every committed checkpoint
must load with ``torch.load(weights_only=True)``. The next trial resumes with ``ckpt_path="latest"``
and must start exactly at the newest committed step. A final run resumes and finishes.

Usage::

    python benchmarks/sigkill_trials.py --trials 200

Prints a tally and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import sys
import time

import torch

torch.set_num_threads(1)  # no intra-op pool in the parent: it forks ranks

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lplugins.callbacks import DurableCheckpoint, latest_checkpoint  # noqa: E402
from lplugins.callbacks._record import TMP_PREFIX  # noqa: E402
from lplugins.callbacks._storage import open_storage  # noqa: E402

SAVE_EVERY = 1
MAX_IN_FLIGHT = 1


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.layer(x) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Progress(pl.Callback):
    """Rank 0 appends ``start N`` when training starts and ``step N`` at each step (before the save)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, trainer: pl.Trainer, line: str) -> None:
        if trainer.global_rank == 0:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, (line + "\n").encode())
            os.close(fd)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, f"start {trainer.global_step}")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self._write(trainer, f"step {trainer.global_step}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(rank: int, port: int, ckdir: str, progress: str, mode: str, max_steps: int, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
        GROUP_RANK="0", LOCAL_WORLD_SIZE="2", NODE_RANK="0",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    cb = DurableCheckpoint(
        ckdir, every_n_steps=SAVE_EVERY, keep_last=2, async_save=mode == "async", max_in_flight=MAX_IN_FLIGHT,
        preemption_signals=(),
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps, callbacks=[cb, Progress(progress)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Model(), data, ckpt_path="latest")


def spawn(port: int, ckdir: str, progress: str, mode: str, max_steps: int, log: str) -> list[int]:
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_main(rank, port, ckdir, progress, mode, max_steps, log)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    return pids


def read_progress(path: str) -> tuple[int | None, int | None]:
    start = last = None
    try:
        with open(path) as f:
            for line in f:
                kind, _, value = line.strip().partition(" ")
                if kind == "start" and value:
                    start = int(value)
                elif kind == "step" and value:
                    last = int(value)
    except FileNotFoundError:
        pass
    return start, last


def committed_state(ckdir: str) -> tuple[int, int]:
    """(newest committed step, number of committed checkpoints that fail to load)."""
    storage = open_storage(ckdir)
    bad = 0
    newest = 0
    for record, _marker in storage.records():
        if record is None:
            continue
        try:
            ckpt = torch.load(storage.path(record.name), weights_only=True, map_location="cpu")
            assert ckpt["global_step"] == record.global_step
        except Exception:
            # visible (marker present) but not loadable: what must never happen
            bad += 1
            continue
        newest = max(newest, record.global_step)
    latest = latest_checkpoint(ckdir)
    if latest is not None:
        newest_latest = torch.load(latest, weights_only=True, map_location="cpu")["global_step"]
        if newest_latest != newest:
            bad += 1
    return newest, bad


def wait_for(pred: object, timeout: float, pids: list[int]) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        for pid in pids:
            done, _status = os.waitpid(pid, os.WNOHANG)
            if done:
                return False
        time.sleep(0.002)
    return False


def kill_all(pids: list[int]) -> list[int]:
    statuses = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            statuses.append(os.waitpid(pid, 0)[1])
        except ChildProcessError:
            statuses.append(-1)
    return statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--workdir", default="sigkill_work")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.workdir, exist_ok=True)
    ckdir = os.path.join(args.workdir, "ckpts")
    # a rerun in the same workdir starts from no checkpoint and no progress, as trial 0 expects
    shutil.rmtree(ckdir, ignore_errors=True)
    for name in os.listdir(args.workdir):
        if name.startswith("progress."):
            os.unlink(os.path.join(args.workdir, name))
    log = os.path.join(args.workdir, "ranks.log")
    tally = {
        "kills": 0, "kills_during_save": 0, "resumes_ok": 0, "resume_failures": 0, "partial_visible": 0,
        "max_steps_lost_sync": 0, "max_steps_lost_async": 0, "steps_lost_total": 0,
    }  # fmt: skip
    expected_start = 0
    started = time.monotonic()
    for trial in range(args.trials + 1):
        final = trial == args.trials
        mode = "sync" if trial % 2 == 0 else "async"
        progress = os.path.join(args.workdir, f"progress.{trial}")
        pids = spawn(free_port(), ckdir, progress, mode, expected_start + 3 if final else 10**6, log)

        def started_ok() -> bool:
            return read_progress(progress)[1] is not None  # noqa: B023

        if not wait_for(started_ok, 120, pids):
            kill_all(pids)
            tally["resume_failures"] += 1
            print(f"trial {trial}: the run did not start or resume (see {log})", file=sys.stderr)
            break
        start, _ = read_progress(progress)
        if start == expected_start:
            if trial > 0:
                tally["resumes_ok"] += 1
        else:
            tally["resume_failures"] += 1
            print(f"trial {trial}: resumed at {start}, expected {expected_start}", file=sys.stderr)
        if final:
            statuses = [os.waitpid(pid, 0)[1] for pid in pids]
            if any(statuses):
                tally["resume_failures"] += 1
            break
        if trial % 2 == 0:
            time.sleep(rng.uniform(0.0, 0.5))
        else:
            wait_for(lambda: any(n.startswith(TMP_PREFIX) for n in os.listdir(ckdir)), 5, pids)
            time.sleep(rng.uniform(0.0, 0.002))
        during = any(n.startswith(TMP_PREFIX) for n in os.listdir(ckdir))
        statuses = kill_all(pids)
        if not all(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL for s in statuses):
            tally["resume_failures"] += 1
            print(f"trial {trial}: a rank exited on its own before the kill: {statuses}", file=sys.stderr)
        tally["kills"] += 1
        tally["kills_during_save"] += int(during)
        _, reached = read_progress(progress)
        newest, bad = committed_state(ckdir)
        tally["partial_visible"] += bad
        lost = (reached or 0) - newest
        key = f"max_steps_lost_{mode}"
        tally[key] = max(tally[key], lost)
        tally["steps_lost_total"] += max(lost, 0)
        expected_start = newest
    tally.update(
        save_interval_steps=SAVE_EVERY, max_in_flight=MAX_IN_FLIGHT, seconds=round(time.monotonic() - started, 1)
    )
    print(
        f"{tally['kills']} SIGKILLs ({tally['kills_during_save']} with a save being written), "
        f"{tally['resumes_ok']} resumes at the newest committed step, {tally['resume_failures']} failures, "
        f"{tally['partial_visible']} partial checkpoints visible, steps lost max sync {tally['max_steps_lost_sync']} "
        f"/ async {tally['max_steps_lost_async']} (save every {SAVE_EVERY} step)"
    )
    print(json.dumps(tally))
    return 0 if tally["resume_failures"] == 0 and tally["partial_visible"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
