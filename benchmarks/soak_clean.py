"""Clean-run soak: many 2-rank runs (gloo, CPU) with no fault injected must all end well, on every rank.

A fault-tolerance layer that fails a clean run (one rank exits 1 at shutdown, say, because the other
rank tore down what it still needed) is worse than none: under a scheduler that is a requeue. Each
run here forks its two ranks from this already-imported process (a run costs seconds, not two
interpreter starts) and cycles through

* strategies: DDP with synchronous and with asynchronous ``DurableCheckpoint`` saves, FSDP2
  (``strategy="fsdp2"``) and DeepSpeed ZeRO-2 (``strategy="deepspeed_stage_2_cpu"``);
* endings: ``fit`` to ``max_steps``; ``fit`` then ``validate``; ``EarlyStopping``; ``should_stop``
  set on rank 1 only.

Every run saves every 2 steps (``keep_last=2``, so retention deletes run too) and the second run of
each combination resumes with ``ckpt_path="latest"``. A run passes when every rank exits 0 within the
time limit, no ``.tmp.*`` entry and no directory claim is left in its checkpoint directory, no process
of the rank's session outlives it, and no ``lplugins-*`` thread is alive in a rank when it returns.

Usage::

    nice -n 10 python benchmarks/soak_clean.py --runs 200

Prints one line per failure and, as its last line, one JSON object (units in the key names).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Any

import torch

torch.set_num_threads(1)  # no intra-op pool in the parent: it forks ranks

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lplugins  # noqa: E402
from lplugins.callbacks import DurableCheckpoint  # noqa: E402
from lplugins.callbacks._claim import CLAIM  # noqa: E402
from lplugins.callbacks._record import TMP_PREFIX  # noqa: E402

STRATEGIES = ("ddp_sync", "ddp_async", "fsdp2", "zero2")
ENDINGS = ("max_steps", "validate_after_fit", "early_stopping", "should_stop_one_rank")
STRATEGY_NAMES = {"ddp_sync": "ddp", "ddp_async": "ddp", "fsdp2": "fsdp2", "zero2": "deepspeed_stage_2_cpu"}


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", ((self(x) - y) ** 2).mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class StopOnRankOne(pl.Callback):
    """Rank 1 alone sets ``trainer.should_stop`` after step 3."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == 1 and trainer.global_step >= 3:
            trainer.should_stop = True


