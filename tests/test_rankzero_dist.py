"""2-process gloo tests of lplugins.rankzero: log lines appear once, the guard raises instead of hanging."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import run_script, run_together

pytestmark = pytest.mark.distributed

TORCH_JOB = """
import datetime, json, logging, os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lplugins.rankzero import (CollectiveInRankZeroBlockError, get_logger, rank_zero_block, rank_zero_print,
                               rank_zero_warn)

def worker(rank):
    os.environ["RANK"] = str(rank)  # as torchrun sets it, before the process group exists
    os.environ["WORLD_SIZE"] = "2"
    logging.basicConfig(level=logging.INFO, format="%(rank)s|%(message)s", stream=sys.stdout, force=True)
    log = get_logger("job")
    log.info("before init: once")
    log.info("before init: every", all_ranks=True)
    rank_zero_print("print: once", flush=True)
    rank_zero_warn("warn: once")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))  # short
    del os.environ["RANK"]  # from here on, the process group says who is who
    log.info("after init: once")
    log.info("after init: every", all_ranks=True)
    result = {}
    if rank == 0:
        for name, call in [
            ("all_reduce", lambda: dist.all_reduce(torch.ones(1))),
            ("barrier", lambda: dist.barrier()),
            ("broadcast_object_list", lambda: dist.broadcast_object_list([1], src=0)),
            ("all_gather_object", lambda: dist.all_gather_object([None, None], 1)),
        ]:
            start = time.perf_counter()
            try:
                with rank_zero_block():
                    call()
            except CollectiveInRankZeroBlockError as exc:
                result[name] = {"seconds": time.perf_counter() - start, "message": str(exc)}
    # both ranks: the refused collectives never reached the wire, so the ranks are still in step
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    result["sum_after"] = total.item()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)

if __name__ == "__main__":
    mp.spawn(worker, nprocs=2)
"""


@pytest.mark.timeout(120)
def test_torch_collectives_in_guard_raise_and_ranks_stay_in_step(tmp_path: Path) -> None:
    res = run_script(TORCH_JOB, tmp_path, timeout=90).check()
    lines = res.stdout.splitlines()
    # each rank-zero line exactly once, by rank 0; all-rank lines once per rank, prefixed
    assert lines.count("0|before init: once") == 1
    assert lines.count("0|after init: once") == 1
    assert lines.count("print: once") == 1
    assert not any("once" in line and line.startswith("1|") for line in lines)
    for when in ("before", "after"):
        assert sorted(line for line in lines if line.endswith(f"{when} init: every")) == [
            f"0|[rank 0] {when} init: every",
            f"1|[rank 1] {when} init: every",
        ]
    assert res.stderr.count("UserWarning: warn: once") == 1
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])
    assert result["sum_after"] == 3.0  # both ranks joined the collective after rank 0 caught the errors
    for name in ("all_reduce", "barrier", "broadcast_object_list", "all_gather_object"):
        assert f"torch.distributed.{name}()" in result[name]["message"]
        assert "global rank 0" in result[name]["message"]
        print(f"{name}: refused after {result[name]['seconds'] * 1e3:.3f} ms")


LIGHTNING_JOB = """
import json, os, sys, time
import torch
from datetime import timedelta
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy
import torchmetrics

from lplugins.callbacks import DurableCheckpoint, request_checkpoint
from lplugins.rankzero import CollectiveInRankZeroBlockError, rank_zero_block, rank_zero_only

MODE = sys.argv[1]

class Model(BoringModel):
    def __init__(self):
        super().__init__()
        self.refused = {}
        self.metric = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.metric.update(out["loss"].detach())
        if batch_idx == 1 and self.trainer.is_global_zero:
            if MODE == "uncaught":
                print("ENTERING", time.time(), flush=True)
                with rank_zero_block():
                    self.trainer.save_checkpoint("never.ckpt")
            calls = {
                "save_checkpoint": lambda: self.trainer.save_checkpoint("never.ckpt"),
                "log_dir": lambda: self.trainer.log_dir,
                "sync_dist": lambda: self.log("loss", out["loss"], sync_dist=True),
                "barrier": lambda: self.trainer.strategy.barrier(),
                "broadcast": lambda: self.trainer.strategy.broadcast(1),
                "reduce": lambda: self.trainer.strategy.reduce(torch.ones(1)),
                "all_gather": lambda: self.all_gather(torch.ones(1)),
                "metric_compute": lambda: self.metric.compute(),
                "decorated": rank_zero_only(lambda: self.trainer.save_checkpoint("never.ckpt")),
            }
            for name, call in calls.items():
                start = time.perf_counter()
                try:
                    if name == "decorated":
                        call()
                    else:
                        with rank_zero_block():
                            call()
                except CollectiveInRankZeroBlockError as exc:
                    self.refused[name] = {"seconds": time.perf_counter() - start, "message": str(exc)}
            with rank_zero_block():
                request_checkpoint(self.trainer)  # the safe alternative the messages suggest: no collective
        return out

