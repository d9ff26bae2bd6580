"""DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU processes (gloo), through the named lplugins strategies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import run_together

pytest.importorskip("deepspeed")

SCRIPT = r"""
import json, os, sys
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
import deepspeed
import lplugins
from tests.models import Regression

NAME, OUT = sys.argv[1], sys.argv[2]


def full_params(module):
    # a collective under ZeRO-3 (gathers the shards), a no-op otherwise: call it on every rank
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params), torch.no_grad():
        loss = float(torch.nn.functional.mse_loss(module.net(x), y))  # on the whole training set
        return [p.detach().clone().flatten().tolist() for p in params], loss


class Probe(pl.Callback):
    def __init__(self):
        self.losses, self.start = [], None

    def on_train_start(self, trainer, module):
        params, loss = full_params(module)
        self.start = {"step": trainer.global_step, "params": params, "loss": loss}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, module):
        opt = trainer.strategy.deepspeed_engine.optimizer.optimizer  # the torch Adam over this rank's partition
        state = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        params, loss = full_params(module)
        self.end = {"step": trainer.global_step, "params": params, "loss": loss, "adam_state_numel": state}


g = torch.Generator().manual_seed(0)
x = torch.randn(128, 8, generator=g)
y = x.sum(1, keepdim=True)
train = DataLoader(TensorDataset(x, y), batch_size=8)
val = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8)
common = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=2, val_check_interval=4)


def trainer(max_steps, probe):
    return pl.Trainer(**lplugins.compose(strategy=NAME, max_steps=max_steps, callbacks=[probe], **common))


torch.manual_seed(1)
model = Regression(8, (32,), lr=1e-2)
num_params = sum(p.numel() for p in model.parameters())
first = Probe()
t1 = trainer(8, first)
t1.fit(model, train, val)
ckpt = os.path.join(OUT, "ckpt")
t1.save_checkpoint(ckpt)  # every rank: DeepSpeed writes its shard
val_after_fit = float(t1.callback_metrics["val_loss"])

torch.manual_seed(2)  # a differently initialised model: resume must overwrite it
second = Probe()
t2 = trainer(12, second)
resumed = Regression(8, (32,), lr=1e-2)
t2.fit(resumed, train, val, ckpt_path=ckpt)
metrics = t2.validate(resumed, val, verbose=False)  # standalone validation: DeepSpeed's inference engine

result = {
    "rank": t2.global_rank,
    "world_size": t2.world_size,
    "strategy": type(t2.strategy).__module__ + "." + type(t2.strategy).__name__,
    "stage": t2.strategy.config["zero_optimization"]["stage"],
    "num_params": num_params,
    "first": {"losses": first.losses, "start": first.start, "end": first.end},
    "resume": {
        "start": second.start, "end_step": second.end["step"], "end_loss": second.end["loss"], "losses": second.losses
    },
    "val_after_fit": val_after_fit,
    "validate": metrics[0]["val_loss"],
    "ckpt_is_dir": os.path.isdir(ckpt),
}
with open(os.path.join(OUT, f"rank{t2.global_rank}.json"), "w") as f:
    json.dump(result, f)
torch.distributed.barrier()  # rank 0 must not exit (and end the job) before rank 1 has written
"""


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("name", "stage"), [("deepspeed_stage_2_cpu", 2), ("deepspeed_stage_3_cpu", 3)])
def test_zero_on_two_cpu_processes(tmp_path: Path, name: str, stage: int) -> None:
    # the first run in a fresh environment JIT-builds DeepSpeed's small CPU op with ninja (about a minute)
    run_together(SCRIPT, tmp_path, timeout=400, args=[name, str(tmp_path)]).check()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for res in ranks:
        assert res["world_size"] == 2
        assert res["strategy"] == "lplugins.strategies.deepspeed.DeepSpeedStrategy"
        assert res["stage"] == stage
        losses = res["first"]["losses"]
        assert len(losses) == 8
        # the loss on the whole training set decreases, and keeps decreasing after the resume
        assert res["first"]["end"]["loss"] < 0.8 * res["first"]["start"]["loss"], res["first"]
        assert res["resume"]["start"]["loss"] == res["first"]["end"]["loss"]
        assert res["resume"]["end_loss"] < res["resume"]["start"]["loss"]
        # ZeRO shards Adam's two moment buffers: each rank holds about half of 2 x num_params
        full_state = 2 * res["num_params"]
        share = res["first"]["end"]["adam_state_numel"] / full_state
        assert 0.45 <= share <= 0.6, (share, res["first"]["end"]["adam_state_numel"], full_state)
        # resume continues from the same step with the same parameters
        assert res["first"]["end"]["step"] == 8
        assert res["resume"]["start"]["step"] == 8
        assert res["resume"]["start"]["params"] == res["first"]["end"]["params"]
        assert res["resume"]["end_step"] == 12
        assert len(res["resume"]["losses"]) == 4
        # validation ran inside fit and standalone
        assert res["val_after_fit"] > 0
        assert res["validate"] > 0
        assert res["ckpt_is_dir"]
    # both ranks hold the same full parameters, and together the whole optimizer state
    assert ranks[0]["first"]["end"]["params"] == ranks[1]["first"]["end"]["params"]
    total = sum(r["first"]["end"]["adam_state_numel"] for r in ranks)
    assert total >= 2 * ranks[0]["num_params"]


ACCUMULATION_SCRIPT = r"""
import copy, json, os, sys
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
import lplugins
from tests.models import Regression

OUT = sys.argv[1]


def sgd_model():
    return Regression(seed=0, optimizer="sgd", lr=0.1)


class SetSteps(pl.Callback):
    def on_train_start(self, trainer, module):
        trainer.strategy.set_gradient_accumulation_steps(4)


# every sample is the same: whatever the accumulation, one optimizer step must equal one SGD step
# on that sample's loss
x = torch.randn(1, 4, generator=torch.Generator().manual_seed(0)).repeat(64, 1)
y = torch.full((64, 1), 3.0)
reference = sgd_model()
loss = torch.nn.functional.mse_loss(reference(x[:1]), y[:1])
loss.backward()
expected = [(p - 0.1 * p.grad).detach().flatten().tolist() for p in reference.parameters()]

results = {}
for label, accumulate, callbacks in (("trainer_k2", 2, []), ("engine_k4", 1, [SetSteps()])):
    model = sgd_model()
    trainer = pl.Trainer(**lplugins.compose(
        strategy="deepspeed_stage_2_cpu", accelerator="cpu", devices=2, max_steps=1, logger=False,
        accumulate_grad_batches=accumulate, callbacks=callbacks, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False))
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=2))
    results[label] = {
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "gas": trainer.strategy.deepspeed_engine.gradient_accumulation_steps(),
        "batches": trainer.fit_loop.epoch_loop.batch_progress.total.ready,
    }
results["expected"] = expected
with open(os.path.join(OUT, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(results, f)
torch.distributed.barrier()
"""


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_accumulation_divides_the_loss_once(tmp_path: Path) -> None:
    # Lightning's DeepSpeed integration divides by k twice (Lightning, then engine.backward): each micro-batch
    # adds 1/k**2 of its gradient, a window 1/k of the right one
    run_together(ACCUMULATION_SCRIPT, tmp_path, timeout=280, args=[str(tmp_path)]).check()
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for label, k in (("trainer_k2", 2), ("engine_k4", 4)):
            assert res[label]["gas"] == k
            assert res[label]["batches"] == k  # one optimizer step consumed k micro-batches
            for got, want in zip(res[label]["params"], res["expected"], strict=True):
                assert got == pytest.approx(want, abs=1e-6), (label, got, want)
