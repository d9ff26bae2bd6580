"""A stock ``ModelCheckpoint`` file saved mid-epoch, resumed under lplugins' strategies (issue #41, item 3).

Lightning resumes it with a fresh iterator: the epoch's first batches are trained again, its last ones never.
Under a strategy lplugins provides, the epoch continues at its batch when the loaders' order is fixed by the
epoch (a ``DistributedSampler``, which Lightning gives every multi-process strategy), or one line on rank zero
says why it restarts. Trainers with Lightning's own strategies are left as they are.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import LambdaCallback, ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lplugins
from lplugins.callbacks._resume_position import ResumePosition
from tests._dist import run_together
from tests.models import Regression

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """DDP on one process, in this one: what Lightning sets for it is undone after the test."""
    lplugins.load()  # the strategy names
    for var in ("LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "")  # remembered as unset, restored so by monkeypatch
        monkeypatch.delenv(var)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)  # 10 batches an epoch


def fit(root: Path, max_steps: int, strategy: str, ckpt_path: str | None = None, **kw: Any) -> Trainer:
    torch.manual_seed(0)
    model = Regression(4, seed=0)  # no dropout: a ModelCheckpoint file holds no random state
    saves = ModelCheckpoint(root / "ckpts", every_n_train_steps=3, save_top_k=-1)
    trainer = Trainer(
        default_root_dir=root, max_steps=max_steps, strategy=strategy, devices=1, callbacks=[saves], **QUIET, **kw
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    trainer.weights = torch.cat([p.detach().flatten() for p in model.parameters()])  # type: ignore[attr-defined]
    return trainer


def resume(tmp_path: Path, strategy: str, caplog: pytest.LogCaptureFixture, **kw: Any) -> tuple[Trainer, Trainer]:
    reference = fit(tmp_path / "reference", 16, strategy, **kw)
    fit(tmp_path / "stopped", 6, strategy, **kw)
    saved = tmp_path / "stopped" / "ckpts" / "epoch=0-step=6.ckpt"  # batch 6 of epoch 0's 10
    caplog.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed = fit(tmp_path / "stopped", 16, strategy, ckpt_path=str(saved), **kw)
    resumed.warned = [str(w.message) for w in seen]  # type: ignore[attr-defined]
    return reference, resumed


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "mid-epoch" in r.getMessage()]


@pytest.mark.usefixtures("one_rank")
def test_a_stock_checkpoint_continues_its_epoch_at_its_batch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lplugins")
    reference, resumed = resume(tmp_path, "ddp_timeout", caplog)
    # without lplugins the resumed epoch trains a fresh iterator's first 4 batches as its batches 6-9
    assert torch.equal(resumed.weights, reference.weights), (resumed.weights - reference.weights).abs().max()
    (line,) = lines(caplog)
    assert "mid-epoch 0 at batch 6 of 10 from" in line and "epoch=0-step=6.ckpt" in line
    assert "same order (the 6 trained batches are skipped as indices" in line
    assert not [w for w in resumed.warned if w.startswith(NOT_RESUMABLE)]  # the one line replaces Lightning's


@pytest.mark.usefixtures("one_rank")
def test_an_order_drawn_from_the_random_state_is_said_to_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lplugins")
    # without Lightning's DistributedSampler: the loader's RandomSampler drew its order from torch's generator
    _, resumed = resume(tmp_path, "ddp_timeout", caplog, use_distributed_sampler=False)
    (line,) = lines(caplog)
    assert "mid-epoch 0 at batch 6 of 10" in line and "the data order is NOT restored" in line
    assert "RandomSampler drew the epoch's order from the state of torch's global generator" in line
    assert "the epoch's remaining batches come from a fresh iterator" in line and "DurableCheckpoint" in line
    assert not [w for w in resumed.warned if w.startswith(NOT_RESUMABLE)]


@pytest.mark.usefixtures("one_rank")
def test_lightning_strategies_are_left_as_lightning_made_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lplugins")
    stock = Trainer(strategy="ddp", devices=1, **QUIET)
    assert not [cb for cb in stock.callbacks if isinstance(cb, ResumePosition)]
    ours = Trainer(strategy="ddp_timeout", devices=1, **QUIET)
    assert len([cb for cb in ours.callbacks if isinstance(cb, ResumePosition)]) == 1
    reference, resumed = resume(tmp_path, "ddp", caplog)
    assert not lines(caplog)
    assert [w for w in resumed.warned if w.startswith(NOT_RESUMABLE)]  # Lightning's own warning, as without lplugins
    assert not torch.equal(resumed.weights, reference.weights)  # and its fresh iterator


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["fsdp2", pytest.param("deepspeed_stage_2_cpu", marks=pytest.mark.extended)])
def test_two_ranks_resume_a_stock_checkpoint_at_its_batch(tmp_path: Path, strategy: str) -> None:
    script = rf"""
