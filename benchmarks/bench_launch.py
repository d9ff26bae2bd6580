"""The warm launcher against fresh interpreters: one small 2-rank DDP job, started both ways in the same run.

Each repetition runs the same job (a 2-rank DDP fit of 3 steps over gloo, then exit) twice, in alternating
order: every rank a fresh ``python job.py`` with ``LOCAL_RANK`` set (as torchrun starts them, stock
Lightning in each), and every rank forked from lplugins' warm server (``lplugins._fork.ranks.run_ranks``,
what ``lplugins_launch`` and the project's tests use; the server is started once, before the first
repetition, and its start-up is reported on its own). Wall time per job and the CPU seconds of its ranks
(each rank's own ``getrusage`` at its end: a forked process starts at zero) are reported as medians with
the spread, and as ratios.

Run: ``.venv/bin/python benchmarks/bench_launch.py [--repeats 7]``. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
import os, resource, sys, json
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(M(), DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4))
usage = resource.getrusage(resource.RUSAGE_SELF)
with open(f"cpu{os.environ['LOCAL_RANK']}.json", "w") as f:
    json.dump(usage.ru_utime + usage.ru_stime, f)
"""


def _env() -> dict[str, str]:
    from lplugins._fork.ranks import free_port

    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}


def fresh(script: Path) -> tuple[float, float]:
    """Both ranks as fresh interpreters started together: (wall seconds, CPU seconds of the ranks)."""
    env = _env()
    began = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=script.parent,
            env={**env, "LOCAL_RANK": str(r), "NODE_RANK": "0"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(2)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    wall = time.perf_counter() - began
    assert codes == [0, 0], codes
    return wall, _cpu(script.parent)


def warm(script: Path) -> tuple[float, float]:
    """Both ranks forked from the warm server: (wall seconds, CPU seconds of the ranks)."""
    from lplugins._fork.ranks import run_ranks

    began = time.perf_counter()
    ranks = run_ranks(script, ranks=2, cwd=script.parent, env=_env(), timeout=300)
    wall = time.perf_counter() - began
    assert ranks.returncodes == [0, 0], ranks.stderr[-2000:]
    return wall, _cpu(script.parent)


def _cpu(folder: Path) -> float:
    return sum(float(json.loads((folder / f"cpu{r}.json").read_text())) for r in range(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats
    from lplugins._fork.ranks import LIGHTNING_MODULES, server

    began = time.perf_counter()
    server(LIGHTNING_MODULES)
    server_start = time.perf_counter() - began
    figures: dict[str, list[float]] = {"fresh_wall": [], "fresh_cpu": [], "warm_wall": [], "warm_cpu": []}
    with tempfile.TemporaryDirectory() as work:
        script = Path(work, "job.py")
        script.write_text(JOB)
        for i in range(repeats):
            order = [("fresh", fresh), ("warm", warm)] if i % 2 == 0 else [("warm", warm), ("fresh", fresh)]
            for name, run in order:
                wall, cpu = run(script)
                figures[f"{name}_wall"].append(wall)
                figures[f"{name}_cpu"].append(cpu)
                print(f"{i} {name}: {wall:.2f} s wall, {cpu:.2f} CPU-s", file=sys.stderr)

    def med(key: str) -> float:
        return statistics.median(figures[key])

    def spread(key: str) -> float:
        return max(figures[key]) - min(figures[key])

    print(
        json.dumps(
            {
                "repeats": repeats,
                "server_start_s": round(server_start, 3),
                "fresh_job_wall_median_s": round(med("fresh_wall"), 3),
                "fresh_job_wall_spread_s": round(spread("fresh_wall"), 3),
                "warm_job_wall_median_s": round(med("warm_wall"), 3),
                "warm_job_wall_spread_s": round(spread("warm_wall"), 3),
                "fresh_job_cpu_median_s": round(med("fresh_cpu"), 3),
                "warm_job_cpu_median_s": round(med("warm_cpu"), 3),
                "warm_over_fresh_wall_ratio": round(med("warm_wall") / med("fresh_wall"), 3),
                "warm_over_fresh_cpu_ratio": round(med("warm_cpu") / med("fresh_cpu"), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
