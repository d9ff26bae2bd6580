"""Ray Train as the engine: per-step time under ``ray_ddp`` vs Lightning's own ``ddp``, and recovery time.

In one run, on CPU (gloo), the same model, data and step count:

* **per step** -- 2 Ray Train workers (``lplugins.ray.fit``, strategy ``ray_ddp``; and lplugins'
  ``ddp_timeout`` under Ray, to tell Ray's processes from Ray's strategy) against 2 processes that
  Lightning launches itself (``Trainer(strategy="ddp", devices=2)``), alternating ``--rounds`` times;
  each run's per-step time is the median interval between consecutive ``on_train_batch_start`` calls
  on rank 0 (the first 20 steps dropped), so it holds DDP's all-reduce and every hook.
* **recovery** -- a Ray run with a ``durable_checkpoint`` (every ``--save-every`` steps) and
  ``max_failures=1`` in which rank 1 SIGKILLs itself at step ``--kill-at``: the seconds from the kill
  to the first step trained after Ray restarted the group (restored, resumed from the newest commit),
  next to the seconds from ``lplugins.ray.fit`` to the first step of a fresh run (Ray's start-up).

Usage::

    python benchmarks/bench_ray.py [--steps 300] [--rounds 2] [--hidden 256] [--batch 64]

The last line of output is one JSON object (units in the key names).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 20


def _model(hidden: int) -> Any:
    import torch
    from lightning.pytorch import LightningModule

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                torch.nn.Linear(hidden, 1),
            )  # fmt: skip

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Model()


def _loader(batch: int, steps: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * steps * 2, 32, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1)), batch_size=batch)


def _timer(out: str) -> Any:
    from lightning.pytorch import Callback

    class StepTimer(Callback):
        """Rank 0: the start time of every step, written to ``out`` at the end of the fit."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.times.append(time.perf_counter())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.is_global_zero:
                Path(out).write_text(json.dumps(self.times))

    return StepTimer()


def _per_step(path: str) -> float:
    times = json.loads(Path(path).read_text())[WARMUP:]
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def _trainer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_steps": args.steps,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    }


def _lightning_ddp(args: argparse.Namespace, out: str) -> None:
    """The ``--lightning-ddp`` child: Lightning launches rank 1 itself (a copy of this command)."""
    from lightning.pytorch import Trainer

    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, callbacks=[_timer(out)], **_trainer_kwargs(args))
    trainer.fit(_model(args.hidden), _loader(args.batch, args.steps))


def _run_lightning(args: argparse.Namespace, work: Path, i: int) -> float:
    out = str(work / f"lightning-{i}.json")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, __file__, "--lightning-ddp", out, "--steps", str(args.steps)]
    argv += ["--hidden", str(args.hidden), "--batch", str(args.batch)]
    subprocess.run(argv, env=env, check=True, timeout=900, start_new_session=True, capture_output=True)
    return _per_step(out)


def _run_ray(args: argparse.Namespace, work: Path, i: int, strategy: str) -> float:
    import lplugins.ray

    out = str(work / f"{strategy}-{i}.json")
    lplugins.ray.fit(
        _model(args.hidden),
        _loader(args.batch, args.steps),
        num_workers=2,
        storage_path=str(work / "ray"),
        name=f"steps-{strategy}-{i}",
        ckpt_path=None,
        trainer={"strategy": strategy, "callbacks": [_timer(out)], **_trainer_kwargs(args)},
    )
    return _per_step(out)


def _recovery_callback(work: str, kill_at: int) -> Any:
    from lightning.pytorch import Callback

    class KillAndWatch(Callback):
        """Rank 1 kills itself at ``kill_at`` in the first attempt; rank 0 notes the first step of each attempt."""

        def __init__(self) -> None:
            self.first = True

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            now = time.time()
            if self.first and trainer.is_global_zero:
                self.first = False
                with open(os.path.join(work, "first_steps.txt"), "a") as f:
                    f.write(f"{now} {trainer.global_step}\n")
            marker = os.path.join(work, "killed")
            if trainer.global_rank == 1 and trainer.global_step == kill_at and not os.path.exists(marker):
                Path(marker).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    return KillAndWatch()


def _run_recovery(args: argparse.Namespace, work: Path) -> dict[str, float]:
    import lplugins.ray

    start = time.time()
    result = lplugins.ray.fit(
        _model(args.hidden),
        _loader(args.batch, args.steps),
        num_workers=2,
        max_failures=1,
        storage_path=str(work / "ray"),
        name="recovery",
        trainer={
            "strategy": "ray_ddp",
            "callbacks": [
                {"name": "durable_checkpoint", "every_n_steps": args.save_every},
                _recovery_callback(str(work), args.kill_at),
            ],
            **{**_trainer_kwargs(args), "enable_checkpointing": True},
        },
    )
    killed = float((work / "killed").read_text())
    (first, _), (after, resumed_step) = [
        (float(t), int(s)) for t, s in (line.split() for line in (work / "first_steps.txt").read_text().splitlines())
    ]
    assert result.return_value["global_step"] == args.steps, result.return_value
    return {
        "fresh_start_to_first_step_s": first - start,
        "kill_to_first_step_after_recovery_s": after - killed,
        "steps_lost": args.kill_at - (resumed_step - 1),
        "resumed_after_step": resumed_step - 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--kill-at", type=int, default=120)
    parser.add_argument("--lightning-ddp", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lightning_ddp:
        _lightning_ddp(args, args.lightning_ddp)
        return

    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "1", "OMP_NUM_THREADS": "1"})
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    import ray

    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    ray.init(num_cpus=2, address="local", include_dashboard=False, object_store_memory=80 * 1024**2,
             log_to_driver=False, _node_ip_address="127.0.0.1")  # fmt: skip
    try:
        lightning, on_ray, ddp_on_ray = [], [], []
        for i in range(args.rounds):  # alternating: drift of the machine affects all alike
            lightning.append(_run_lightning(args, work, i))
            on_ray.append(_run_ray(args, work, i, "ray_ddp"))
            ddp_on_ray.append(_run_ray(args, work, i, "ddp_timeout"))
            print(
                f"round {i}: lightning ddp {lightning[-1] * 1e3:.2f} ms/step, ray_ddp {on_ray[-1] * 1e3:.2f} ms/step, "
                f"ddp_timeout under Ray {ddp_on_ray[-1] * 1e3:.2f} ms/step"
            )
        recovery = _run_recovery(args, work)
    finally:
        ray.shutdown()
    per_lightning, per_ray, per_ddp_ray = (
        statistics.median(lightning),
        statistics.median(on_ray),
        statistics.median(ddp_on_ray),
    )
    result = {
        "steps": args.steps,
        "rounds": args.rounds,
        "lightning_ddp_ms_per_step": round(per_lightning * 1e3, 3),
        "ray_ddp_ms_per_step": round(per_ray * 1e3, 3),
        "ray_ddp_over_lightning_ddp_per_step_ratio": round(per_ray / per_lightning, 3),
        "ddp_timeout_under_ray_ms_per_step": round(per_ddp_ray * 1e3, 3),
        "ddp_timeout_under_ray_over_lightning_ddp_per_step_ratio": round(per_ddp_ray / per_lightning, 3),
        **{k: round(v, 2) for k, v in recovery.items()},
        "recovery_over_fresh_start_ratio": round(
            recovery["kill_to_first_step_after_recovery_s"] / recovery["fresh_start_to_first_step_s"], 3
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
