"""FSDP2 on CPU: real 2-process gloo jobs -- the same losses as DDP, real sharding, durable checkpoints that resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lplugins
from lplugins import LPluginsError
from lplugins.strategies import FSDP2Strategy
from tests._dist import run_together

COMMON = r"""
import json, sys, torch, lightning.pytorch as pl
from torch import nn
import lplugins
from lplugins.callbacks import DurableCheckpoint
from tests.models import Regression, regression_loader

class MLP(Regression):
    def __init__(self):
        super().__init__(8, (32, 32), activation="relu", lr=0.01, step_lr=3)

class Mixed(pl.LightningModule):
    # parameters outside any container: a direct child layer, and one the module holds itself
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.scale = nn.Parameter(torch.ones(16))
        self.out = nn.Linear(16, 1)
        self.losses = []
    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self(x) * self.scale.mean() - y) ** 2).mean()
        self.losses.append(loss.item())
        return loss
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

def data():
    return regression_loader(64, features=8, batch_size=8)

def fit(strategy, callbacks=(), ckpt_path=None, model_class=None, **kw):
    pl.seed_everything(0, verbose=False)
    model = (model_class or MLP)()
    trainer = pl.Trainer(**lplugins.compose(
        strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks), **kw))
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return trainer, model
"""


def test_shard_argument_is_checked() -> None:
    with pytest.raises(LPluginsError, match=r"nn\.Module subclasses"):
        FSDP2Strategy(shard=["Linear"])  # type: ignore[list-item]


def test_registered_name_composes_on_cpu(lplugins_manager: lplugins.PluginManager) -> None:
    kwargs = lplugins.compose(strategy="fsdp2", accelerator="cpu", devices=2)
    assert isinstance(kwargs["strategy"], FSDP2Strategy)
    assert "fsdp2" in lplugins_manager.registry("strategy")


@pytest.mark.timeout(300)
def test_fsdp2_on_cpu_matches_ddp_and_shards_parameters(tmp_path: Path) -> None:
    script = (
        COMMON
        + r"""
class Shards(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor
        params = list(pl_module.parameters())
        self.seen = {
            "all_dtensor": all(isinstance(p, DTensor) for p in params),
            "local": sum(p.to_local().numel() for p in params),
            "total": sum(p.numel() for p in params),
            "units": getattr(trainer.strategy, "sharded_units", None),
        }

shards = Shards()
trainer, fsdp = fit("fsdp2", max_steps=6, callbacks=[shards])
_, ddp = fit("ddp_timeout", max_steps=6)
_, fsdp_mixed = fit("fsdp2", max_steps=6, model_class=Mixed)
_, ddp_mixed = fit("ddp_timeout", max_steps=6, model_class=Mixed)
with open(f"out{trainer.global_rank}.json", "w") as f:
    json.dump({"fsdp2": fsdp.losses, "ddp": ddp.losses, "fsdp2_mixed": fsdp_mixed.losses,
               "ddp_mixed": ddp_mixed.losses, **shards.seen}, f)
trainer.strategy.barrier()
"""
    )
    run_together(script, tmp_path, timeout=240).check()
    out = [json.loads((tmp_path / f"out{rank}.json").read_text()) for rank in (0, 1)]
    total = 8 * 32 + 32 + 32 * 32 + 32 + 32 + 1
    for rank_out in out:
        assert len(rank_out["fsdp2"]) == 6
        assert rank_out["fsdp2"] == pytest.approx(rank_out["ddp"], rel=1e-5, abs=1e-7)
        assert len(rank_out["fsdp2_mixed"]) == 6
        assert rank_out["fsdp2_mixed"] == pytest.approx(rank_out["ddp_mixed"], rel=1e-5, abs=1e-7)
        assert rank_out["all_dtensor"] is True
        assert rank_out["total"] == total
        assert rank_out["units"] == 3  # the three Linear layers of the Sequential
    assert out[0]["local"] + out[1]["local"] == total  # each element lives on exactly one rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("distributed", [False, True], ids=["full-file", "sharded-dir"])
def test_fsdp2_durable_checkpoints_resume_bit_for_bit(tmp_path: Path, distributed: bool) -> None:
    script = (
        COMMON
        + rf"""
from lplugins.strategies import FSDP2Strategy

def strategy():
    return FSDP2Strategy(save_distributed_checkpoint={distributed})

_, full = fit(strategy(), [DurableCheckpoint("full", every_n_epochs=1)], max_epochs=2)
_, first = fit(strategy(), [DurableCheckpoint("run", every_n_epochs=1)], max_epochs=1)
trainer, rest = fit(strategy(), [DurableCheckpoint("run", every_n_epochs=1)], max_epochs=2, ckpt_path="latest")
with open(f"out{{trainer.global_rank}}.json", "w") as f:
    json.dump({{"full": full.losses, "first": first.losses, "rest": rest.losses,
               "resumed_from": trainer.ckpt_path}}, f)
trainer.strategy.barrier()
"""
    )
    run_together(script, tmp_path, timeout=280).check()
    for rank in (0, 1):
        out = json.loads((tmp_path / f"out{rank}.json").read_text())
        assert out["resumed_from"].endswith("step=000000004-epoch=0000.ckpt")
        assert len(out["full"]) == 8
        assert out["first"] + out["rest"] == out["full"]  # bit for bit
    checkpoint = tmp_path / "run" / "step=000000004-epoch=0000.ckpt"
    assert checkpoint.is_dir() is distributed


@pytest.mark.timeout(300)
def test_fsdp2_validate_after_fit_reuses_the_sharded_model(tmp_path: Path) -> None:
    script = (
        COMMON
        + r"""
class Val(MLP):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

trainer, model = fit("fsdp2", max_steps=2, model_class=Val)
metrics = trainer.validate(model, data())
print(json.dumps({"rank": trainer.global_rank, "val_loss": metrics[0]["val_loss"]}))
"""
    )
    result = run_together(script, tmp_path, timeout=280).check()
    seen = result.json_objects()
    assert sorted(r["rank"] for r in seen) == [0, 1] and seen[0]["val_loss"] == seen[1]["val_loss"]
