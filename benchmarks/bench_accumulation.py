"""Benchmark: lplugins AccumulationScheduler vs Lightning's GradientAccumulationScheduler.

Both train the same model on the same data with the same epoch-keyed schedule, in the same
process, interleaved (lplugins, Lightning, lplugins, ...) so that machine noise hits both alike.
Timed with the process's CPU time (``--wall`` for wall-clock time); torch uses one thread.
Reported: the time per optimizer step (median loop-iteration time x micro-batches per step; epoch
0 excluded as warm-up) and the ratio lplugins / Lightning: the median over repeats of the ratio of
two back-to-back runs (robust to the load of a shared machine drifting), plus pooled ratios.
The last line of output is one JSON object.

Run: ``.venv/bin/python benchmarks/bench_accumulation.py [--repeats 12] [--batches 32] [--epochs 6]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lplugins

SCHEDULE = {0: 8, 2: 4, 4: 2}
#: The clock: CPU time of this process (set to time.perf_counter by --wall). On a machine shared with
#: other jobs, wall time mostly measures their load; CPU time measures the work done.
CLOCK = time.process_time


class MLP(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Timer(pl.Callback):
    """Per-epoch optimizer steps and micro-batch counts, and the wall time of every loop iteration.

    An iteration is timed from one ``on_train_batch_start`` to the next, so it includes every
    callback hook, the forward/backward pass and the optimizer step, whatever the callback order.
    """

    def __init__(self) -> None:
        self.epochs: list[tuple[int, int]] = []  # (optimizer steps, micro-batches)
        self.iterations: list[list[float]] = []  # per epoch

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._steps0 = trainer.global_step
        self._last: float | None = None
        self.iterations.append([])

    def on_train_batch_start(self, *args: Any) -> None:
        now = CLOCK()
        if self._last is not None:
            self.iterations[-1].append(now - self._last)
        self._last = now

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.epochs.append((trainer.global_step - self._steps0, len(self.iterations[-1]) + 1))


def run(kind: str, loader: DataLoader, epochs: int, width: int) -> Timer:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    timer = Timer()
    common: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": epochs,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    if kind == "lplugins":
        trainer = pl.Trainer(**lplugins.compose(accumulate_grad_batches=dict(SCHEDULE), callbacks=[timer], **common))
    else:
        trainer = pl.Trainer(callbacks=[GradientAccumulationScheduler(dict(SCHEDULE)), timer], **common)
    trainer.fit(MLP(width), loader)
    return timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--batches", type=int, default=32, help="micro-batches per epoch")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--wall", action="store_true", help="time with the wall clock instead of CPU time")
    args = parser.parse_args()
    global CLOCK
    if args.wall:
        CLOCK = time.perf_counter
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n = args.batches * args.batch_size
    loader = DataLoader(TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, 1, generator=g)), args.batch_size)

    iterations: dict[str, list[float]] = {"lplugins": [], "lightning": []}
    epochs_seen: dict[str, list[tuple[int, int]]] = {}
    paired: list[float] = []  # per repeat: median iteration ratio of the two back-to-back runs
    for repeat in range(args.repeats):
        order = ("lplugins", "lightning") if repeat % 2 == 0 else ("lightning", "lplugins")
        this_repeat: dict[str, list[float]] = {}
        for kind in order:
            timer = run(kind, loader, args.epochs, args.width)
            epochs_seen[kind] = timer.epochs
            this_repeat[kind] = [t for times in timer.iterations[1:] for t in times]  # epoch 0 is warm-up
            iterations[kind].extend(this_repeat[kind])
        paired.append(statistics.median(this_repeat["lplugins"]) / statistics.median(this_repeat["lightning"]))
    if epochs_seen["lplugins"] != epochs_seen["lightning"]:
        raise SystemExit(f"optimizer steps / micro-batches per epoch differ: {epochs_seen}")
    steps = sum(s for s, _ in epochs_seen["lplugins"][1:])
    batches = sum(b for _, b in epochs_seen["lplugins"][1:])
    # both runs make the same optimizer steps from the same micro-batches, so time per step is
    # (typical iteration time) x (micro-batches per step); medians over many iterations resist the noise
    # of a shared machine better than totals do
    per_batch = {kind: statistics.median(times) for kind, times in iterations.items()}
    per_step = {kind: per_batch[kind] * batches / steps for kind in per_batch}
    mean_ratio = statistics.fmean(iterations["lplugins"]) / statistics.fmean(iterations["lightning"])
    ratio = statistics.median(paired)  # pairs cancel slow drifts of the machine's load
    print(f"schedule {SCHEDULE}, {args.batches} micro-batches x {args.batch_size} per epoch, {args.epochs} epochs")
    print(f"(optimizer steps, micro-batches) per epoch, both: {epochs_seen['lplugins']}; {args.repeats} repeats")
    print(
        f"per optimizer step: lplugins {per_step['lplugins'] * 1e3:.3f} ms, Lightning "
        f"{per_step['lightning'] * 1e3:.3f} ms; ratio (median of {len(paired)} paired runs) {ratio:.4f}, "
        f"pooled medians {per_step['lplugins'] / per_step['lightning']:.4f}, means {mean_ratio:.4f}"
    )
    result = {
        "lplugins_ms_per_step": round(per_step["lplugins"] * 1e3, 4),
        "lightning_ms_per_step": round(per_step["lightning"] * 1e3, 4),
        "ratio_per_step": round(ratio, 4),
        "ratio_pooled_medians": round(per_step["lplugins"] / per_step["lightning"], 4),
        "ratio_of_means": round(mean_ratio, 4),
        "ratio_paired_min": round(min(paired), 4),
        "ratio_paired_max": round(max(paired), 4),
        "lplugins_ms_per_micro_batch": round(per_batch["lplugins"] * 1e3, 4),
        "lightning_ms_per_micro_batch": round(per_batch["lightning"] * 1e3, 4),
        "iterations_per_side": len(iterations["lplugins"]),
        "repeats": args.repeats,
        "clock": "wall" if args.wall else "process_cpu",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
