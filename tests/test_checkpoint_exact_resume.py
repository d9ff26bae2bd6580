"""Exact resume from any step: a mid-epoch checkpoint continues with the same samples, in the same order.

Each test trains an uninterrupted reference, then the same run stopped (``max_steps``, or a crash after a
save) at mid-epoch batches and resumed with ``ckpt_path="latest"`` to the same final step: the final
weights must be equal bit for bit (CPU).
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lplugins import _lightning
from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._position import PositionedSampler
from tests._dist import run_together
from tests.models import Regression

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
FEATURES, SAMPLES, BATCH = 4, 40, 4  # 10 batches an epoch


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


class Crash(Callback):
    """Raises after the batch that ends optimizer step ``at`` (after the callback's save of that step)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            raise RuntimeError("crash")


def fit(
    root: Path,
    max_steps: int,
    *,
    loader: Any = None,
    crash_at: int | None = None,
    every_n_steps: int | None = None,
    **trainer_kw: Any,
) -> Regression:
    model = Regression(FEATURES, dropout=0.3, seed=0)  # dropout: the RNG state matters
    ckpt = DurableCheckpoint(root / "ckpts", every_n_steps=every_n_steps, preemption_signals=())
    callbacks: list[Callback] = [ckpt] + ([Crash(crash_at)] if crash_at is not None else [])
    trainer = Trainer(default_root_dir=root, max_steps=max_steps, callbacks=callbacks, **QUIET, **trainer_kw)
    data = loader() if callable(loader) else DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    try:
        trainer.fit(model, data, ckpt_path="latest")
    except RuntimeError as err:
        assert crash_at is not None and "crash" in str(err)
    return model


def assert_resumes_exactly(tmp_path: Path, stops: list[int], final: int, **kw: Any) -> None:
    reference = fit(tmp_path / "reference", final, **kw)
    for stop in stops:
        fit(tmp_path / "stopped", stop, **kw)
    resumed = fit(tmp_path / "stopped", final, **kw)
    assert torch.equal(weights(resumed), weights(reference)), (weights(resumed) - weights(reference)).abs().max()


# ------------------------------------------------------------------------------ single process
def test_shuffled_run_stopped_mid_epoch_resumes_bit_for_bit(tmp_path: Path) -> None:
    # fails without the data position: the resumed epoch restarts at its first batch, in a new order
    assert_resumes_exactly(tmp_path, [3, 13, 17], 25)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_crash_after_a_mid_epoch_save_resumes_bit_for_bit(tmp_path: Path, shuffle: bool, workers: int) -> None:
    def loader() -> DataLoader[Any]:
        return DataLoader(
            dataset(), batch_size=BATCH, shuffle=shuffle, num_workers=workers, persistent_workers=workers > 0
        )

    # saved at every step (on_train_batch_end), crashed mid-epoch: the kill of the SIGKILL trials
    reference = fit(tmp_path / "reference", 22, loader=loader, every_n_steps=1)
    for crash in (7, 14):
        fit(tmp_path / "crashed", 30, loader=loader, crash_at=crash, every_n_steps=1)
    resumed = fit(tmp_path / "crashed", 22, loader=loader, every_n_steps=1)
    assert torch.equal(weights(resumed), weights(reference))


def test_gradient_accumulation_resumes_bit_for_bit(tmp_path: Path) -> None:
    # 10 batches an epoch, 2 per optimizer step: steps 3 and 8 end mid-epoch (batches 6 of epoch 0, 6 of epoch 1)
    assert_resumes_exactly(tmp_path, [3, 8], 12, accumulate_grad_batches=2)


def test_a_sampler_generator_of_the_user_is_replayed(tmp_path: Path) -> None:
    def loader() -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5))

    # the generator advances each epoch: a resume in epoch 1 must not start it from its seed again
    assert_resumes_exactly(tmp_path, [14], 25, loader=loader)


def test_the_resume_is_announced_once_and_the_dataloader_is_given_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lplugins")
    fit(tmp_path, 13)
    caplog.clear()
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    batch_sampler = loader.batch_sampler
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, 15, loader=lambda: loader)
    lines = [r.getMessage() for r in caplog.records if "resuming mid-epoch" in r.getMessage()]
    assert lines == [
        "lplugins: DurableCheckpoint: resuming mid-epoch 1 at batch 3 of 10, same order (the 3 trained batches"
        " are skipped as indices)."
    ]
    # Lightning's "your dataloader is not resumable" is wrong here: kept off for this fit only
    assert not [w for w in caught if str(w.message).startswith(_lightning.NOT_RESUMABLE_WARNING)]
    assert not [f for f in warnings.filters if f[1] is not None and "ended before the epoch" in f[1].pattern]
    assert loader.batch_sampler is batch_sampler and not isinstance(loader.batch_sampler, PositionedSampler)


def test_a_checkpoint_of_state_version_1_still_loads(tmp_path: Path) -> None:
    fit(tmp_path, 3)
    ckpt = next((tmp_path / "ckpts").glob("*.ckpt"))
    state = torch.load(ckpt, weights_only=True)
    (key,) = [k for k in state["callbacks"] if k.startswith("DurableCheckpoint")]
    assert state["callbacks"][key]["version"] == 2
    callback = DurableCheckpoint(tmp_path / "x")
    old = {k: v for k, v in state["callbacks"][key].items() if k != "position"} | {"version": 1}
    callback.load_state_dict(old)  # no position: no error, nothing to replay
    assert callback._position._loaded is None