if __name__ == "__main__":
    model = Model()
    durable = DurableCheckpoint("durable", save_on_train_end=False, keep_last=None, preemption_signals=())
    trainer = Trainer(accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=4,
                      strategy=DDPStrategy(timeout=timedelta(seconds=60)),  # short: a missed refusal fails fast
                      limit_val_batches=0, logger=False, callbacks=[durable], enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(model)
    # every rank exits training normally; a checkpoint saved by every rank together works
    trainer.save_checkpoint("together.ckpt")
    print(f"DONE rank={trainer.global_rank}", flush=True)
    if trainer.is_global_zero:
        print("REQUESTED " + json.dumps([os.path.basename(p) for p in durable.committed]), flush=True)
        print("RESULT " + json.dumps(model.refused), flush=True)
"""


@pytest.mark.timeout(180)
def test_lightning_calls_in_guard_raise_under_ddp(tmp_path: Path) -> None:
    res = run_together(LIGHTNING_JOB, tmp_path, timeout=150, args=["caught"]).check()
    assert "DONE rank=0" in res.stdout and "DONE rank=1" in res.stdout
    refused = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])
    expected = {
        "save_checkpoint": "Trainer.save_checkpoint()",
        "log_dir": "Trainer.log_dir",
        "sync_dist": "Model.log(..., sync_dist=True)",
        "barrier": "strategy.barrier",
        "broadcast": "strategy.broadcast",
        "reduce": "strategy.reduce",
        "all_gather": "strategy.all_gather",
        "metric_compute": "torch.distributed.",  # torchmetrics syncs its states with a collective
        "decorated": "Trainer.save_checkpoint()",
    }
    assert sorted(refused) == sorted(expected)
    for name, call in expected.items():
        assert call in refused[name]["message"], (name, refused[name]["message"])
    assert "torchmetrics" in refused["metric_compute"]["message"]  # says where it was called from
    assert (tmp_path / "together.ckpt").exists() and not (tmp_path / "never.ckpt").exists()
    # the checkpoint requested from rank 0 inside the block was saved by both ranks together, once
    requested = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("REQUESTED "))[10:])
    assert len(requested) == 1, requested
    for name, item in refused.items():
        print(f"{name}: refused after {item['seconds'] * 1e3:.3f} ms")


@pytest.mark.timeout(180)
def test_uncaught_guard_error_ends_the_job(tmp_path: Path) -> None:
    """Uncaught, the error ends rank 0 with a clear message and the job does not hang: rank 1, waiting in
    DDP's gradient all-reduce, fails with gloo's "connection closed by peer" as soon as rank 0 is gone.
    ``run_script`` returns only once both processes closed their output, so both exited on their own."""
    res = run_together(LIGHTNING_JOB, tmp_path, timeout=150, args=["uncaught"])
    assert res.returncode != 0
    assert "CollectiveInRankZeroBlockError: Trainer.save_checkpoint() was called inside a rank-zero block" in res.stderr
    assert "DONE" not in res.stdout


NODE_JOB = """
import logging, sys
from lplugins.rankzero import get_logger

logging.basicConfig(level=logging.INFO, format="LOG %(rank)s %(message)s", stream=sys.stdout)
log = get_logger("node")
log.info("module level: once")  # before anything is launched: only NODE_RANK says which node this is
log.info("module level: every", all_ranks=True)

from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

class Model(BoringModel):
    def on_train_start(self):
        log.info("train start: once")
        log.info("train start: every", all_ranks=True)

trainer = Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_steps=2, limit_val_batches=0,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Model())
"""

TWO_NODES = """
import os, subprocess, sys
procs = [subprocess.Popen([sys.executable, "node.py"], env={**os.environ, "NODE_RANK": str(n)}) for n in (0, 1)]
sys.exit(max(p.wait() for p in procs))
"""


@pytest.mark.timeout(180)
def test_logger_on_simulated_two_nodes(tmp_path: Path) -> None:
    """Two 'nodes' on localhost (num_nodes=2, one process each, NODE_RANK): once means once, also
    before the process group exists."""
    (tmp_path / "node.py").write_text(NODE_JOB)
    res = run_script(TWO_NODES, tmp_path, timeout=150).check()
    lines = [line for line in res.stdout.splitlines() if line.startswith("LOG ")]
    for when in ("module level", "train start"):
        assert lines.count(f"LOG 0 {when}: once") == 1, lines
        assert sorted(line for line in lines if line.endswith(f"{when}: every")) == [
            f"LOG 0 [rank 0] {when}: every",
            f"LOG 1 [rank 1] {when}: every",
        ]
    assert len(lines) == 6, lines
