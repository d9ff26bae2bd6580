"""DurableCheckpoint names and step triggers: never mid-accumulation, one epoch convention, filename templates."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, Trainer, seed_everything

import lplugins
from lplugins.callbacks import CheckpointConfigError, DurableCheckpoint, latest_checkpoint
from lplugins.callbacks._record import COMMIT_SUFFIX
from lplugins.callbacks._storages import open_storage
from tests.models import Regression, regression_loader

BATCHES_PER_EPOCH = 8


def fit(cb: Callback, *, extra: list[Callback] | None = None, ckpt_path: str | None = None, **kw: Any) -> Trainer:
    seed_everything(7, verbose=False)
    kw = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False, **kw}
    trainer = Trainer(callbacks=[cb, *(extra or [])], **kw)
    trainer.fit(Regression(), regression_loader(4 * BATCHES_PER_EPOCH, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def names(d: Path) -> list[str]:
    return sorted(p for p in os.listdir(d) if not p.endswith(COMMIT_SUFFIX))


def committed(d: Path) -> list[tuple[int, int, str]]:
    return [(r.global_step, r.epoch, r.name) for r in open_storage(d).find_committed()]


# ------------------------------------------------------------------------------------------ accumulation
def test_step_trigger_never_saves_mid_accumulation(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, every_n_steps=2, save_on_train_end=False, keep_last=None)
    fit(cb, accumulate_grad_batches=2, max_steps=6)
    # 12 micro-batches, 6 optimizer steps: saves after steps 2, 4, 6 only (never step 0, mid-window)
    assert [s for s, _, _ in committed(tmp_path)] == [2, 4, 6]


def test_step_trigger_never_saves_mid_accumulation_with_a_schedule(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, every_n_steps=2, save_on_train_end=False, keep_last=None)
    kwargs = lplugins.compose(accelerator="cpu", accumulate_grad_batches={0: 2, 1: 4}, callbacks=[cb], max_steps=6)
    seed_everything(7, verbose=False)
    trainer = Trainer(**kwargs, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), regression_loader(4 * BATCHES_PER_EPOCH, batch_size=4))
    # epoch 0: 8 micro-batches at 2 -> steps 1..4; epoch 1 at 4 -> steps 5, 6
    assert [s for s, _, _ in committed(tmp_path)] == [2, 4, 6]


def test_no_step_zero_checkpoint_from_a_step_trigger(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, every_n_steps=1, save_on_train_end=False, keep_last=None)
    fit(cb, accumulate_grad_batches=4, max_steps=2)
    assert [s for s, _, _ in committed(tmp_path)] == [1, 2]


# ------------------------------------------------------------------------------------------ epoch in names
def test_end_of_fit_inside_epoch_0_is_named_epoch_0(tmp_path: Path) -> None:
    fit(DurableCheckpoint(tmp_path), max_steps=3)
    assert committed(tmp_path) == [(3, 0, "step=000000003-epoch=0000.ckpt")]


def test_every_name_uses_the_0_based_epoch_of_its_step(tmp_path: Path) -> None:
    # 8 steps per epoch; 2 epochs: end of epoch 0 (step 8), step 12 (epoch 1), end of epoch 1 / end of fit (16)
    cb = DurableCheckpoint(tmp_path, every_n_steps=12, every_n_epochs=1, keep_last=None)
    fit(cb, max_epochs=2)
    assert committed(tmp_path) == [
        (8, 0, "step=000000008-epoch=0000.ckpt"),
        (12, 1, "step=000000012-epoch=0001.ckpt"),
        (16, 1, "step=000000016-epoch=0001.ckpt"),
    ]


def test_end_of_fit_after_the_last_epoch_keeps_its_epoch(tmp_path: Path) -> None:
    # max_epochs ends fit after the epoch loop advanced current_epoch: the step still belongs to epoch 1
    fit(DurableCheckpoint(tmp_path, every_n_epochs=None), max_epochs=2)
    assert committed(tmp_path) == [(16, 1, "step=000000016-epoch=0001.ckpt")]


# ------------------------------------------------------------------------------------------ filename templates
def test_filename_template_names_epoch_step_and_metrics_like_lightning(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, filename="{epoch}-{step}-{loss:.3f}", every_n_steps=4, keep_last=None)
    fit(cb, max_steps=8)
    got = committed(tmp_path)
    assert [(s, e) for s, e, _ in got] == [(4, 0), (8, 0)]
    for step, epoch, name in got:
        assert re.fullmatch(rf"epoch={epoch}-step={step}-loss=\d+\.\d{{3}}\.ckpt", name), name
    assert cb.committed == [str(tmp_path / n) for _, _, n in got]


def test_filename_template_without_metric_names_and_with_format_specs(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, filename="run-{epoch:02d}_{step:05d}", auto_insert_metric_name=False)
    fit(cb, max_steps=3)
    assert names(tmp_path) == ["run-00_00003.ckpt"]


def test_filename_template_keeps_the_commit_protocol(tmp_path: Path) -> None:
    # the same name twice (no step in it): -vN, newest by commit order; retention; leftovers cleaned
    template = "model-{epoch}"
    fit(DurableCheckpoint(tmp_path, filename=template, every_n_steps=2, keep_last=2), max_steps=6)
    assert names(tmp_path) == ["model-epoch=0-v1.ckpt", "model-epoch=0-v2.ckpt"]  # v0 (step 2) retired
    assert latest_checkpoint(tmp_path) == str(tmp_path / "model-epoch=0-v2.ckpt")
    # a crash between rename and marker leaves data with a template name and no marker
    (tmp_path / "model-epoch=0-v3.ckpt").write_bytes(b"partial")
    (tmp_path / "notes.ckpt").write_bytes(b"not ours")  # a name the template cannot make: left alone
    trainer = fit(DurableCheckpoint(tmp_path, filename=template, keep_last=2), max_steps=7, ckpt_path="latest")
    assert trainer.ckpt_path == str(tmp_path / "model-epoch=0-v2.ckpt")
    # the leftover v3 was removed at start; the free name model-epoch=0 is used again
    assert names(tmp_path) == ["model-epoch=0-v2.ckpt", "model-epoch=0.ckpt", "notes.ckpt"]
    assert [s for s, _, _ in committed(tmp_path)] == [6, 7]


def test_filename_metric_not_logged_yet_is_nan_with_a_warning(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, filename="{step}-{val_loss:.2f}")
    with pytest.warns(UserWarning, match="'val_loss' is not logged"):
        fit(cb, max_steps=2)
    assert names(tmp_path) == ["step=2-val_loss=nan.ckpt"]


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("{epoch", "brace"),
        ("epoch}", "brace"),
        ("{}-{step}", "names no field"),
        ("{step!r}", "conversions"),
        ("{val loss}", "unknown field"),
        ("{step[0]}", "unknown field"),
        ("{step:s}", "format spec"),
        ("{val_loss:d}", "format spec"),
        ("sub/{step}", "no '/'"),
        ("{step}.ckpt", "appended"),
        ("", "non-empty"),
    ],
)
def test_malformed_filename_template_fails_at_construction_naming_filename(template: str, why: str) -> None:
    with pytest.raises(CheckpointConfigError, match=rf"filename={re.escape(repr(template))}.*{re.escape(why)}"):
        DurableCheckpoint(filename=template)


def test_latest_on_a_plain_trainer_without_durable_checkpoint_names_the_fix(tmp_path: Path) -> None:
    # a plain Trainer, built without compose or attach: lplugins meets it through Lightning's
    # callbacks_factory entry point (installed with the package), before fit parses ckpt_path
    from lplugins.callbacks import CheckpointResumeError

    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(CheckpointResumeError, match=r"no DurableCheckpoint: add DurableCheckpoint\(dirpath=\.\.\.\)"):
        trainer.fit(Regression(), regression_loader(8), ckpt_path="latest")
