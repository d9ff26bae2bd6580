"""Per-step cost of the collective watchdog on 2-process DDP (gloo, CPU): on vs off, in the same run.

One job of two ranks (started as separate processes, as torchrun does), one ``Trainer.fit`` of
``--rounds`` x 2 epochs; each round is one epoch with the watchdog off and one with it on, in
alternating order (``off, on, on, off, off, on, ...``: ABBA, both ranks switching together at the
epoch boundary), so drift of the machine and the order within a round affect both alike. The
per-step time is the median interval between consecutive ``on_train_batch_start`` calls (a warm-up
of each epoch dropped), so it includes DDP's gradient all-reduce and every hook; the figure is the
median over rounds of each round's on/off ratio. The watchdog runs at lplugins' default pace (the
default 5 s bound: one sample every 0.5 s) unless ``--timeout``/``--interval`` say otherwise. Usage::

    python benchmarks/bench_watchdog.py [--steps 1000] [--rounds 5] [--hidden 256] [--batch 64]

It also times one sample of the watchdog (the stack classified, one store write and one store
read), the work it does once a second.

The last line of output is one JSON object (units in the key names).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _launch(argv: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "NODE_RANK": "0"}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.get("PYTHONPATH", ""), str(Path(__file__).resolve().parents[1] / "src")) if p
    )
    procs = [
        subprocess.Popen([sys.executable, __file__, *argv], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(2)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"a rank failed: exit statuses {codes}")


def _rank(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lplugins._coord import watchdog as _watchdog

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Timer(Callback):
        def __init__(self) -> None:
            self.stamps: dict[int, list[float]] = {}

        def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            _watchdog.arm(args.timeout if _on(trainer.current_epoch) else 0, interval=args.interval)
            self.stamps[trainer.current_epoch] = []

        def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, idx: int) -> None:
            self.stamps[trainer.current_epoch].append(time.perf_counter())

    n = args.steps * args.batch * 2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, generator=gen)
    data = DataLoader(TensorDataset(x, x.sum(1)), batch_size=args.batch)
    timer = Timer()
    trainer = Trainer(
        strategy=DDPStrategy(timeout=timedelta(seconds=600)), accelerator="cpu", devices=2,
        max_epochs=2 * args.rounds, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(Model(), data)
    _watchdog.arm(0)
    sample_us = _sample_cost_us()
    if trainer.global_rank != 0:
        return
    warmup = max(5, args.steps // 10)
    per_epoch = {
        e: statistics.median([b - a for a, b in zip(s[warmup:], s[warmup + 1 :], strict=False)])
        for e, s in timer.stamps.items()
    }
    off = [v for e, v in sorted(per_epoch.items()) if not _on(e)]
    on = [v for e, v in sorted(per_epoch.items()) if _on(e)]
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        print(f"round {i}: off {a * 1e3:.3f} ms/step, on {b * 1e3:.3f} ms/step, on/off {b / a:.4f}")
    result = {
        "world_size": 2,
        "order": "ABBA (off,on,on,off,...)",
        "steps_per_epoch": args.steps,
        "rounds": args.rounds,
        "watchdog_timeout_s": args.timeout,
        "watchdog_interval_s": args.interval or min(1.0, args.timeout / 10),
        "step_ms_off": round(statistics.median(off) * 1e3, 4),
        "step_ms_on": round(statistics.median(on) * 1e3, 4),
        "ratio_on_over_off_median_of_rounds": round(statistics.median(ratios), 4),
        "ratio_on_over_off_per_round": [round(r, 4) for r in ratios],
        "watchdog_sample_us": round(sample_us, 1),
    }
    print(json.dumps(result))


def _on(epoch: int) -> bool:
    """Whether the watchdog runs in ``epoch``: off/on in even rounds, on/off in odd ones (ABBA)."""
    return (epoch % 2 == 1) != (epoch // 2 % 2 == 1)


def _sample_cost_us(n: int = 300) -> float:
    """Microseconds of one watchdog sample: classify the main thread's stack, publish, read the board."""
    import threading

    from lplugins._coord import board as _board
    from lplugins._coord import stacks

    board = _board.current_board()
    assert board is not None
    main = threading.main_thread().ident
    start = time.perf_counter()
    for _ in range(n):
        where = stacks.classify(sys._current_frames()[main])  # type: ignore[index]
        board.store.set("bench/state", json.dumps({"kind": where.kind, "t": time.time()}))
        board.store.add("failures", 0)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per epoch (per phase)")
    parser.add_argument("--rounds", type=int, default=5, help="off/on pairs of epochs")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=5.0, help="the watchdog's bound floor, seconds (default)")
    parser.add_argument("--interval", type=float, default=None, help="seconds between samples (default: its own)")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        _launch(sys.argv[1:])
    else:
        _rank(args)


if __name__ == "__main__":
    main()