import json, torch, lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import lplugins
from tests.models import Regression, regression_loader

lplugins.load()

def fit(root, max_steps, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    model = Regression(8, (16,), lr=0.01)
    trainer = pl.Trainer(
        strategy={strategy!r}, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, max_steps=max_steps,
        callbacks=[ModelCheckpoint(root + "/ckpts", every_n_train_steps=3, save_top_k=-1)])
    # 96 samples, 2 ranks x 8: 6 batches an epoch per rank, shuffled by Lightning's DistributedSampler
    trainer.fit(model, regression_loader(96, features=8, batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    return trainer, model

_, full = fit("full", 9)
_, first = fit("run", 3)
import glob
saved = sorted(glob.glob("run/ckpts/epoch=0-step=3*"))[0]
trainer, rest = fit("run", 9, ckpt_path=saved)
print(json.dumps({{"rank": trainer.global_rank, "full": full.losses, "first": first.losses, "rest": rest.losses}}))
"""
    result = run_together(script, tmp_path, timeout=280).check()
    outs = result.json_objects()
    assert sorted(o["rank"] for o in outs) == [0, 1]
    for out in outs:
        assert len(out["full"]) == 9 and len(out["first"]) == 3
        assert out["first"] + out["rest"] == out["full"]  # bit for bit: the same samples, in the same order
    said = [
        line for line in result.stderr.splitlines() + result.stdout.splitlines() if "mid-epoch 0 at batch 3" in line
    ]
    assert len(said) == 1 and "same order" in said[0], said  # once, on rank zero


# ------------------------------------------------------------------------------ found by the attack
class FailAt(Callback):
    """Fails the batch that would make optimizer step ``at`` (before it is trained)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            raise RuntimeError("failed")


@pytest.mark.usefixtures("one_rank")
def test_a_file_saved_while_a_batch_failed_resumes_at_that_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lplugins")
    reference = fit(tmp_path / "reference", 16, "ddp_timeout")
    torch.manual_seed(0)
    saves = OnExceptionCheckpoint(tmp_path / "failed", filename="on_exception")
    trainer = Trainer(max_steps=16, strategy="ddp_timeout", devices=1, callbacks=[saves, FailAt(6)], **QUIET)
    with pytest.raises(RuntimeError, match="failed"):
        trainer.fit(Regression(4, seed=0), loader())
    # the failed batch counts as started, not trained: Lightning trains it again, and so must the data order
    resumed = fit(tmp_path / "failed", 16, "ddp_timeout", ckpt_path=str(tmp_path / "failed" / "on_exception.ckpt"))
    assert torch.equal(resumed.weights, reference.weights)
    (line,) = lines(caplog)
    assert "mid-epoch 0 at batch 6 of 10" in line and "same order" in line


@pytest.mark.usefixtures("one_rank")
def test_a_failed_fit_gives_the_loaders_and_lightnings_warning_back(tmp_path: Path) -> None:
    fit(tmp_path, 6, "ddp_timeout", use_distributed_sampler=False)
    data = loader()  # without Lightning's DistributedSampler: the user's own DataLoader is the one trained
    wrapped = []
    seen = LambdaCallback(on_train_start=lambda t, m: wrapped.append(type(data.batch_sampler).__name__))
    trainer = Trainer(
        max_steps=16, strategy="ddp_timeout", devices=1, callbacks=[FailAt(8), seen], use_distributed_sampler=False,
        **QUIET,
    )  # fmt: skip
    filters = list(warnings.filters)
    with pytest.raises(RuntimeError, match="failed"):
        trainer.fit(Regression(4, seed=0), data, ckpt_path=str(tmp_path / "ckpts" / "epoch=0-step=6.ckpt"))
    assert wrapped == ["PositionedSampler"]  # wrapped for the fit, Lightning's warning replaced by one line
    assert type(data.batch_sampler).__name__ == "BatchSampler"  # and the user's own again after the failure
    assert list(warnings.filters) == filters


@pytest.mark.usefixtures("one_rank")
def test_a_checkpoint_whose_epochs_had_another_length_is_said_to_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lplugins")
    fit(tmp_path, 14, "ddp_timeout")  # 10 batches an epoch: saved at step 12, batch 2 of epoch 1
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 4, generator=g)  # now 12 batches an epoch (as on another world size)
    longer = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    trainer = Trainer(max_steps=16, strategy="ddp_timeout", devices=1, **QUIET)
    trainer.fit(Regression(4, seed=0), longer, ckpt_path=str(tmp_path / "ckpts" / "epoch=1-step=12.ckpt"))
    (line,) = lines(caplog)
    assert "mid-epoch 1 at batch 2 of 12" in line and "NOT restored" in line
    assert "trained 10 batches in its 1 epoch(s) before this one, not 1 x 12" in line
