"""Kill a worker of a torchrun job at a random moment, many times: does the job finish by itself, every time?

Each trial launches the plain command users run,
``torchrun --nnodes=1 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT``,
on a training script with a stock Trainer from ``lplugins.compose(strategy="ddp_timeout")``, a
``durable_checkpoint`` every ``--every`` steps and ``fit(ckpt_path="latest")`` (gloo, CPU, torchrun's
default environment), and SIGKILLs one worker (rank chosen at random) when rank 0 has logged a random
step, after a random fraction of a step. torchrun restarts the group; the job must end with exit
status 0 at the final step. Per trial it records:

* whether the job completed (exit 0, the final step reached), else why (a hang: no exit within
  ``--trial-timeout``; Gloo's ``connectFullMesh failed``: a stale address; other);
* steps lost: the last step logged before the kill minus the step the restart resumed from;
* restart-to-step: seconds from the kill to the first step after the restart;
* fresh start-up: seconds from launching torchrun to the first step of the same job (a fresh
  run, measured in every trial), the baseline the restart is compared with (goal: restart-to-step
  within 2x of the same trial's fresh start-up);
* whether the surviving rank of a kill during a save (it waits in the save's agreement) ended at
  torchrun's SIGTERM (lplugins' one-line message) instead of at torchrun's SIGKILL 30 s later.

``--in-save-trials N`` runs N more ``ddp_timeout`` trials whose kill lands while a checkpoint is being
written (rank 0's write made ``--save-sleep`` seconds slow; the victim is rank 0 or 1 at random), the
case where the survivor waits in the save's agreement. ``--stock-trials N`` runs N more trials with
Lightning's own ``strategy="ddp"`` (no per-attempt store): the same kill, side by side.

Usage::

    python benchmarks/elastic_trials.py --trials 50 --in-save-trials 20 --stock-trials 14

Prints one line per trial, a summary, and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

TRAIN = r"""
import json, os, time
import lightning.pytorch as pl
import lplugins
from tests.models import Regression, regression_loader

local = int(os.environ["LOCAL_WORLD_SIZE"])


