"""Accumulation schedules under real 2-process DDP (gloo, CPU)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests._dist import ROOT, run_together
from tests.test_accumulation import make_data, reference_sgd, sequential_windows

pytestmark = [pytest.mark.distributed]

_PRELUDE = f"""
import json, logging, sys
sys.path.insert(0, {str(ROOT)!r})
import torch
import lightning.pytorch as pl
import lplugins
from tests.test_accumulation import Observer, TinyModel, params, trainer_kwargs
"""

DDP_EQUIVALENCE = (
    _PRELUDE
    + """
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook


class SyncProbe(pl.Callback):
    # counts DDP gradient all-reduces per micro-batch through a real comm hook
    def __init__(self):
        self.calls = 0
        self.before = 0
        self.synced = []

    def on_train_start(self, trainer, pl_module):
        def hook(state, bucket):
            self.calls += 1
            return allreduce_hook(state, bucket)

        trainer.strategy.model.register_comm_hook(None, hook)

    def on_train_batch_start(self, *args):
        self.before = self.calls

    def on_train_batch_end(self, *args):
        self.synced.append(self.calls > self.before)


model = TinyModel(n=32, batch_size=2)
observer, probe = Observer(), SyncProbe()
schedule = {"name": "step", "schedule": {0: 2, 2: 4}}
kwargs = trainer_kwargs(devices=2, strategy="ddp", max_epochs=2, accumulate_grad_batches=schedule,
                        use_distributed_sampler=False)
trainer = pl.Trainer(**lplugins.compose(**kwargs))
lplugins.attach(trainer, observer, probe)
trainer.fit(model)
result = {"factors": observer.factors, "synced": probe.synced, "zero_grad_at": observer.zero_grad_at,
          "global_step": trainer.global_step, "params": params(model).tolist()}

# the same run with manual optimization and AccumulationScheduler.backward()
manual = TinyModel(n=32, batch_size=2, manual=True)
observer, probe = Observer(), SyncProbe()
trainer = pl.Trainer(**lplugins.compose(**kwargs))
lplugins.attach(trainer, observer, probe)
trainer.fit(manual)
result["manual"] = {"factors": observer.factors, "synced": probe.synced, "global_step": trainer.global_step,
                    "params": params(manual).tolist()}
with open(f"result_{trainer.global_rank}.json", "w") as f:
    json.dump(result, f)
"""
)


@pytest.mark.timeout(240)
def test_ddp_accumulation_equals_big_batch_and_skips_sync_inside_windows(tmp_path: Path) -> None:
    run_together(DDP_EQUIVALENCE, tmp_path, timeout=220).check()
    results = [json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in (0, 1)]
    # 16 samples per rank per epoch, micro-batch 2 -> 8 micro-batches; 2 per step for 2 steps, then 4
    factors = [2, 2, 4, 4, 4]
    window_end = [False, True, False, True, False, False, False, True] + [False, False, False, True] * 2
    for result in results:
        assert result["factors"] == factors
        assert result["global_step"] == len(factors)
        assert result["synced"] == window_end  # all-reduce only on the micro-batch that ends a window
        assert result["zero_grad_at"] == [0, 2, 4, 8, 12]
        manual = result["manual"]  # manual optimization with the helper: same windows, same sync pattern
        assert manual["factors"] == factors and manual["global_step"] == len(factors)
        assert manual["synced"] == window_end
        torch.testing.assert_close(torch.tensor(manual["params"]), torch.tensor(result["params"]))
    assert results[0]["params"] == results[1]["params"]
    # DistributedSampler (no shuffle) gives rank r samples r, r+2, ...; the two ranks' micro-batch j together
    # are samples 4j..4j+3, so the run equals one process stepping on windows of 4-sample batches
    x, y = make_data(32)
    expected = reference_sgd(x, y, sequential_windows(32, 4, factors, 2), factors)
    torch.testing.assert_close(torch.tensor(results[0]["params"]), expected)


WORLD_SIZE_CHANGE = (
    _PRELUDE
    + """
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
phase = sys.argv[1]
model = TinyModel(n=32, batch_size=2)
observer = Observer()
schedule = {"name": "constant_global", "global_batch_size": 8}
if phase == "1":
    kwargs = trainer_kwargs(devices=1, max_epochs=1, accumulate_grad_batches=schedule)
else:
    kwargs = trainer_kwargs(devices=2, strategy="ddp", max_epochs=2, accumulate_grad_batches=schedule,
                            use_distributed_sampler=False)
trainer = pl.Trainer(**lplugins.compose(**kwargs))
lplugins.attach(trainer, observer)
trainer.fit(model, ckpt_path=None if phase == "1" else "phase1.ckpt")
if phase == "1":
    trainer.save_checkpoint("phase1.ckpt")
scheduler = [cb for cb in trainer.callbacks if type(cb).__name__ == "AccumulationScheduler"][0]
result = {"factors": observer.factors, "global_step": trainer.global_step, "params": params(model).tolist(),
          "state": scheduler.state_dict()}
with open(f"phase{phase}_{trainer.global_rank}.json", "w") as f:
    json.dump(result, f)
"""
)


@pytest.mark.timeout(300)
def test_constant_global_batch_is_kept_when_world_size_grows_on_resume(tmp_path: Path) -> None:
    run_together(WORLD_SIZE_CHANGE, tmp_path, timeout=120, args=["1"], ranks=1).check()
    phase2 = run_together(WORLD_SIZE_CHANGE, tmp_path, timeout=170, args=["2"]).check()
    one = json.loads((tmp_path / "phase1_0.json").read_text())
    assert one["factors"] == [4] * 4  # 1 process x micro-batch 2 x 4 = 8
    assert one["state"]["world_size"] == 1
    for rank in (0, 1):
        two = json.loads((tmp_path / f"phase2_{rank}.json").read_text())
        assert two["factors"] == [2] * 4  # 2 processes x micro-batch 2 x 2 = 8
        assert two["global_step"] == 8
        assert two["state"]["world_size"] == 2 and two["state"]["samples"] == 64
    assert "world size changed from 1 to 2" in phase2.stderr
    # logged once, by rank zero only (both ranks configured logging at INFO)
    said = re.findall(
        r"lplugins: gradient accumulation per .*: 2 micro-batch\(es\) per optimizer step, "
        r"effective global batch 8",
        phase2.stderr,
    )
    assert len(said) == 1
    # a global batch of 8 throughout: the same as plain SGD on sequential batches of 8, over both phases
    x, y = make_data(32)
    expected = reference_sgd(x, y, sequential_windows(32, 8, [1] * 8, 2), [1] * 8)
    torch.testing.assert_close(torch.tensor(two["params"]), expected)