def loader(n: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(rank: int, port: int, ckdir: str, strategy: str, ending: str, resume: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
        GROUP_RANK="0", LOCAL_WORLD_SIZE="2", NODE_RANK="0",
    )  # fmt: skip
    callbacks: list[pl.Callback] = [
        DurableCheckpoint(
            ckdir, every_n_steps=2, keep_last=2, async_save=strategy == "ddp_async", preemption_signals=()
        )
    ]
    limits: dict[str, Any] = {"max_steps": 6, "max_epochs": 20, "limit_val_batches": 2, "num_sanity_val_steps": 0}
    if ending == "early_stopping":
        # no improvement ever counts (min_delta): stops at the second validation, at the end of epoch 2
        callbacks.append(EarlyStopping(monitor="val_loss", patience=0, min_delta=1e9))
        limits.update(max_steps=-1, max_epochs=20)
    elif ending == "should_stop_one_rank":
        callbacks.append(StopOnRankOne())
        limits.update(max_steps=1000, max_epochs=20)
    trainer = pl.Trainer(
        **lplugins.compose(
            strategy=STRATEGY_NAMES[strategy], accelerator="cpu", devices=2, callbacks=callbacks, logger=False,
            enable_progress_bar=False, enable_model_summary=False, **limits,
        )
    )  # fmt: skip
    model = Model()
    trainer.fit(model, loader(24), loader(16), ckpt_path="latest" if resume else None)
    if ending == "validate_after_fit":
        trainer.validate(model, loader(16))
    # the collective watchdog lives as long as the process (stopped at exit); every other lplugins thread must be gone
    left = sorted(
        t.name for t in threading.enumerate()
        if t.name.startswith("lplugins-") and t.name != "lplugins-collective-watchdog" and t.is_alive()
    )  # fmt: skip
    if left:
        raise RuntimeError(f"lplugins threads still alive after the run: {left}")


def session_processes(sid: int) -> list[int]:
    """Pids of the live (not zombie) processes of session ``sid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry))
    return found


def one_run(workdir: str, index: int, strategy: str, ending: str, resume: bool, timeout: float) -> str | None:
    """Run both ranks; None when the run passed, else what went wrong."""
    ckdir = os.path.join(workdir, f"ckpts.{strategy}.{ending}")
    if not resume:
        shutil.rmtree(ckdir, ignore_errors=True)
    log = os.path.join(workdir, f"run.{index}.log")
    port = free_port()
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            os.setsid()  # the rank's session: whatever it starts is found (and must be gone) when it exits
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 0
            try:
                rank_main(rank, port, ckdir, strategy, ending, resume)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + timeout
    codes: dict[int, int | None] = dict.fromkeys(pids)
    while time.monotonic() < deadline and any(c is None for c in codes.values()):
        for pid in pids:
            if codes[pid] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    problems = []
    hung = [rank for rank, pid in enumerate(pids) if codes[pid] is None]
    if hung:
        problems.append(f"rank(s) {hung} still running after {timeout:.0f}s (hang; killed)")
    for rank, pid in enumerate(pids):
        if codes[pid] is None:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        elif codes[pid] != 0:
            problems.append(f"rank {rank} exit {codes[pid]}")
    for rank, pid in enumerate(pids):
        stray = session_processes(pid)
        if stray:
            problems.append(f"rank {rank} left processes {stray}")
            for p in stray:
                os.kill(p, signal.SIGKILL)
    entries = os.listdir(ckdir) if os.path.isdir(ckdir) else []
    left = [e for e in entries if e.startswith(TMP_PREFIX) or e.startswith(CLAIM)]
    if left:
        problems.append(f"left behind in {ckdir}: {left}")
    if not problems:
        os.unlink(log)
        return None
    with open(log, errors="replace") as f:
        errors = [line for line in f.read().splitlines() if line and not line[0].isspace() and "Error" in line]
    return "; ".join(problems) + (f" ({errors[-1]})" if errors else "") + f" [log {log}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--workdir", default="soak_work")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a run may take before it counts as hung")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated subset of {STRATEGIES}")
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown or not strategies:
        parser.error(f"--strategies={args.strategies!r}: unknown {unknown}; allowed: {', '.join(STRATEGIES)}")
    if args.runs < 1:
        parser.error(f"--runs={args.runs}: must be at least 1")
    os.makedirs(args.workdir, exist_ok=True)
    combos = [(s, e) for s in strategies for e in ENDINGS]
    per_strategy = dict.fromkeys(strategies, 0)
    per_ending = dict.fromkeys(ENDINGS, 0)
    failures: list[str] = []
    hangs = 0
    seconds: list[float] = []
    started = time.monotonic()
    for index in range(args.runs):
        strategy, ending = combos[index % len(combos)]
        resume = (index // len(combos)) % 2 == 1  # every other round resumes the previous round's directory
        t0 = time.monotonic()
        problem = one_run(args.workdir, index, strategy, ending, resume, args.timeout)
        seconds.append(time.monotonic() - t0)
        per_strategy[strategy] += 1
        per_ending[ending] += 1
        if problem is not None:
            hangs += int("hang" in problem)
            failures.append(f"run {index} ({strategy}, {ending}, resume={resume}): {problem}")
            print(failures[-1], file=sys.stderr, flush=True)
    seconds.sort()
    result = {
        "runs": args.runs,
        "runs_clean": args.runs - len(failures),
        "runs_failed": len(failures),
        "hangs": hangs,
        "runs_per_strategy": per_strategy,
        "runs_per_ending": per_ending,
        "median_run_seconds": round(seconds[len(seconds) // 2], 2),
        "total_seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