class StepLog(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.is_global_zero:
            with open("steps.jsonl", "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "t": time.time(),
                                    "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}) + "\n")
        time.sleep(float(os.environ["STEP_SLEEP"]))


if os.environ.get("SAVE_SLEEP") and os.environ["RANK"] == "0" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    from lplugins.callbacks import _writer  # a slow save: the harness kills a worker while it is in progress

    write_file = _writer.CheckpointWriter.write_file

    def slow_write(self, record, checkpoint):
        with open("saving", "a") as f:
            f.write(record.name + "\n")
        time.sleep(float(os.environ["SAVE_SLEEP"]))
        return write_file(self, record, checkpoint)

    _writer.CheckpointWriter.write_file = slow_write

kwargs = lplugins.compose(
    strategy=os.environ["STRATEGY"], accelerator="cpu", devices=local,
    num_nodes=int(os.environ["WORLD_SIZE"]) // local, max_steps=int(os.environ["STEPS"]),
    callbacks=[{"name": "durable_checkpoint", "dirpath": "ck", "every_n_steps": int(os.environ["EVERY"])}],
    logger=False, enable_progress_bar=False, enable_model_summary=False,
)
kwargs["callbacks"].append(StepLog())
trainer = pl.Trainer(**kwargs)
trainer.fit(Regression(hidden=(32, 32), seed=0), regression_loader(n=8192, batch_size=8), ckpt_path="latest")
if trainer.is_global_zero:
    print("FINAL_STEP", trainer.global_step, flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            kids += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in descendants(k)]


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v[5:]) for v in env if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def saves_started(work: Path) -> int:
    path = work / "saving"
    return len(path.read_text().splitlines()) if path.exists() else 0


def trial(
    args: argparse.Namespace, strategy: str, rng: random.Random, workdir: Path, in_save: bool = False
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="trial", dir=workdir))
    (work / "train.py").write_text(TRAIN)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHELASTIC_", "PYTEST_")) and k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        STRATEGY=strategy,
        STEPS=str(args.steps),
        EVERY=str(args.every),
        STEP_SLEEP=str(args.step_sleep),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    if in_save:
        env["SAVE_SLEEP"] = str(args.save_sleep)
    kill_step = rng.randint(1, args.steps - args.every - 1)
    kill_delay = rng.random() * args.step_sleep
    victim_rank = rng.randint(0, 1)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=3",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "train.py",
    ]  # fmt: skip
    launched = time.time()
    job = subprocess.Popen(
        command,
        cwd=work,
        env=env,
        stdout=open(work / "out.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    killed_at: float | None = None
    last_before_kill = 0
    try:
        deadline = time.monotonic() + args.trial_timeout
        while job.poll() is None and time.monotonic() < deadline:
            if killed_at is None:
                steps = read_steps(work / "steps.jsonl")
                if steps and steps[-1]["step"] >= kill_step:
                    if in_save:  # wait for the next save, then kill while rank 0 is in it
                        started = saves_started(work)
                        while saves_started(work) == started and job.poll() is None:
                            if time.monotonic() > deadline:
                                break
                            time.sleep(0.01)
                        kill_delay = rng.random() * args.save_sleep * 0.8
                    time.sleep(kill_delay)
                    victims = [p for p in descendants(job.pid) if rank_of(p) == victim_rank]
                    if victims:
                        os.kill(victims[0], signal.SIGKILL)
                        killed_at = time.time()
                        last_before_kill = max(s["step"] for s in read_steps(work / "steps.jsonl"))
            time.sleep(0.02)
        code = job.poll()
    finally:
        for pid in [*descendants(job.pid), job.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.wait()
    log = (work / "out.log").read_text(errors="replace")
    steps = read_steps(work / "steps.jsonl")
    completed = code == 0 and f"FINAL_STEP {args.steps}" in log
    resumed = re.findall(r"ckpt_path='latest': resuming from \S*step=(\d+)", log)
    after = [s for s in steps if s["restart"] >= 1]
    result: dict[str, Any] = {
        "strategy": strategy + (" (kill in a save)" if in_save else ""),
        "completed": completed,
        "killed": killed_at is not None,
        "kill_step": kill_step,
        "victim_rank": victim_rank,
        "fresh_startup_s": steps[0]["t"] - launched if steps else None,
        "why": None
        if completed
        else ("hang" if code is None else "connectFullMesh" if "connectFullMesh failed" in log else f"exit {code}"),
    }
    if killed_at is not None and after:
        resumed_step = int(resumed[-1]) if resumed else 0  # killed before the first commit: from scratch
        result["resumed_step"] = resumed_step
        result["steps_lost"] = last_before_kill - resumed_step
        result["restart_to_step_s"] = after[0]["t"] - killed_at
        if result["fresh_startup_s"]:
            result["restart_over_fresh"] = result["restart_to_step_s"] / result["fresh_startup_s"]
    # the survivor of a kill during a save's agreement ends at torchrun's SIGTERM (not 30 s later at its SIGKILL)
    result["survivor_ended_at_sigterm"] = "neither answered nor got the signal" in log
    if completed and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        result["workdir"] = str(work)
    return result


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in results if r["completed"]]
    lost = [r["steps_lost"] for r in results if "steps_lost" in r]
    restart = [r["restart_to_step_s"] for r in results if "restart_to_step_s" in r]
    fresh = [r["fresh_startup_s"] for r in results if r["fresh_startup_s"] is not None]
    whys: dict[str, int] = {}
    for r in results:
        if not r["completed"]:
            whys[r["why"]] = whys.get(r["why"], 0) + 1
    return {
        "trials": len(results),
        "completed": len(done),
        "failures": whys,
        "steps_lost_max": max(lost) if lost else None,
        "steps_lost_mean": statistics.mean(lost) if lost else None,
        "restart_to_step_s_median": statistics.median(restart) if restart else None,
        "restart_to_step_s_max": max(restart) if restart else None,
        "fresh_startup_s_median": statistics.median(fresh) if fresh else None,
        "restarts_within_2x_fresh": sum(1 for r in results if r.get("restart_over_fresh", 99) <= 2.0),
        "restarts": len(restart),
        "survivors_ended_at_sigterm": sum(1 for r in results if r.get("survivor_ended_at_sigterm")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50, help="trials with lplugins' ddp_timeout (default 50)")
    parser.add_argument("--stock-trials", type=int, default=0, help="trials with Lightning's stock 'ddp' (default 0)")
    parser.add_argument("--steps", type=int, default=60, help="max_steps of each job")
    parser.add_argument("--every", type=int, default=5, help="save interval (steps)")
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds each step sleeps on every rank")
    parser.add_argument("--trial-timeout", type=float, default=120.0, help="seconds before a job counts as hung")
    parser.add_argument(
        "--in-save-trials", type=int, default=0, help="more ddp_timeout trials that kill while a save is in progress"
    )
    parser.add_argument("--save-sleep", type=float, default=1.0, help="seconds rank 0's write takes in those")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory of every trial")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    if args.every >= args.steps - 2:
        parser.error(f"--every={args.every} must be well below --steps={args.steps}")
    rng = random.Random(args.seed)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="elastic_trials"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"ddp_timeout": [], "ddp": [], "in_save": []}
    plan = ["ddp_timeout"] * args.trials + ["ddp"] * args.stock_trials + ["in_save"] * args.in_save_trials
    rng.shuffle(plan)  # interleaved: all see the same machine load
    for i, kind in enumerate(plan):
        result = trial(args, "ddp_timeout" if kind == "in_save" else kind, rng, workdir, in_save=kind == "in_save")
        runs[kind].append(result)
        print(f"[{i + 1}/{len(plan)}] {json.dumps(result)}", flush=True)
    ours, stock = summary(runs["ddp_timeout"]), summary(runs["ddp"])
    print(f"lplugins ddp_timeout: {ours}")
    if args.stock_trials:
        print(f"stock ddp:            {stock}")
    in_save = summary(runs["in_save"])
    if args.in_save_trials:
        print(f"kills during a save:  {in_save}")
    restart, fresh = ours["restart_to_step_s_median"], ours["fresh_startup_s_median"]
    out = {
        "trials": ours["trials"],
        "completed": ours["completed"],
        "completed_pct": 100.0 * ours["completed"] / max(1, ours["trials"]),
        "save_interval_steps": args.every,
        "steps_lost_max": ours["steps_lost_max"],
        "steps_lost_mean": ours["steps_lost_mean"],
        "restart_to_step_median_s": restart,
        "restart_to_step_max_s": ours["restart_to_step_s_max"],
        "fresh_startup_median_s": fresh,
        "restart_to_step_over_fresh_startup_ratio": restart / fresh if restart and fresh else None,
        "restarts_within_2x_fresh_startup": ours["restarts_within_2x_fresh"],
        "restarts_measured": ours["restarts"],
        "survivors_ended_at_sigterm_in_save": ours["survivors_ended_at_sigterm"],
        "in_save_trials": in_save["trials"],
        "in_save_completed": in_save["completed"],
        "in_save_restart_to_step_median_s": in_save["restart_to_step_s_median"],
        "in_save_restart_to_step_max_s": in_save["restart_to_step_s_max"],
        "in_save_restarts_within_2x_fresh_startup": in_save["restarts_within_2x_fresh"],
        "in_save_survivors_ended_at_sigterm": in_save["survivors_ended_at_sigterm"],
        "stock_ddp_trials": stock["trials"],
        "stock_ddp_completed": stock["completed"],
        "stock_ddp_failures": stock["failures"],
        "stock_ddp_completed_pct": 100.0 * stock["completed"] / stock["trials"] if stock["trials"] else None,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
