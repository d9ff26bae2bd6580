"""Resuming, in Lightning's words and out loud: ``"last"`` and ``"latest"``, and what rank zero is told."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lplugins.callbacks import CheckpointResumeError, DurableCheckpoint
from lplugins.callbacks._resume import understand_ckpt_path
from tests.models import Regression, regression_loader

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def fit(trainer: Trainer, ckpt_path: str | None) -> Regression:
    seed_everything(7, verbose=False)
    model = Regression()
    trainer.fit(model, regression_loader(32, batch_size=4), ckpt_path=ckpt_path)
    return model


def durable_trainer(d: Path, max_steps: int, **kw: Any) -> Trainer:
    return Trainer(callbacks=[DurableCheckpoint(d, every_n_steps=2, **kw)], max_steps=max_steps, **QUIET)


def lplugins_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lplugins"]


@pytest.fixture
def caplog_info(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="lplugins")
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    return caplog


# ------------------------------------------------------------------------------------------ "last"
def test_last_with_a_durable_checkpoint_resumes_from_its_newest_committed(
    tmp_path: Path, caplog_info: pytest.LogCaptureFixture
) -> None:
    fit(durable_trainer(tmp_path, 3), None)
    caplog_info.clear()
    trainer = durable_trainer(tmp_path, 5)
    model = fit(trainer, "last")
    newest = str(tmp_path / "step=000000003-epoch=0000.ckpt")
    assert trainer.ckpt_path == newest
    assert model.steps_run == 2  # steps 4 and 5 only
    lines = lplugins_lines(caplog_info)
    assert sum("ckpt_path='last'" in line for line in lines) == 1, lines
    assert not any("no last checkpoint available" in r.getMessage() for r in caplog_info.records)


def test_last_in_a_second_fit_of_the_same_trainer(tmp_path: Path) -> None:
    trainer = durable_trainer(tmp_path, 2)
    fit(trainer, None)
    trainer.fit_loop.epoch_loop.max_steps = 4
    model = fit(trainer, "last")
    assert trainer.ckpt_path == str(tmp_path / "step=000000002-epoch=0000.ckpt")
    assert model.steps_run == 2


def test_last_without_a_durable_checkpoint_is_lightnings(tmp_path: Path) -> None:
    trainer = Trainer(callbacks=[ModelCheckpoint(tmp_path, save_last=True)], max_steps=2, **QUIET)
    fit(trainer, None)
    trainer = Trainer(callbacks=[ModelCheckpoint(tmp_path, save_last=True)], max_steps=3, **QUIET)
    understand_ckpt_path(trainer, DurableCheckpoint)  # as if lplugins had seen this Trainer: "last" stays Lightning's
    fit(trainer, "last")
    assert trainer.ckpt_path == str(tmp_path / "last.ckpt")


# ------------------------------------------------------------------------------------------ "latest"
def test_latest_skips_a_damaged_newer_checkpoint_and_says_why(tmp_path: Path) -> None:
    from lplugins.callbacks._latest import newest_loadable
    from lplugins.callbacks._storages import open_storage

    fit(durable_trainer(tmp_path, 4, keep_last=None), None)
    newest = tmp_path / "step=000000004-epoch=0000.ckpt"
    newest.write_bytes(newest.read_bytes()[:100])
    record, skipped = newest_loadable(open_storage(tmp_path))
    assert record is not None and record.global_step == 2
    assert [name for name, _ in skipped] == [newest.name] and "truncated" in skipped[0][1]


def test_latest_without_a_durable_checkpoint_names_the_fix(tmp_path: Path) -> None:
    trainer = Trainer(max_steps=1, default_root_dir=tmp_path, **QUIET)
    understand_ckpt_path(trainer, DurableCheckpoint)
    with pytest.raises(
        CheckpointResumeError, match=r"add DurableCheckpoint\(dirpath=\.\.\.\) to the Trainer's callbacks"
    ):
        fit(trainer, "latest")


def test_latest_resume_is_announced_with_path_step_and_why(
    tmp_path: Path, caplog_info: pytest.LogCaptureFixture
) -> None:
    fit(durable_trainer(tmp_path, 4, keep_last=None), None)
    # a newer commit whose data was truncated afterwards is skipped, and the announcement says so
    newest = tmp_path / "step=000000004-epoch=0000.ckpt"
    newest.write_bytes(newest.read_bytes()[:100])
    caplog_info.clear()
    trainer = durable_trainer(tmp_path, 5)
    fit(trainer, "latest")
    expected = str(tmp_path / "step=000000002-epoch=0000.ckpt")
    assert trainer.ckpt_path == expected
    [line] = [m for m in lplugins_lines(caplog_info) if "ckpt_path='latest'" in m]
    assert f"resuming from {expected} (step 2, epoch 0" in line
    assert "newest committed checkpoint" in line
    # the damaged one was moved to the quarantine at setup, before resolving, and that was said too
    [moved] = [m for m in lplugins_lines(caplog_info) if "quarantine" in m]
    assert "step=000000004-epoch=0000.ckpt is damaged (size 100 != committed size" in moved
    assert not any("leftover" in m for m in lplugins_lines(caplog_info))  # it was committed: not a leftover
    messages = [r.getMessage() for r in caplog_info.records]
    assert not any(m.endswith("checkpoint path at latest") for m in messages), messages


def test_latest_with_no_checkpoint_says_starting_fresh(tmp_path: Path, caplog_info: pytest.LogCaptureFixture) -> None:
    trainer = durable_trainer(tmp_path / "empty", 1)
    fit(trainer, "latest")
    assert trainer.ckpt_path is None
    lines = lplugins_lines(caplog_info)
    assert f"lplugins: ckpt_path='latest': no committed checkpoint in {tmp_path / 'empty'}: starting fresh" in lines
    messages = [r.getMessage() for r in caplog_info.records]
    assert not any("checkpoint path at latest" in m for m in messages), messages  # Lightning's misleading line


def test_messages_reach_the_terminal_without_logging_setup(tmp_path: Path) -> None:
    script = f"""
import sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from lightning.pytorch import Trainer
from lplugins.callbacks import DurableCheckpoint
from tests.models import Regression, regression_loader
for steps, ckpt in ((2, "latest"), (3, "last")):
    t = Trainer(callbacks=[DurableCheckpoint({str(tmp_path)!r})], max_steps=steps, accelerator="cpu", logger=False,
                enable_progress_bar=False, enable_model_summary=False)
    t.fit(Regression(), regression_loader(16), ckpt_path=ckpt)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    text = out.stdout + out.stderr
    assert f"ckpt_path='latest': no committed checkpoint in {tmp_path}: starting fresh" in text
    assert "fit(ckpt_path='last') means DurableCheckpoint's newest committed checkpoint" in text
    assert f"resuming from {tmp_path / 'step=000000002-epoch=0000.ckpt'} (step 2" in text
    assert "checkpoint path at latest" not in text and "no last checkpoint available" not in text


def test_a_trainer_with_a_durable_checkpoint_still_pickles(tmp_path: Path) -> None:
    # ddp_spawn pickles the Trainer: the ckpt_path reader set on it in Trainer() must pickle with it
    import pickle

    trainer = pickle.loads(pickle.dumps(durable_trainer(tmp_path, 1)))
    fit(trainer, None)
    model = fit(durable_trainer(tmp_path, 2), "last")
    assert model.steps_run == 1