# ------------------------------------------------------------------------------ stateful and iterable loaders
class StatefulLoader:
    """A loader with ``state_dict``/``load_state_dict``: Lightning saves and restores it itself."""

    def __init__(self) -> None:
        self.data = dataset()
        self.epoch, self.position, self._resume_at = 0, 0, 0

    def __len__(self) -> int:
        return SAMPLES // BATCH

    def __iter__(self) -> Iterator[Any]:
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + self.epoch))
        start, self._resume_at = self._resume_at, 0
        for position in range(start, SAMPLES // BATCH):
            idx = order[position * BATCH : (position + 1) * BATCH]
            self.position = position + 1
            yield self.data[idx]
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._resume_at = state["epoch"], state["position"]


def test_a_stateful_loader_is_left_to_lightning_and_resumes_bit_for_bit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lplugins")
    assert_resumes_exactly(tmp_path, [4, 13], 18, loader=StatefulLoader)
    lines = [r.getMessage() for r in caplog.records if "resuming mid-epoch" in r.getMessage()]
    assert lines[-1].endswith("at batch 3 of 10; the train dataloader restores its own position.")


class UnsizedStatefulLoader(StatefulLoader):
    __len__ = None  # type: ignore[assignment]  # Lightning then fetches one batch ahead


def test_a_stateful_loader_without_len_is_told_that_lightning_fetched_ahead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lplugins")
    fit(tmp_path, 4, loader=UnsizedStatefulLoader)
    fit(tmp_path, 6, loader=UnsizedStatefulLoader)
    (line,) = [r.getMessage() for r in caplog.records if "resuming mid-epoch" in r.getMessage()]
    assert "restores its own position. Without a len(), Lightning fetched one batch ahead" in line


class Stream(IterableDataset[Any]):
    def __iter__(self) -> Iterator[Any]:
        yield from dataset()


def test_an_iterable_dataset_without_state_is_named_with_what_it_must_provide(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def loader() -> DataLoader[Any]:
        return DataLoader(Stream(), batch_size=BATCH)

    caplog.set_level(logging.INFO, logger="lplugins")
    fit(tmp_path, 3, loader=loader)
    fit(tmp_path, 5, loader=loader)
    (line,) = [r.getMessage() for r in caplog.records if "resuming mid-epoch" in r.getMessage()]
    assert "the data order is NOT restored: the train dataloader's dataset is an IterableDataset (Stream)" in line
    assert "state_dict()/load_state_dict()" in line


# ------------------------------------------------------------------------------ DDP, 2 processes
DDP_JOB = r"""
import json, sys
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader
from lplugins import _lightning
from lplugins.callbacks import DurableCheckpoint
from tests.models import Regression
from tests.test_checkpoint_exact_resume import BATCH, FEATURES, dataset, weights

root, max_steps, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = Regression(FEATURES, dropout=0.3, seed=0)
cb = DurableCheckpoint(root + "/ckpts", every_n_steps=int(sys.argv[4]) or None, preemption_signals=())
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps, callbacks=[cb],
                     logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
loader = DataLoader(dataset(), batch_size=BATCH, shuffle=True, num_workers=workers)  # 5 batches a rank
trainer.fit(model, loader, ckpt_path="latest")
with open(f"{root}/weights.{trainer.global_rank}.json", "w") as f:
    json.dump(weights(model).tolist(), f)
"""


@pytest.mark.distributed
@pytest.mark.timeout(600)
# workers=0 in the extended tier: workers=1 takes the same DistributedSampler path, and the in-process loader
# state (workers=0) is covered by test_crash_after_a_mid_epoch_save_resumes_bit_for_bit
@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.extended), 1])
def test_ddp_with_the_distributed_sampler_resumes_bit_for_bit(tmp_path: Path, workers: int) -> None:
    def job(root: Path, max_steps: int, every: int = 0) -> list[float]:
        root.mkdir(exist_ok=True)
        run_together(DDP_JOB, tmp_path, timeout=240, args=[str(root), str(max_steps), str(workers), str(every)]).check()
        per_rank = [json.loads((root / f"weights.{r}.json").read_text()) for r in (0, 1)]
        assert per_rank[0] == per_rank[1]
        return per_rank[0]

    reference = job(tmp_path / "reference", 12)
    job(tmp_path / "stopped", 2)  # batch 2 of 5 in epoch 0 (train-end save)
    job(tmp_path / "stopped", 8)  # batch 3 of 5 in epoch 1
    assert job(tmp_path / "stopped", 12) == reference


class Epochs(Callback):
    """Records ``(global_step, current_epoch, batch_idx)`` at every batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append((trainer.global_step, trainer.current_epoch, batch_idx))


def test_the_epoch_count_after_a_max_steps_stop_is_the_uninterrupted_runs(tmp_path: Path) -> None:
    # Lightning counts the epoch that max_steps stopped as finished in its train-end save; resumed, the rest of that
    # epoch was numbered one higher (current_epoch, max_epochs, checkpoint names)
    def run(root: Path, max_steps: int) -> tuple[Trainer, list[tuple[int, int, int]]]:
        epochs = Epochs()
        ckpt = DurableCheckpoint(root / "ckpts", every_n_steps=None, preemption_signals=())
        trainer = Trainer(default_root_dir=root, max_steps=max_steps, callbacks=[ckpt, epochs], **QUIET)
        trainer.fit(
            Regression(FEATURES, seed=0), DataLoader(dataset(), batch_size=BATCH, shuffle=True), ckpt_path="latest"
        )
        return trainer, epochs.seen

    reference, full = run(tmp_path / "reference", 25)
    run(tmp_path / "stopped", 6)  # batch 6 of epoch 0's 10
    run(tmp_path / "stopped", 17)  # batch 7 of epoch 1's
    resumed, rest = run(tmp_path / "stopped", 25)
    assert rest == full[17:]
    assert (resumed.current_epoch, resumed.global_step) == (reference.current_epoch, reference.global_step) == (3, 25)
