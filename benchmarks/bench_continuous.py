"""Continuous checkpointing (``DurableCheckpoint(continuous=True, async_save=True)``) vs none, 2 CPU ranks.

``--strategy ddp`` (default) or ``fsdp2`` (FSDP2's full-state checkpoint: gathered to rank 0, written there);
``--strategy fsdp2 --sharded``: ``save_distributed_checkpoint=True``, every rank snapshots its own shards and
writes them in the background (torch DCP), rank 0 commits.

Side by side in one run, interleaved, ``--reps`` times each (median):

* ``none``: stock Lightning, no checkpoint callback (the baseline);
* ``continuous``: the default: a new asynchronous save starts at the first step boundary after the previous
  one has committed and the pacer's rest is over (``max_slowdown=0.03``; ``keep_last=2``);
* ``continuous_unpaced``: ``max_slowdown=None``, a new save at the first boundary after each commit;
* ``continuous_same_priority`` (only with ``--same-priority``): unpaced, with the background writer at
  the training thread's CPU priority instead of ``nice`` +10 (what lowering it buys on busy cores);
* ``stock_every_step`` (only with ``--stock``): stock ``ModelCheckpoint(every_n_train_steps=1)`` for
  reference (what a user gets today for "save every step": a synchronous save on rank 0 at every step).

A ~``--params-m`` million-parameter MLP with Adam (fp32: 12 bytes of state per parameter on every rank,
written by rank 0). Figures: throughput of each vs ``none`` (steps per second after ``--warmup`` steps),
the training thread's blocking time per continuous save (p50, p99) against ``state bytes / memcpy
bandwidth`` measured in this run (one ``Tensor.copy_`` of the state's size, one thread), how many steps
apart continuous saves landed, and rank 0's peak resident memory above the ``none`` run, over the state size.
Throughput is also given from step ``--steady`` on (``*_steady_*``): after the first continuous save, which
the pacer uses to time steps with a save in flight (a one-time cost).

Usage::

    python benchmarks/bench_continuous.py [--strategy ddp] [--params-m 100] [--reps 5] [--steps 100] [--batch 8]

Ends with one line of JSON (units in the key names).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

CONFIGS = ("none", "continuous", "continuous_unpaced", "stock_every_step", "continuous_same_priority")
WIDTH = 4096


def worker(
    config: str,
    strategy: str,
    params_m: float,
    steps: int,
    warmup: int,
    steady: int,
    dirpath: str,
    batch: int,
    sharded: bool = False,
) -> None:
    """One 2-rank fit (Lightning's launcher starts rank 1 by running this command again); prints per-rank JSON."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lplugins.callbacks import DurableCheckpoint
    from lplugins.strategies import FSDP2Strategy

    torch.set_num_threads(1)
    depth = max(1, round(params_m * 1e6 / (WIDTH * WIDTH)))

    class MLP(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(depth)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-5)

    class Clock(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.saved_steps: list[int] = []  # the steps continuous saves were taken at

        def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
            # the checkpoint callback ran last at the previous boundary: a new stall is a save of that step
            if durable is not None and len(durable.save_stalls) > len(self.saved_steps):
                self.saved_steps.append(trainer.global_step)

        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            self.ends.append(time.perf_counter())

    clock = Clock()
    callbacks: list[Callback] = [clock]
    durable = None
    if config == "continuous_same_priority":
        from lplugins.callbacks import _background

        _background.WRITER_NICE = 0
    if config.startswith("continuous"):
        paced = {} if config == "continuous" else {"max_slowdown": None}
        durable = DurableCheckpoint(
            dirpath, continuous=True, async_save=True, keep_last=2, save_on_train_end=False, **paced
        )
        callbacks.append(durable)
    elif config == "stock_every_step":
        callbacks.append(ModelCheckpoint(dirpath, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max"))
    data = DataLoader(TensorDataset(torch.randn(batch * (steps + 1), WIDTH)), batch_size=batch)
    fsdp2 = FSDP2Strategy(save_distributed_checkpoint=sharded) if strategy == "fsdp2" else None
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=fsdp2 or "ddp",
        max_steps=steps, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=config != "none",
    )  # fmt: skip
    model = MLP()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    trainer.fit(model, data)
    after = resource.getrusage(resource.RUSAGE_SELF)
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())  # weights + Adam's two moments
    timed = clock.ends[warmup:]
    steady_timed = clock.ends[steady:]
    result = {
        "config": config,
        "rank": trainer.global_rank,
        "steps_per_s": (len(timed) - 1) / (timed[-1] - timed[0]),
        "steady_steps_per_s": (len(steady_timed) - 1) / (steady_timed[-1] - steady_timed[0]),
        "peak_rss_bytes": after.ru_maxrss * 1024,
        "cpu_s": after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime,  # every thread of the rank
        "state_bytes": state_bytes,
        "stalls_s": durable.save_stalls if durable else [],
        "saved_steps": clock.saved_steps,
        "saves": len(durable.save_stalls) if durable else 0,
    }
    print("RESULT " + json.dumps(result), flush=True)


def memcpy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes per second of one single-threaded ``Tensor.copy_`` of ``nbytes`` (the best of ``reps``)."""
    import torch

    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def run(config: str, args: argparse.Namespace, root: str) -> dict[str, Any]:
    dirpath = os.path.join(root, config)
    shutil.rmtree(dirpath, ignore_errors=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", config, "--strategy", args.strategy]
    cmd += ["--params-m", str(args.params_m)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--steady", str(args.steady)]
    cmd += ["--dir", dirpath, "--batch", str(args.batch)] + (["--sharded"] if args.sharded else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    # the ranks share one stdout: one rank's line can land inside the other's, so each object is decoded where it starts
    decoder = json.JSONDecoder()
    results = [decoder.raw_decode(part)[0] for part in proc.stdout.split("RESULT ")[1:]]
    if proc.returncode != 0 or len(results) != 2:
        raise SystemExit(f"{config}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    shutil.rmtree(dirpath, ignore_errors=True)
    return next(r for r in results if r["rank"] == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp", help="the strategy of every run")
    parser.add_argument("--params-m", type=float, default=100.0, help="model size, millions of parameters")
    parser.add_argument("--reps", type=int, default=5, help="runs of each configuration (interleaved)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the throughput")
    parser.add_argument("--steady", type=int, default=15, help="first steps left out of the steady throughput")
    parser.add_argument("--batch", type=int, default=8, help="samples per step and rank (more: more compute per byte)")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--same-priority", action="store_true", help="also run continuous_same_priority")
    parser.add_argument("--stock", action="store_true", help="also run stock_every_step (slow: a sync save per step)")
    parser.add_argument("--sharded", action="store_true", help="fsdp2: sharded checkpoints (each rank its shards)")
    parser.add_argument("--no-unpaced", action="store_true", help="skip continuous_unpaced (the goal: paced)")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(
            args.worker, args.strategy, args.params_m, args.steps, args.warmup, args.steady, args.dir, args.batch,
            args.sharded,
        )  # fmt: skip
        return
    if args.sharded and args.strategy != "fsdp2":
        parser.error("--sharded needs --strategy fsdp2")
    if args.reps < 1 or args.steps < max(args.warmup, args.steady) + 3 or args.batch < 1:
        parser.error(
            "--reps and --batch must be >= 1 and --steps >= max(--warmup, --steady) + 3,"
            f" got {args.reps}, {args.batch} and {args.steps}"
        )
    root = args.dir or tempfile.mkdtemp(prefix="bench_continuous_")
    configs = list(CONFIGS[:2] if args.no_unpaced else CONFIGS[:3])
    configs += ["stock_every_step"] if args.stock else []
    configs += ["continuous_same_priority"] if args.same_priority else []
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for rep in range(args.reps):
        for config in configs:
            result = run(config, args, root)
            runs[config].append(result)
            print(f"rep {rep} {config}: {result['steps_per_s']:.3f} steps/s, saves {result['saves']}", flush=True)
    state = runs["none"][0]["state_bytes"]
    bandwidth = memcpy_bandwidth(state)
    rate = {c: statistics.median(r["steps_per_s"] for r in runs[c]) for c in configs}
    steady = {c: statistics.median(r["steady_steps_per_s"] for r in runs[c]) for c in configs}
    continuous = [c for c in ("continuous", "continuous_unpaced") if c in runs]
    stalls = sorted(s for c in continuous for r in runs[c] for s in r["stalls_s"][1:])  # the first builds buffers
    p99 = stalls[min(len(stalls) - 1, round(0.99 * (len(stalls) - 1)))] if stalls else float("nan")

    def gaps(config: str) -> list[int]:
        return [b - a for r in runs[config] for a, b in zip(r["saved_steps"], r["saved_steps"][1:], strict=False)]

    peak = statistics.median(r["peak_rss_bytes"] for r in runs["continuous"])
    base_peak = statistics.median(r["peak_rss_bytes"] for r in runs["none"])
    figures = {
        "strategy": args.strategy,
        "params_m": args.params_m,
        "sharded": args.sharded,
        "state_mb": round(state / 1e6, 1),
        "reps": args.reps,
        "steps": args.steps,
        "none_steps_per_s": round(rate["none"], 4),
        "continuous_throughput_ratio": round(rate["continuous"] / rate["none"], 3),
        "continuous_steady_throughput_ratio": round(steady["continuous"] / steady["none"], 3),
        "continuous_saves_per_run": statistics.median(r["saves"] for r in runs["continuous"]),
        "continuous_blocking_p50_ms": round(1e3 * statistics.median(stalls), 1) if stalls else None,
        "continuous_blocking_p99_ms": round(1e3 * p99, 1),
        "memcpy_gb_per_s": round(bandwidth / 1e9, 2),
        "blocking_bound_ms": round(1e3 * (1.2 * state / bandwidth) + 5, 1),
        "continuous_peak_extra_over_state": round((peak - base_peak) / state, 2),
        # what rank 0 holds of the state: all of it (DDP; FSDP2 gathers it there), or its shards (--sharded)
        "continuous_peak_extra_over_rank_state": round((peak - base_peak) / (state / (2 if args.sharded else 1)), 2),
        "batch": args.batch,
        "continuous_rank0_extra_cpu_s_per_save": round(
            statistics.median(
                (c["cpu_s"] - n["cpu_s"]) / max(1, c["saves"])
                for c, n in zip(runs["continuous"], runs["none"], strict=True)
            ),
            3,
        ),
    }
    if "continuous_unpaced" in runs:
        figures["continuous_unpaced_throughput_ratio"] = round(rate["continuous_unpaced"] / rate["none"], 3)
        figures["continuous_unpaced_saves_per_run"] = statistics.median(r["saves"] for r in runs["continuous_unpaced"])
    if args.stock:
        figures["stock_every_step_throughput_ratio"] = round(rate["stock_every_step"] / rate["none"], 3)
    if args.same_priority:
        figures["continuous_same_priority_throughput_ratio"] = round(rate["continuous_same_priority"] / rate["none"], 3)
    for config in continuous:
        if gaps(config):
            figures[f"{config}_median_steps_between_saves"] = statistics.median(gaps(config))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
