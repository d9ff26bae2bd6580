"""Per-step cost of lplugins' metric logging vs stock Lightning ``self.log`` of the same metrics.

Same process, same model, same data, variants interleaved round by round:

* ``stock``: the LightningModule updates torchmetrics in ``training_step`` and logs them with
  ``self.log(name, metric, on_step=True)`` (Lightning's documented way), plus the loss.
* ``stock_windowed``: the hand-written equivalent of what MetricsCallback does: ``update`` every step,
  ``self.log_dict(metrics.compute())`` and ``reset()`` every ``log_every_n_steps`` steps (the tightest
  baseline: it shows the callback's own overhead).
* ``lplugins_metrics``: the step returns ``{"loss", "preds", "target"}``; ``MetricsCallback`` updates,
  syncs and logs the same metrics once per window; the loss is logged with ``self.log``.
* ``lplugins_all``: the same plus ``ThroughputCallback`` (samples/s, tokens/s).

The per-step time is the mean interval between consecutive ``on_train_batch_start`` calls after a
warm-up, so it includes every hook, the logger connector and the CSV logger. Usage::

    python benchmarks/bench_logging.py [--steps 300] [--rounds 5] [--hidden 256] [--batch 64]

The last line of output is one JSON object (units in the key names).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lplugins.metrics import MetricsCallback, ThroughputCallback

CLASSES = 10
FEATURES = 32
LOG_EVERY = 50


def make_metrics() -> torchmetrics.MetricCollection:
    return torchmetrics.MetricCollection(
        {
            "acc": torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES),
            "f1": torchmetrics.classification.MulticlassF1Score(num_classes=CLASSES, average="macro"),
        }
    )


class Model(LightningModule):
    def __init__(self, hidden: int, mode: str) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, CLASSES),
        )  # fmt: skip
        self.mode = mode
        self.train_metrics = make_metrics().clone(prefix="train/") if mode.startswith("stock") else None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.net(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.log("train/loss", loss, on_step=True)
        if self.mode == "stock":
            self.train_metrics(logits, y)  # type: ignore[misc]
            self.log_dict(self.train_metrics, on_step=True, on_epoch=False)  # type: ignore[arg-type]
            return loss
        if self.mode == "stock_windowed":
            assert self.train_metrics is not None
            self.train_metrics.update(logits.detach(), y)
            if (batch_idx + 1) % LOG_EVERY == 0:
                self.log_dict(self.train_metrics.compute(), on_step=True, on_epoch=False)
                self.train_metrics.reset()
            return loss
        return {"loss": loss, "preds": logits.detach(), "target": y}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepTimer(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.starts: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append((time.process_time(), time.perf_counter()))

    def step_seconds(self) -> tuple[float, float]:
        """(CPU seconds of this process per step, wall seconds per step)."""
        (cpu0, wall0), (cpu1, wall1) = self.starts[self.warmup], self.starts[-1]
        steps = len(self.starts) - self.warmup - 1
        return (cpu1 - cpu0) / steps, (wall1 - wall0) / steps


def run(variant: str, loader: DataLoader, steps: int, hidden: int, warmup: int) -> tuple[float, float]:
    torch.manual_seed(0)
    timer = StepTimer(warmup)
    callbacks: list[Callback] = [timer]
    if variant.startswith("lplugins"):
        callbacks.append(MetricsCallback(make_metrics(), stages=["train"], log_every_n_steps=LOG_EVERY))
    if variant == "lplugins_all":
        callbacks.append(ThroughputCallback(log_every_n_steps=LOG_EVERY, seq_len=FEATURES))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps + warmup + 1,
            logger=CSVLogger(tmp, name="bench"),
            log_every_n_steps=LOG_EVERY,
            callbacks=callbacks,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Model(hidden, mode=variant), loader)
    return timer.step_seconds()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        import logging

        logging.getLogger(name).setLevel(logging.ERROR)
    n = args.batch * (args.steps + args.warmup + 1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
    loader = DataLoader(data, batch_size=args.batch, shuffle=False)
    variants = ("stock", "stock_windowed", "lplugins_metrics", "lplugins_all")
    clocks = ("cpu", "wall")
    times: dict[str, dict[str, list[float]]] = {c: {v: [] for v in variants} for c in clocks}
    pairs = [(v, base) for v in variants[2:] for base in variants[:2]]
    ratios: dict[str, dict[tuple[str, str], list[float]]] = {c: {p: [] for p in pairs} for c in clocks}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else tuple(reversed(variants))  # no variant always first
        current = {v: run(v, loader, args.steps, args.hidden, args.warmup) for v in order}
        for i, clock in enumerate(clocks):
            for v in variants:
                times[clock][v].append(current[v][i])
            for v, base in pairs:
                ratios[clock][(v, base)].append(current[v][i] / current[base][i])
        print(
            f"round {r}: " + ", ".join(f"{v} {current[v][0] * 1e3:.3f} cpu-ms/step" for v in variants),
            file=sys.stderr,
            flush=True,
        )
    result: dict[str, Any] = {
        "steps_per_run": args.steps,
        "rounds": args.rounds,
        "batch_size": args.batch,
        "hidden": args.hidden,
        "log_every_n_steps": LOG_EVERY,
    }
    for clock in clocks:
        for v in variants:
            result[f"{v}_{clock}_ms_per_step"] = round(statistics.median(times[clock][v]) * 1e3, 4)
    for clock in clocks:
        for v, base in pairs:
            result[f"ratio_{clock}_{v}_vs_{base}"] = round(statistics.median(ratios[clock][(v, base)]), 4)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
