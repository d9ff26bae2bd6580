"""DeepSpeed ZeRO-2 (lplugins ``deepspeed_stage_2_cpu``) vs stock Lightning DDP on 2 CPU ranks (gloo).

Same model, data and steps, one after the other in the same run. Per rank it measures the median
step time (after warm-up) and the peak resident memory added by training (peak RSS during ``fit``
minus RSS before it), plus the bytes of optimizer state each rank holds. Reported as ZeRO-2 / DDP
ratios; the last line of output is one line of JSON.

Run::

    .venv/bin/python benchmarks/bench_deepspeed.py            # defaults: ~17M parameters, 30 steps
    .venv/bin/python benchmarks/bench_deepspeed.py --hidden 1024 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(strategy: str, hidden: int, layers: int, steps: int, warmup: int, out: str) -> None:
    import resource

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lplugins

    torch.set_num_threads(1)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            mods: list[torch.nn.Module] = []
            for _ in range(layers):
                mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.peak_during_fit = 0

        def on_train_batch_start(self, *args: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self.t0)
            self.peak_during_fit = max(self.peak_during_fit, _rss_bytes())

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * (steps + 1) * 2, hidden, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :1].clone()), batch_size=16)
    timer = Timer()
    common = dict(
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    kwargs = lplugins.compose(strategy=strategy, **common) if strategy != "ddp" else dict(strategy="ddp", **common)
    trainer = pl.Trainer(**kwargs)
    model = Model()
    num_params = sum(p.numel() for p in model.parameters())
    before = _rss_bytes()
    trainer.fit(model, data)
    peak = max(timer.peak_during_fit, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    optimizer = trainer.strategy.optimizers[0]
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed wraps the torch optimizer
    state = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    result = {
        "rank": trainer.global_rank,
        "num_params": num_params,
        "median_step_s": statistics.median(timer.times[warmup:]),
        "rss_before_fit_bytes": before,
        "peak_rss_bytes": peak,
        "fit_rss_increase_bytes": peak - before,
        "optimizer_state_bytes": state,
    }
    with open(os.path.join(out, f"{strategy}_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    trainer.strategy.barrier()


def _run(strategy: str, args: argparse.Namespace, out: str) -> list[dict[str, Any]]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", strategy, "--out", out]
    cmd += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(Path(out, f"{strategy}_rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--child", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.hidden, args.layers, args.steps, args.warmup, args.out)
        return
    with tempfile.TemporaryDirectory() as out:
        results = {name: _run(name, args, out) for name in ("ddp", "deepspeed_stage_2_cpu")}
    ddp, zero2 = results["ddp"], results["deepspeed_stage_2_cpu"]

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    for name, rows in results.items():
        for r in rows:
            print(
                f"{name:<24} rank {r['rank']}: step {r['median_step_s'] * 1e3:8.1f} ms  "
                f"peak RSS {r['peak_rss_bytes'] / 2**20:8.0f} MiB  (+{r['fit_rss_increase_bytes'] / 2**20:.0f} MiB "
                f"during fit)  optimizer state {r['optimizer_state_bytes'] / 2**20:.0f} MiB"
            )
    summary = {
        "num_params": ddp[0]["num_params"],
        "ranks": 2,
        "steps": args.steps,
        "ddp_step_ms": round(mean(ddp, "median_step_s") * 1e3, 2),
        "zero2_step_ms": round(mean(zero2, "median_step_s") * 1e3, 2),
        "step_time_ratio_zero2_over_ddp": round(mean(zero2, "median_step_s") / mean(ddp, "median_step_s"), 3),
        "ddp_peak_rss_mib_per_rank": round(mean(ddp, "peak_rss_bytes") / 2**20, 1),
        "zero2_peak_rss_mib_per_rank": round(mean(zero2, "peak_rss_bytes") / 2**20, 1),
        "peak_rss_ratio_zero2_over_ddp": round(mean(zero2, "peak_rss_bytes") / mean(ddp, "peak_rss_bytes"), 3),
        "fit_rss_increase_ratio_zero2_over_ddp": round(
            mean(zero2, "fit_rss_increase_bytes") / mean(ddp, "fit_rss_increase_bytes"), 3
        ),
        "optimizer_state_mib_per_rank_ddp": round(mean(ddp, "optimizer_state_bytes") / 2**20, 1),
        "optimizer_state_mib_per_rank_zero2": round(mean(zero2, "optimizer_state_bytes") / 2**20, 1),
        "optimizer_state_ratio_zero2_over_ddp": round(
            mean(zero2, "optimizer_state_bytes") / mean(ddp, "optimizer_state_bytes"), 3
        ),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
