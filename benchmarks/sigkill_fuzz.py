"""SIGKILL fuzz across strategies and moments: many kills of 2-rank runs (gloo, CPU), each followed by a resume.

The sibling of ``sigkill_trials.py`` (DDP only, with damage and bit-exact weights); this one scales the count
and widens where the kills land. Each trial forks two ranks from this already-imported process and trains a
small model with ``DurableCheckpoint(every_n_steps=1, keep_last=2)`` (so every step commits one checkpoint
and retention deletes one) with ``ckpt_path="latest"``; strategies rotate over DDP with synchronous saves,
DDP with asynchronous saves, FSDP2 (``strategy="fsdp2"``) and ZeRO-2 (``deepspeed_stage_2_cpu``), each in
its own directory. Kill moments rotate over:

* ``random``: both ranks, at a random instant of training;
* ``mid_save``: both ranks, the instant a temporary entry (a save being written) appears;
* ``resume``: both ranks, at a random instant between the ranks' ``setup`` and the first step of a
  resumed run (cleaning the directory, claiming it, agreeing on and loading the newest checkpoint);
* ``retention_delete``: both ranks, while rank 0 deletes an old checkpoint (between its marker's removal
  and its data's: the benchmark holds the delete there for up to 50 ms);
* ``agreement``: ONE rank (0 and 1 alternate), while both are in the out-of-band failure agreement that ends
  every save and every resume; the survivor must exit on its own within ``--hang-after`` seconds.

After each kill the directory is checked: every visible (committed) checkpoint must match its marker
byte for byte (``Storage.check(deep=True)``) and file checkpoints must load with
``torch.load(weights_only=True)``. The next run must start exactly at the newest committed step. Steps lost
are ``last step rank 0 reached - newest committed step``.

Usage::

    nice -n 10 python benchmarks/sigkill_fuzz.py --kills 1000

Prints one line per problem and, as its last line, one JSON object (units in the key names).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

torch.set_num_threads(1)  # no intra-op pool in the parent: it forks ranks

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lplugins  # noqa: E402
from lplugins.callbacks import DurableCheckpoint  # noqa: E402
from lplugins.callbacks._record import COMMIT_SUFFIX, TMP_PREFIX, Record, order  # noqa: E402
from lplugins.callbacks._storage import Storage  # noqa: E402
from lplugins.callbacks._storages import open_storage  # noqa: E402

STRATEGIES = ("ddp_sync", "ddp_async", "fsdp2", "zero2")
STRATEGY_NAMES = {"ddp_sync": "ddp", "ddp_async": "ddp", "fsdp2": "fsdp2", "zero2": "deepspeed_stage_2_cpu"}
MOMENTS = ("random", "mid_save", "resume", "retention_delete", "agreement")


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Progress(pl.Callback):
    """Rank 0 appends ``setup``, ``start N`` (the step training starts at) and ``step N`` lines."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, trainer: pl.Trainer, line: str) -> None:
        if trainer.global_rank == 0:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, (line + "\n").encode())
            os.close(fd)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._write(trainer, "setup")  # before DurableCheckpoint.setup (checkpoint callbacks run last)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, f"start {trainer.global_step}")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self._write(trainer, f"step {trainer.global_step}")


def touch(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT))


def instrument(flags: str, rank: int) -> None:
    """In a rank: say (a flag file) when a retention delete or a failure agreement is under way."""
    from lplugins._coord import board as _board

    delete = Storage.delete

    def slow_delete(self: Storage, name: str) -> None:
        self.remove(name + COMMIT_SUFFIX)  # the marker goes first (it stops being visible)...
        touch(f"{flags}.deleting")
        time.sleep(0.05)  # ...the window a kill lands in...
        delete(self, name)  # ...then the data (the marker is gone already: removing it again is a no-op)

    agree = _board.agree

    def flagged_agree(text: str | None, where: str) -> Any:
        touch(f"{flags}.agree.{rank}")  # present while this rank is inside the agreement
        try:
            return agree(text, where)
        finally:
            os.unlink(f"{flags}.agree.{rank}")

    Storage.delete = slow_delete  # type: ignore[method-assign]
    _board.agree = flagged_agree


