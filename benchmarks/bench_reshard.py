"""What a resume on another world size costs: DeepSpeed ZeRO-2 and FSDP2 checkpoints written by 2 CPU ranks (gloo).

* DeepSpeed: the ZeRO directory read as one full checkpoint alone (``full_from_zero``, what each rank runs at a
  2 -> 1 resume; DeepSpeed's ``ds_to_universal``, which resumes used before, timed beside it), as seconds and GB/s
  of checkpoint; the whole resolved load on 1 rank (the read + putting it into the engine + the verification
  every resume does) next to a plain load of the same checkpoint on 2 ranks, as a ratio; and the same 2 -> 1 load
  once more (the full checkpoint rank zero kept beside it, ``<name>.converted/full.ckpt``, is for the resumes that
  load a file: a DeepSpeed resume reads the ZeRO directory again).
* FSDP2 (sharded directory, torch distributed checkpoint): the load on 1 rank (resharded) next to the load on 2.
* Both also next to a plain load on 1 rank of the same model written by 1 rank (what the resize adds).

Each load is timed around the strategy's ``load_checkpoint`` (as ``DurableCheckpoint``'s resolver installs it:
``ckpt_path="latest"``, every byte verified), in the process of global rank 0; each setting runs in its own
launch, one after the other (a background write a resume started is waited for before the next load is timed).
The last line of output is one line of JSON.

Run::

    .venv/bin/python benchmarks/bench_reshard.py              # ~16.8M parameters: a ~270 MB ZeRO checkpoint
    .venv/bin/python benchmarks/bench_reshard.py --hidden 1024 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _child(phase: str, world: int, hidden: int, layers: int, out: str, tag: str) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lplugins
    from lplugins.callbacks import DurableCheckpoint
    from lplugins.strategies import FSDP2Strategy

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
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class LoadTimer(pl.callbacks.Checkpoint):
        """Times the strategy's load, wrapped after DurableCheckpoint's resolver installed itself in setup.

        (A ``Checkpoint``, so that Lightning keeps it after the ``DurableCheckpoint``: it moves those last.)
        """

        seconds: float | None = None

        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            strategy = trainer.strategy
            load = strategy.load_checkpoint

            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return load(*args, **kwargs)
                finally:
                    self.seconds = time.perf_counter() - start

            strategy.load_checkpoint = timed  # type: ignore[method-assign]

    data = DataLoader(TensorDataset(torch.randn(8, hidden), torch.randn(8, 1)), batch_size=2)
    results: dict[str, float | None] = {}
    for name in ("deepspeed", "fsdp2"):
        strategy: Any = (
            "deepspeed_stage_2_cpu" if name == "deepspeed" else FSDP2Strategy(save_distributed_checkpoint=True)
        )
        timer = LoadTimer()
        kwargs = lplugins.compose(
            strategy=strategy, accelerator="cpu", devices=world, max_steps=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[DurableCheckpoint(os.path.join(out, tag, name), keep_last=None), timer],
        )  # fmt: skip
        trainer = pl.Trainer(**kwargs)
        trainer.fit(Model(), data, ckpt_path=None if phase == "save" else "latest")
        results[name] = timer.seconds
        import threading

        for thread in threading.enumerate():  # the conversion kept for later: not during the next timed load
            if thread.name.startswith("lplugins-convert-"):
                thread.join()
    if trainer.is_global_zero:
        with open(os.path.join(out, f"{tag}-{phase}-{world}.json"), "w") as f:
            json.dump(results, f)


def _launch(phase: str, world: int, args: argparse.Namespace, out: str, tag: str) -> dict[str, float]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, __file__, "--child", phase, "--world", str(world), "--hidden", str(args.hidden)]
    cmd += ["--layers", str(args.layers), "--out", out, "--tag", tag]
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{phase} on {world} rank(s) failed:\n{done.stderr[-4000:]}")
    with open(os.path.join(out, f"{tag}-{phase}-{world}.json")) as f:
        result = dict(json.load(f))
    said = re.search(r"read as one full checkpoint in ([0-9.]+)s", done.stderr)
    if said:  # what rank zero said while it resumed
        result["conversion"] = float(said.group(1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--child", default=None)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tag", default="w2")
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, args.world, args.hidden, args.layers, args.out, args.tag)
        return

    import torch

    from lplugins._lightning.zero_shards import compact, full_from_zero
    from lplugins.callbacks import latest_checkpoint
    from lplugins.strategies.deepspeed import convert_to_universal

    torch.set_num_threads(1)  # as in the children

    out = tempfile.mkdtemp(prefix="bench_reshard_")
    try:
        _launch("save", 2, args, out, "w2")
        ds_ckpt = Path(latest_checkpoint(os.path.join(out, "w2", "deepspeed")) or "")
        fsdp_ckpt = Path(latest_checkpoint(os.path.join(out, "w2", "fsdp2")) or "")
        ds_bytes, fsdp_bytes = _size(ds_ckpt), _size(fsdp_ckpt)
        reads = []
        for _ in range(3):  # the read alone, in this process (what each rank runs), every byte touched; best of 3
            start = time.perf_counter()
            compact(full_from_zero(str(ds_ckpt)))
            reads.append(time.perf_counter() - start)
        conversion = min(reads)
        universal = convert_to_universal(str(ds_ckpt), os.path.join(out, "universal"))  # what resumes used before
        shutil.rmtree(os.path.join(out, "universal"), ignore_errors=True)
        same = _launch("load", 2, args, out, "w2")  # plain loads, at the world size that wrote them
        other = _launch("load", 1, args, out, "w2")  # 2 -> 1: DeepSpeed converts, FSDP2 reshards
        again = _launch("load", 1, args, out, "w2")  # 2 -> 1 again (a later resume of the same checkpoint)
        _launch("save", 1, args, out, "w1")  # the same model written by 1 rank: a plain load on the new size
        target = _launch("load", 1, args, out, "w1")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    params = args.layers * (args.hidden * args.hidden + args.hidden) + args.hidden + 1
    result = {
        "parameters": params,
        "deepspeed_checkpoint_MB": round(ds_bytes / 1e6, 1),
        "deepspeed_read_as_full_s": round(conversion, 3),
        "deepspeed_read_as_full_GB_per_s": round(ds_bytes / 1e9 / conversion, 3),
        "deepspeed_ds_to_universal_s": round(universal, 3),
        "deepspeed_read_in_resume_s": other.get("conversion"),
        "deepspeed_plain_load_2_ranks_s": round(same["deepspeed"], 3),
        "deepspeed_reshard_load_2_to_1_s": round(other["deepspeed"], 3),
        "deepspeed_reshard_over_plain_ratio": round(other["deepspeed"] / same["deepspeed"], 2),
        "deepspeed_reshard_load_2_to_1_again_s": round(again["deepspeed"], 3),
        "deepspeed_reshard_again_over_plain_ratio": round(again["deepspeed"] / same["deepspeed"], 2),
        "deepspeed_reshard_again_over_plain_1_rank_ratio": round(again["deepspeed"] / target["deepspeed"], 2),
        "deepspeed_plain_load_1_rank_s": round(target["deepspeed"], 3),
        "deepspeed_reshard_over_plain_1_rank_ratio": round(other["deepspeed"] / target["deepspeed"], 2),
        "fsdp2_checkpoint_MB": round(fsdp_bytes / 1e6, 1),
        "fsdp2_plain_load_2_ranks_s": round(same["fsdp2"], 3),
        "fsdp2_reshard_load_2_to_1_s": round(other["fsdp2"], 3),
        "fsdp2_reshard_over_plain_ratio": round(other["fsdp2"] / same["fsdp2"], 2),
        "fsdp2_plain_load_1_rank_s": round(target["fsdp2"], 3),
        "fsdp2_reshard_over_plain_1_rank_ratio": round(other["fsdp2"] / target["fsdp2"], 2),
    }
    for key, value in result.items():
        print(f"{key:40s} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
