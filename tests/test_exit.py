"""Importing lplugins makes a process that ends with a gloo process group still initialized exit cleanly."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lplugins._coord import exit as _exit
from tests._dist import free_port, run_together


def test_destroys_an_initialized_gloo_group_and_nothing_else(tmp_path: Path) -> None:
    assert _exit.destroy_gloo_process_group() is False  # nothing initialized
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        assert _exit.destroy_gloo_process_group() is True
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_a_ddp_script_that_never_destroys_its_group_has_it_destroyed_before_finalization(tmp_path: Path) -> None:
    # What most training scripts do: fit, then fall off the end. A handler registered *before* lplugins
    # is imported runs *after* lplugins' one (atexit is last-in, first-out) and records what it sees.
    script = r"""
import atexit, json, os

def report():
    import torch.distributed as dist
    with open(f"exit{os.environ.get('LOCAL_RANK', '0')}.json", "w") as f:
        json.dump({"initialized": dist.is_initialized()}, f)

atexit.register(report)

import torch, lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
import lplugins

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

kw = lplugins.compose(strategy="ddp_timeout", accelerator="cpu", devices=2, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer = pl.Trainer(**kw)
trainer.fit(M(), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2))
assert torch.distributed.is_initialized()  # Lightning leaves it initialized
trainer.strategy.barrier()
"""
    # fresh interpreters: forked warm, lplugins' handler would be registered before the script's (server import)
    run_together(script, tmp_path, timeout=150, start="together").check()
    deadline = time.monotonic() + 60  # rank 1 is Lightning's child process: it may finish after rank 0
    while not (tmp_path / "exit1.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"exit{rank}.json").read_text()) == {"initialized": False}