def rank_main(rank: int, port: int, ckdir: str, progress: str, strategy: str, max_steps: int, flags: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
        GROUP_RANK="0", LOCAL_WORLD_SIZE="2", NODE_RANK="0", LPLUGINS_COLLECTIVE_TIMEOUT="30",
    )  # fmt: skip
    instrument(flags, rank)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
    cb = DurableCheckpoint(
        ckdir, every_n_steps=1, keep_last=2, async_save=strategy == "ddp_async", preemption_signals=()
    )
    trainer = pl.Trainer(
        **lplugins.compose(
            strategy=STRATEGY_NAMES[strategy], accelerator="cpu", devices=2, max_steps=max_steps,
            callbacks=[cb, Progress(progress)], logger=False, enable_progress_bar=False,
            enable_model_summary=False,
        )
    )  # fmt: skip
    trainer.fit(Model(), data, ckpt_path="latest")


def spawn(args: tuple[Any, ...], log: str) -> list[int]:
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = 0
            try:
                rank_main(rank, *args)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    return pids


def read_progress(path: str) -> tuple[bool, int | None, int | None]:
    """(setup seen, step training started at, last step reached)."""
    setup, start, last = False, None, None
    try:
        with open(path) as f:
            for line in f:
                kind, _, value = line.strip().partition(" ")
                if kind == "setup":
                    setup = True
                elif kind == "start" and value:
                    start = int(value)
                elif kind == "step" and value:
                    last = int(value)
    except FileNotFoundError:
        pass
    return setup, start, last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exited(pids: list[int], codes: dict[int, int]) -> bool:
    """Reap what ended (exit statuses into ``codes``); whether any rank has ended."""
    for pid in pids:
        if pid not in codes:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = status
    return bool(codes)


