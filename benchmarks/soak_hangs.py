"""No false alarms: a long 2-rank DDP run whose steps are slow in every legitimate way, with the hang detector on.

Two ranks (gloo, CPU, started side by side as torchrun starts them), lplugins' defaults (nothing
set), for ``--minutes``:

* every ``training_step`` sleeps a jittered time: ``--step-ms`` x a factor drawn from 1..10 (10x jitter),
  drawn independently on each rank, so one rank regularly waits for the other in the all-reduce;
* the first epoch is slow: each of its batches takes ``--first-epoch-s`` more to fetch on rank 1
  (a cold cache), while rank 0 waits for it in the all-reduce;
* every ``--save-every`` steps every rank calls ``trainer.save_checkpoint``, and rank 0's write is slow
  (``--slow-save-s`` more: a slow file system) while rank 1 waits in the barrier after it;
* every epoch is followed by a rank-0-only pause of ``--slow-save-s`` (e.g. an evaluation) that
  rank 1 waits out in the next collective.

It passes when both ranks exit 0 and no rank logged any lplugins verdict or mismatch. Usage::

    python benchmarks/soak_hangs.py [--minutes 60]

The last line of output is one JSON object (units in the key names).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _rank(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, Dataset

    rank = int(os.environ["RANK"])
    rng = random.Random(1234 + rank)

    class Data(Dataset):
        def __init__(self) -> None:
            self.epoch = 0

        def __len__(self) -> int:
            return 400

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if self.epoch == 0 and rank == 1 and i % 4 == 0:
                time.sleep(args.first_epoch_s)  # a slow first epoch: one fetch per batch
            x = torch.full((8,), float(i % 5))
            return x, x.sum(0, keepdim=True)

    data = Data()

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(args.step_ms / 1000 * rng.uniform(1, 10))  # 10x jitter, per rank
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Slow(Callback):
        def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
            if trainer.global_step % args.save_every == 0:
                trainer.save_checkpoint(os.path.join(args.root, "soak.ckpt"))  # every rank: slow on rank 0

        def on_save_checkpoint(self, trainer: Trainer, *_: Any) -> None:
            if trainer.global_rank == 0:
                time.sleep(args.slow_save_s)  # a slow write while rank 1 waits in the barrier after it

        def on_train_epoch_end(self, trainer: Trainer, *_: Any) -> None:
            data.epoch = trainer.current_epoch + 1
            if trainer.global_rank == 0:
                time.sleep(args.slow_save_s)  # rank 0 alone (an evaluation) while rank 1 waits

    trainer = Trainer(
        strategy=DDPStrategy(), accelerator="cpu", devices=2, max_epochs=10**6, logger=False,
        max_time=timedelta(minutes=args.minutes),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[Slow()],
        use_distributed_sampler=False, default_root_dir=args.root,
    )  # fmt: skip
    trainer.fit(Model(), DataLoader(data, batch_size=4))
    if rank == 0:
        print(json.dumps({"steps": trainer.global_step, "epochs": trainer.current_epoch}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--step-ms", type=float, default=20.0, help="the shortest step; each is 1..10x this")
    parser.add_argument("--first-epoch-s", type=float, default=1.5, help="extra fetch time per batch, epoch 0")
    parser.add_argument("--save-every", type=int, default=150, help="steps between checkpoints")
    parser.add_argument("--slow-save-s", type=float, default=8.0, help="extra seconds of rank 0's slow writes")
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "RANK" in os.environ:
        _rank(args)
        return
    root = tempfile.mkdtemp(prefix="soak-hangs-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "NODE_RANK": "0"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    for name in ("LPLUGINS_COLLECTIVE_TIMEOUT", "LPLUGINS_HEARTBEAT_TIMEOUT"):
        env.pop(name, None)  # the defaults
    logs = [Path(root) / f"rank{r}.log" for r in range(2)]
    start = time.time()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:], "--root", root],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=open(logs[r], "w"),
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    codes = [p.wait(timeout=args.minutes * 60 + 600) for p in procs]
    texts = [log.read_text(errors="replace") for log in logs]
    alarms = [
        line
        for text in texts
        for line in text.splitlines()
        if re.search(r"lplugins \[rank \d+\]|collective mismatch|does not respond|stalled", line)
    ]
    stats: dict[str, Any] = {}
    for line in texts[0].splitlines():
        if line.startswith('{"steps"'):
            stats = json.loads(line)
    result = {
        "minutes_run": round((time.time() - start) / 60, 2),
        "exit_codes": codes,
        "false_alarms": len(alarms),
        "steps": stats.get("steps"),
        "epochs": stats.get("epochs"),
        "step_ms_min_max": [args.step_ms, 10 * args.step_ms],
        "first_epoch_extra_fetch_s": args.first_epoch_s,
        "slow_save_s": args.slow_save_s,
        "pass": codes == [0, 0] and not alarms,
    }
    for line in alarms[:10]:
        print(line)
    print(json.dumps(result))
    if not result["pass"]:
        print(f"logs kept in {root}", file=sys.stderr)
        sys.exit(1)
    subprocess.run(["rm", "-rf", root], check=False)


if __name__ == "__main__":
    main()
