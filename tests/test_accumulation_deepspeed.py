"""Accumulation schedules with DeepSpeed ZeRO-2 on 2 CPU processes (gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._dist import ROOT, run_together
from tests.test_accumulation import make_data, reference_sgd, sequential_windows

pytest.importorskip("deepspeed")

SCRIPT = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
import lightning.pytorch as pl
import lplugins
from lplugins.accumulation import ScheduleError
from tests.test_accumulation import TinyModel, params, trainer_kwargs

common = dict(devices=2, max_epochs=2, use_distributed_sampler=False)
schedule = {{"name": "step", "schedule": {{0: 2, 2: 4}}}}

# 1. a DeepSpeed config that fixes gradient_accumulation_steps is refused, before training
strategy = {{"name": "deepspeed_stage_2_cpu", "config": {{"zero_optimization": {{"stage": 2}},
                                                         "gradient_accumulation_steps": 4}}}}
trainer = pl.Trainer(**lplugins.compose(**trainer_kwargs(strategy=strategy, accumulate_grad_batches=schedule,
                                                          **common)))
model = TinyModel(n=32)
before = params(model).tolist()
try:
    trainer.fit(model)
    conflict = None
except ScheduleError as exc:
    conflict = str(exc)
unchanged = params(model).tolist() == before


class EngineSteps(pl.Callback):
    # micro-batches per real DeepSpeed optimizer step, read from the engine's own step counter
    def __init__(self):
        self.window, self.factors, self.last, self.gas = 0, [], 0, []

    def on_train_start(self, trainer, *args):
        self.last = trainer.strategy.deepspeed_engine.global_steps  # restored on resume

    def on_train_batch_start(self, trainer, *args):
        self.window += 1
        self.gas.append(trainer.strategy.deepspeed_engine.gradient_accumulation_steps())

    def on_train_batch_end(self, trainer, *args):
        steps = trainer.strategy.deepspeed_engine.global_steps
        if steps > self.last:
            self.factors.append(self.window)
            self.window, self.last = 0, steps


# 2. the schedule drives the engine: its accumulation steps change at run time, at window starts;
#    epoch 1 is trained after a resume from DeepSpeed's checkpoint of epoch 0
result = {{"conflict": conflict, "unchanged": unchanged, "factors": [], "gas": []}}
model = TinyModel(n=32)
for epochs, ckpt in ((1, None), (2, "ds.ckpt")):
    probe = EngineSteps()
    trainer = pl.Trainer(**lplugins.compose(**trainer_kwargs(strategy="deepspeed_stage_2_cpu",
                                                              accumulate_grad_batches=schedule,
                                                              **{{**common, "max_epochs": epochs}})))
    lplugins.attach(trainer, probe)
    if ckpt:
        model = TinyModel(n=32)  # a fresh model: the resume must restore everything
    trainer.fit(model, ckpt_path=ckpt)
    if not ckpt:
        trainer.save_checkpoint("ds.ckpt")  # every rank: DeepSpeed writes its shard
    result["factors"] += probe.factors
    result["gas"] += probe.gas
result.update(global_step=trainer.global_step, params=params(model).tolist())
with open(f"ds_{{trainer.global_rank}}.json", "w") as f:
    json.dump(result, f)
"""


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_deepspeed_engine_follows_the_schedule_across_a_resume_and_config_conflict_is_refused(tmp_path: Path) -> None:
    run_together(SCRIPT, tmp_path, timeout=400).check()
    factors = [2, 2, 4, 4, 4]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"ds_{rank}.json").read_text())
        assert result["conflict"] is not None
        assert "gradient_accumulation_steps=4" in result["conflict"] and "'auto'" in result["conflict"]
        assert result["unchanged"]
        assert result["factors"] == factors
        assert result["gas"] == [2] * 4 + [4] * 4 + [4] * 8  # the engine's own setting, per micro-batch
        assert result["global_step"] == len(factors)
    # ZeRO-2 over 2 ranks with the schedule == plain SGD on the same windows (see the DDP test)
    x, y = make_data(32)
    expected = reference_sgd(x, y, sequential_windows(32, 4, factors, 2), factors)
    torch.testing.assert_close(torch.tensor(result["params"]), expected)