def wait_all(pids: list[int], codes: dict[int, int], timeout: float) -> bool:
    """Wait until every rank has ended (statuses into ``codes``); False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        exited(pids, codes)
        if all(p in codes for p in pids):
            return True
        time.sleep(0.05)
    return False


def wait_for(pred: Callable[[], bool], timeout: float, pids: list[int], codes: dict[int, int]) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if exited(pids, codes):
            return False
        time.sleep(0.002)
    return False


def kill(pids: list[int], codes: dict[int, int]) -> None:
    for pid in pids:
        if pid not in codes:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            codes[pid] = os.waitpid(pid, 0)[1]


def any_tmp(ckdir: str) -> bool:
    """Whether a save is being written (a temporary entry exists)."""
    return any(n.startswith(TMP_PREFIX) for n in os.listdir(ckdir))


def all_exist(paths: list[str]) -> bool:
    return all(os.path.exists(p) for p in paths)


def visible_state(ckdir: str) -> tuple[int, int]:
    """(newest committed step, committed checkpoints that do not match their marker or do not load)."""
    storage = open_storage(ckdir)
    records: list[Record] = [r for r, _ in storage.records() if r is not None]
    bad = 0
    for record in records:
        if storage.check(record, deep=True) is not None:
            bad += 1
        elif record.kind != "dir":
            try:
                ckpt = torch.load(storage.path(record.name), weights_only=True, map_location="cpu")
                bad += int(ckpt["global_step"] != record.global_step)
            except Exception:
                bad += 1
    newest = max(records, key=order).global_step if records else 0
    return newest, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=1000)
    parser.add_argument("--workdir", default="sigkill_fuzz_work")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated subset of {STRATEGIES}")
    parser.add_argument("--moments", default=",".join(MOMENTS), help=f"comma-separated subset of {MOMENTS}")
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="start no new trial after this long (the count run is printed)"
    )
    parser.add_argument("--hang-after", type=float, default=120.0, help="seconds before a run counts as hung")
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    moments = [m for m in args.moments.split(",") if m]
    for flag, given, allowed in (("--strategies", strategies, STRATEGIES), ("--moments", moments, MOMENTS)):
        unknown = sorted(set(given) - set(allowed))
        if unknown or not given:
            parser.error(f"{flag}: unknown {unknown or 'none given'}; allowed: {', '.join(allowed)}")
    if args.kills < 1:
        parser.error(f"--kills={args.kills}: must be at least 1")
    rng = random.Random(args.seed)
    os.makedirs(args.workdir, exist_ok=True)
    log = os.path.join(args.workdir, "ranks.log")
    expected = dict.fromkeys(strategies, 0)  # the newest committed step of each strategy's directory
    for strategy in strategies:
        shutil.rmtree(os.path.join(args.workdir, f"ckpts.{strategy}"), ignore_errors=True)
    tally: dict[str, Any] = {
        "kills_asked": args.kills, "kills": 0, "kills_landed": 0, "resumes_checked": 0, "resumes_at_newest": 0,
        "resume_failures": 0, "partial_visible": 0, "hangs": 0, "survivor_exits": 0, "ended_clean_before_the_kill": 0,
    }  # fmt: skip
    per_moment = {m: {"kills": 0, "landed": 0} for m in moments}
    per_strategy = dict.fromkeys(strategies, 0)
    lost: list[int] = []
    resume_seconds = dict.fromkeys(strategies, 0.5)  # setup to first step of the last resumed run, per strategy
    survivor_seconds: dict[str, float] = {}  # per strategy: the longest a survivor took to end on its own
    started = time.monotonic()
    trial = 0
    while tally["kills"] < args.kills:
        if args.max_minutes is not None and time.monotonic() - started > args.max_minutes * 60:
            print(f"stopped after {tally['kills']} kills: --max-minutes={args.max_minutes} reached", file=sys.stderr)
            break
        strategy = strategies[trial % len(strategies)]
        moment = moments[(trial // len(strategies)) % len(moments)]
        trial += 1
        ckdir = os.path.join(args.workdir, f"ckpts.{strategy}")
        progress = os.path.join(args.workdir, f"progress.{trial}")
        flags = os.path.join(args.workdir, f"flag.{trial}")
        resuming = expected[strategy] > 0
        if moment == "resume" and not resuming:
            moment = "random"  # nothing to resume from yet in this directory
        max_steps = expected[strategy] + (3 if moment == "agreement" else 10**6)
        log_at = os.path.getsize(log) if os.path.exists(log) else 0
        pids = spawn((free_port(), ckdir, progress, strategy, max_steps, flags), log)
        codes: dict[int, int] = {}
        landed = False
        victims = pids
        set_up = functools.partial(lambda path: read_progress(path)[0], progress)
        training = functools.partial(lambda path: read_progress(path)[1] is not None, progress)
        wait_for(set_up, args.hang_after, pids, codes)
        t_setup = time.monotonic()
        if moment == "resume":
            # somewhere between setup and the first step: cleanup, claim, agreeing on and loading "latest"
            time.sleep(rng.uniform(0.0, resume_seconds[strategy]))
            landed = not training()
        else:
            if not wait_for(training, args.hang_after, pids, codes):
                kill(pids, codes)
                tally["resume_failures"] += 1
                print(f"trial {trial} ({strategy}): the run did not start (see {log} at {log_at})", file=sys.stderr)
                continue
            if resuming:
                resume_seconds[strategy] = time.monotonic() - t_setup
            if moment == "random":
                time.sleep(rng.uniform(0.0, 1.0))
                landed = True
            elif moment == "mid_save":
                saving = functools.partial(any_tmp, ckdir)
                landed = wait_for(saving, 10, pids, codes)
                time.sleep(rng.uniform(0.0, 0.002))
            elif moment == "retention_delete":
                landed = wait_for(lambda: os.path.exists(f"{flags}.deleting"), 20, pids, codes)  # noqa: B023
                time.sleep(rng.uniform(0.0, 0.05))
            else:  # agreement: one rank dies in it, the other must end by itself
                victim = trial // len(strategies) % 2
                # both ranks inside the agreement at once (each flag exists only while its rank is in it)
                both_in = functools.partial(all_exist, [f"{flags}.agree.{r}" for r in (0, 1)])
                landed = wait_for(both_in, 30, pids, codes)
                victims = [pids[victim]]
        _, start, _ = read_progress(progress)
        if start is not None and resuming:
            tally["resumes_checked"] += 1
            if start == expected[strategy]:
                tally["resumes_at_newest"] += 1
            else:
                tally["resume_failures"] += 1
                print(f"trial {trial} ({strategy}): resumed at {start}, newest committed {expected[strategy]}",
                      file=sys.stderr)  # fmt: skip
        if codes and all(code == 0 for code in codes.values()):  # the run finished cleanly before the moment came
            tally["ended_clean_before_the_kill"] += 1
        elif codes:
            print(f"trial {trial} ({strategy}, {moment}): a rank ended before the kill: {codes} (see {log})",
                  file=sys.stderr)  # fmt: skip
            tally["resume_failures"] += 1
        kill(victims, codes)
        if len(victims) < len(pids):  # the survivor must notice and end within the bound
            t0 = time.monotonic()
            if wait_all(pids, codes, args.hang_after):
                tally["survivor_exits"] += 1
                took = time.monotonic() - t0
                survivor_seconds[strategy] = max(survivor_seconds.get(strategy, 0.0), round(took, 1))
            else:
                tally["hangs"] += 1
                print(f"trial {trial} ({strategy}, agreement): the surviving rank hung", file=sys.stderr)
                kill(pids, codes)
        tally["kills"] += 1
        tally["kills_landed"] += int(landed)
        per_moment[moment]["kills"] += 1
        per_moment[moment]["landed"] += int(landed)
        per_strategy[strategy] += 1
        newest, bad = visible_state(ckdir)
        tally["partial_visible"] += bad
        if bad:
            print(f"trial {trial} ({strategy}, {moment}): {bad} visible checkpoint(s) do not load", file=sys.stderr)
        _, _, reached = read_progress(progress)
        if reached is not None and moment != "resume":
            lost.append(max(reached - newest, 0))
        expected[strategy] = newest
        for name in os.listdir(args.workdir):
            if name.startswith((f"flag.{trial}.", f"progress.{trial}")):
                os.unlink(os.path.join(args.workdir, name))
    # a last run of each strategy resumes at its newest step and ends cleanly
    final_ok = 0
    for strategy in strategies:
        ckdir = os.path.join(args.workdir, f"ckpts.{strategy}")
        progress = os.path.join(args.workdir, f"progress.final.{strategy}")
        pids = spawn((free_port(), ckdir, progress, strategy, expected[strategy] + 2, progress + ".flag"), log)
        codes = {}
        hung = not wait_all(pids, codes, args.hang_after)
        kill(pids, codes)
        tally["hangs"] += int(hung)
        _, start, reached = read_progress(progress)
        ok = not hung and all(s == 0 for s in codes.values()) and start == expected[strategy]
        ok = ok and reached == expected[strategy] + 2 and visible_state(ckdir) == (expected[strategy] + 2, 0)
        final_ok += int(ok)
        if not ok:
            print(f"final run ({strategy}): start {start}, reached {reached}, exits {codes}", file=sys.stderr)
    result = {
        **tally,
        "kills_per_moment": per_moment,
        "kills_per_strategy": per_strategy,
        "median_steps_lost": statistics.median(lost) if lost else 0,
        "max_steps_lost": max(lost) if lost else 0,
        "max_survivor_exit_seconds": survivor_seconds,
        "final_runs_ok": final_ok,
        "final_runs": len(strategies),
        "save_interval_steps": 1,
        "total_seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result))
    ok = (
        tally["resume_failures"] == 0 and tally["partial_visible"] == 0 and tally["hangs"] == 0
        and tally["resumes_at_newest"] == tally["resumes_checked"] and result["median_steps_lost"] <= 1
        and final_ok == len(strategies)
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
