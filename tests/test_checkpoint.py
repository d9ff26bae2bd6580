"""DurableCheckpoint, single process: arguments, triggers, retention, atomic commit, resume, safe loading."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader

from lplugins.callbacks import (
    CheckpointDirectoryError,
    DurableCheckpoint,
    UnsafeCheckpointError,
    latest_checkpoint,
    request_checkpoint,
)
from lplugins.callbacks._record import COMMIT_SUFFIX, Record
from lplugins.callbacks._storages import open_storage
from tests.models import Regression, regression_loader

STEPS_PER_EPOCH = 4


def tiny_model() -> Regression:
    """Linear model with dropout (so the RNG matters) and an LR scheduler (so its state matters)."""
    return Regression(dropout=0.5, lr=0.05, step_lr=3)


def loader() -> DataLoader:
    return regression_loader(4 * STEPS_PER_EPOCH, batch_size=4, shuffle=True)


def fit(cb: Callback, *, ckpt_path: str | None = None, extra: list[Callback] | None = None, **kw: Any) -> Regression:
    seed_everything(7, verbose=False)
    model = tiny_model()
    trainer = Trainer(
        accelerator="cpu", callbacks=[cb, *(extra or [])], logger=False, enable_progress_bar=False,
        enable_model_summary=False, **kw,
    )  # fmt: skip
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    model.resumed_from = trainer.ckpt_path  # what ckpt_path="latest" resolved to
    return model


def names(d: Path) -> list[str]:
    return sorted(p for p in os.listdir(d) if not p.endswith(COMMIT_SUFFIX))


def steps(d: Path) -> list[int]:
    return [r.global_step for r in open_storage(d).find_committed()]


# ------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"every_n_steps": 1.5}, "every_n_steps"),
        ({"every_n_epochs": -1}, "every_n_epochs"),
        ({"every_n_seconds": 0}, "every_n_seconds"),
        ({"every_n_seconds": float("inf")}, "every_n_seconds"),
        ({"keep_last": 0}, "keep_last"),
        ({"keep_top": -1}, "keep_top"),
        ({"keep_top": 2}, "keep_top"),
        ({"mode": "best"}, "mode"),
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"verify": "crc"}, "verify"),
        ({"preemption_signals": ["SIGNOPE"]}, "preemption_signals"),
        ({"preemption_exit_code": 300}, "preemption_exit_code"),
        ({"crc32": False, "verify": "deep"}, "crc32"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        DurableCheckpoint(**kwargs)


def test_unwritable_directory_fails_at_setup_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    model = tiny_model()
    trainer = Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
        callbacks=[DurableCheckpoint(blocker / "ckpts", every_n_steps=1)],
    )  # fmt: skip
    with pytest.raises(CheckpointDirectoryError, match="a_file"):
        trainer.fit(model, loader())
    assert model.steps_run == 0


def test_registered_as_builtin_callback(lplugins_manager: Any) -> None:
    cb = lplugins_manager.get("callback", "durable_checkpoint").create(every_n_steps=5)
    assert isinstance(cb, DurableCheckpoint)
    assert cb.every_n_steps == 5


# ------------------------------------------------------------------------------------------ triggers, retention
def test_step_epoch_and_end_triggers_together(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, every_n_steps=3, every_n_epochs=2, keep_last=None)
    fit(cb, max_steps=10)
    # steps 3, 6, 9; end of epoch 2 (after step 8); end of fit (step 10)
    assert steps(tmp_path) == [3, 6, 8, 9, 10]
    assert len(names(tmp_path)) == 5  # no temporary or uncommitted entries


def test_time_trigger_saves_at_step_boundaries(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, every_n_seconds=1e-9, save_on_train_end=False, keep_last=None)
    fit(cb, max_steps=3)
    assert steps(tmp_path) == [1, 2, 3]


class LogScore(Callback):
    """Logs a score whose best value (min) is at step 2."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        pl_module.log("score", float(abs(trainer.global_step - 2)))


def test_keep_last_and_top_k_together(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, every_n_steps=1, keep_last=2, keep_top=1, monitor="score", mode="min")
    fit(cb, max_steps=7, extra=[LogScore()])
    assert steps(tmp_path) == [2, 6, 7]
    assert [Path(p).name for p in cb.committed] == names(tmp_path)


def test_retention_deletes_only_after_a_newer_commit(tmp_path: Path) -> None:
    seen: list[list[int]] = []

    class Watch(Callback):
        def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
            seen.append(steps(tmp_path))

    fit(DurableCheckpoint(tmp_path, every_n_steps=1, keep_last=1), max_steps=4, extra=[Watch()])
    # never none, and always the newest committed one; older ones may still be there for a while (retention
    # deletes on a background thread at a lower CPU priority, after the newer commit: under load it can lag
    # a few steps)
    assert len(seen) == 4 and seen[0] == []
    for step, committed in enumerate(seen[1:], start=1):
        assert committed and committed[-1] == step and set(committed) <= set(range(1, step + 1)), seen
    assert steps(tmp_path) == [4]  # every delete is done when fit returns


# ------------------------------------------------------------------------------------------ commit protocol, resume
def test_leftovers_are_invisible_and_cleaned_at_next_start(tmp_path: Path) -> None:
    fit(DurableCheckpoint(tmp_path, every_n_steps=2, keep_last=None), max_steps=4)
    assert steps(tmp_path) == [2, 4]
    newest = tmp_path / "step=000000004-epoch=0000.ckpt"
    # a crash mid-write: temp data; a crash between rename and marker: data with no marker;
    # a newer committed file truncated afterwards
    (tmp_path / ".tmp.step=000000005-epoch=0001.ckpt.abc").write_bytes(b"partial")
    (tmp_path / "step=000000006-epoch=0001.ckpt").write_bytes(newest.read_bytes())
    data = newest.read_bytes()
    rec = Record.from_json((tmp_path / ("step=000000004-epoch=0000.ckpt" + COMMIT_SUFFIX)).read_bytes())
    rec.name, rec.global_step = "step=000000007-epoch=0001.ckpt", 7
    (tmp_path / rec.name).write_bytes(data[: len(data) // 2])
    (tmp_path / (rec.name + COMMIT_SUFFIX)).write_bytes(rec.to_json())

    assert latest_checkpoint(tmp_path) == str(newest)
    model = fit(
        DurableCheckpoint(tmp_path, every_n_steps=100, save_on_train_end=False), max_steps=5, ckpt_path="latest"
    )
    assert model.steps_run == 1  # resumed at step 4, past the truncated step-7 one
    assert model.resumed_from == str(newest)
    # uncommitted leftovers removed; the committed but truncated step-7 one moved aside, never deleted
    assert names(tmp_path) == ["quarantine", "step=000000002-epoch=0000.ckpt", "step=000000004-epoch=0000.ckpt"]
    assert sorted(os.listdir(tmp_path / "quarantine" / rec.name)) == ["REASON.txt", rec.name, rec.name + ".commit"]


def test_latest_with_no_checkpoint_starts_fresh(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    model = fit(DurableCheckpoint(tmp_path, every_n_steps=100), max_steps=2, ckpt_path="latest")
    assert model.steps_run == 2
    assert model.resumed_from is None
    assert steps(tmp_path) == [2]


@pytest.mark.parametrize("save", ["epoch", "train_end"])
def test_resumed_losses_equal_uninterrupted_bit_for_bit(tmp_path: Path, save: str) -> None:
    def make(d: Path) -> DurableCheckpoint:
        return DurableCheckpoint(d, every_n_epochs=1 if save == "epoch" else None, keep_last=2)

    full = fit(make(tmp_path / "full"), max_epochs=4).losses
    first = fit(make(tmp_path / "cut"), max_epochs=2).losses
    rest = fit(make(tmp_path / "cut"), max_epochs=4, ckpt_path="latest").losses
    assert first + rest == full  # exact float equality: model, Adam, StepLR, dropout RNG and shuffling


class Payload:
    def __reduce__(self) -> Any:
        return (os.system, (f"touch {os.environ['LPLUGINS_TEST_PWNED']}",))


def test_pickled_code_payload_is_refused_and_never_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("LPLUGINS_TEST_PWNED", str(pwned))  # LPLUGINS_* is exempt from the leak check
    ckdir = tmp_path / "ckpts"
    fit(DurableCheckpoint(ckdir, every_n_steps=1, keep_last=1), max_steps=1)
    good = Path(latest_checkpoint(ckdir) or "")
    evil = torch.load(good, weights_only=True)
    evil["payload"] = Payload()
    storage = open_storage(ckdir)
    rec = Record.from_json((ckdir / (good.name + COMMIT_SUFFIX)).read_bytes())
    rec.name, rec.global_step = "step=000000009-epoch=0000.ckpt", 9
    storage.write_durable(rec.name, lambda target: torch.save(evil, target))
    rec.size, rec.crc32 = storage.size(rec.name), storage.file_crc32(rec.name)  # a forged marker that fits
    storage.commit(rec)
    assert latest_checkpoint(ckdir) == str(ckdir / rec.name)  # structurally fine: it is picked ...

    def trainer() -> Trainer:
        return Trainer(
            accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
            callbacks=[DurableCheckpoint(ckdir, every_n_steps=100, save_on_train_end=False)],
        )  # fmt: skip

    # an explicit path: refused, naming the file and the disallowed type
    model = tiny_model()
    with pytest.raises(UnsafeCheckpointError, match=r"step=000000009.*holds posix\.system.*nothing in it was executed"):
        trainer().fit(model, loader(), ckpt_path=str(ckdir / rec.name))
    assert model.steps_run == 0
    # "latest": refused too, skipped, and the older good checkpoint resumed (it is left in place, not quarantined)
    model = tiny_model()
    t = trainer()
    t.fit(model, loader(), ckpt_path="latest")
    assert t.ckpt_path == str(good) and model.steps_run == 1
    assert (ckdir / rec.name).exists()
    assert not pwned.exists()


# ------------------------------------------------------------------------------------------ requests, async, signals
class RequestOnRankZero(Callback):
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1 and trainer.is_global_zero:
            request_checkpoint(trainer)


def test_request_checkpoint_saves_at_next_step_boundary(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, save_on_train_end=False, keep_last=None)
    fit(cb, max_steps=3, extra=[RequestOnRankZero()])
    assert steps(tmp_path) == [2]
    with pytest.raises(ValueError, match="no DurableCheckpoint"):
        request_checkpoint(Trainer(logger=False, enable_progress_bar=False))


def test_async_saves_match_sync_saves(tmp_path: Path) -> None:
    fit(DurableCheckpoint(tmp_path / "sync", every_n_steps=1, keep_last=None), max_steps=4)
    cb = DurableCheckpoint(tmp_path / "async", every_n_steps=1, keep_last=None, async_save=True, max_in_flight=2)
    fit(cb, max_steps=4)
    assert steps(tmp_path / "async") == steps(tmp_path / "sync") == [1, 2, 3, 4]
    for name in names(tmp_path / "sync"):
        a = torch.load(tmp_path / "async" / name, weights_only=True)
        s = torch.load(tmp_path / "sync" / name, weights_only=True)
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "loops"):
            torch.testing.assert_close(a[key], s[key], rtol=0, atol=0)


class SendSignal(Callback):
    def __init__(self, sig: int, at_step: int) -> None:
        self.sig, self.at_step = sig, at_step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_saves_stops_and_restores_handlers(tmp_path: Path, sig: int) -> None:
    def previous(signum: int, frame: Any) -> None:  # pragma: no cover - must not be called
        raise AssertionError("the previous handler ran")

    old = signal.signal(sig, previous)
    try:
        cb = DurableCheckpoint(tmp_path, every_n_steps=100, preemption_exit_code=None)
        model = fit(cb, max_steps=10, extra=[SendSignal(sig, 3)])
        assert signal.getsignal(sig) is previous
    finally:
        signal.signal(sig, old)
    assert cb.preempted
    assert model.steps_run == 3
    assert steps(tmp_path) == [3]


def test_preemption_exits_with_documented_code(tmp_path: Path) -> None:
    cb = DurableCheckpoint(tmp_path, every_n_steps=100)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        fit(cb, max_steps=10, extra=[SendSignal(signal.SIGTERM, 2)])
    assert info.value.code == 75
    assert signal.getsignal(signal.SIGTERM) is before
    assert steps(tmp_path) == [2]


def test_fsspec_memory_filesystem_round_trip() -> None:
    url = "memory://lplugins-ckpt-test"
    try:
        fit(DurableCheckpoint(url, every_n_steps=2, keep_last=1), max_steps=4)
        latest = latest_checkpoint(url)
        assert latest == url + "/step=000000004-epoch=0000.ckpt"
        model = fit(DurableCheckpoint(url, every_n_steps=100), max_steps=5, ckpt_path="latest")
        assert model.steps_run == 1
    finally:
        import fsspec

        fsspec.filesystem("memory").rm("/lplugins-ckpt-test", recursive=True)


def test_docs_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "checkpoint.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    for _ in range(2):  # the second run resumes from the first one's checkpoints
        exec(compile(example, "docs/checkpoint.md", "exec"), namespace)
    assert namespace["checkpoint"].committed
    assert namespace["trainer"].global_step == 16


def test_two_callbacks_in_different_directories_have_distinct_state(tmp_path: Path) -> None:
    a, b = DurableCheckpoint(tmp_path / "a"), DurableCheckpoint(tmp_path / "b")
    assert a.state_key != b.state_key


def test_slurm_requeue_calls_scontrol_for_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lplugins.callbacks._preemption import slurm_requeue

    fake = tmp_path / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "called"}\n')
    fake.chmod(0o755)
    with monkeypatch.context() as env:  # undone inside the test: the leak check runs before monkeypatch's undo
        env.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        env.setenv("SLURM_JOB_ID", "1234")
        slurm_requeue()
        assert (tmp_path / "called").read_text().split() == ["requeue", "1234"]
        env.setenv("SLURM_ARRAY_JOB_ID", "77")
        env.setenv("SLURM_ARRAY_TASK_ID", "3")
        slurm_requeue()
        assert (tmp_path / "called").read_text().split() == ["requeue", "77_3"]


def test_fresh_run_in_a_used_directory_is_newer_and_never_reuses_a_name(tmp_path: Path) -> None:
    fit(DurableCheckpoint(tmp_path, every_n_steps=3, keep_last=None), max_steps=6)
    assert steps(tmp_path) == [3, 6]
    # a new run from scratch (no resume) into the same directory
    fit(DurableCheckpoint(tmp_path, every_n_steps=3, keep_last=2), max_steps=6)
    # its checkpoints are the newest (commit order), the old ones went first, and no name was reused
    assert names(tmp_path) == ["step=000000003-epoch=0000-v1.ckpt", "step=000000006-epoch=0001-v1.ckpt"]
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step=000000006-epoch=0001-v1.ckpt")


def test_resume_does_not_save_the_loaded_state_again(tmp_path: Path) -> None:
    fit(DurableCheckpoint(tmp_path, every_n_steps=4, keep_last=None), max_steps=4)
    fit(DurableCheckpoint(tmp_path, every_n_steps=4, keep_last=None), max_steps=4, ckpt_path="latest")
    assert names(tmp_path) == ["step=000000004-epoch=0000.ckpt"]


def test_deep_verify_falls_back_past_a_flipped_byte(tmp_path: Path) -> None:
    fit(DurableCheckpoint(tmp_path, every_n_steps=1, keep_last=None), max_steps=2)
    newest = tmp_path / "step=000000002-epoch=0000.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, archive directory intact: only the CRC notices
    newest.write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) == str(newest)
    assert latest_checkpoint(tmp_path, deep=True) == str(tmp_path / "step=000000001-epoch=0000.ckpt")
    cb = DurableCheckpoint(tmp_path, every_n_steps=100, save_on_train_end=False, verify="deep")
    assert fit(cb, max_steps=3, ckpt_path="latest").steps_run == 2


def test_without_crc32_saves_resume_the_same(tmp_path: Path) -> None:
    full = fit(DurableCheckpoint(tmp_path / "a", every_n_epochs=1, crc32=False), max_epochs=2).losses
    first = fit(DurableCheckpoint(tmp_path / "b", every_n_epochs=1, crc32=False), max_epochs=1).losses
    rest = fit(DurableCheckpoint(tmp_path / "b", every_n_epochs=1, crc32=False), max_epochs=2, ckpt_path="latest")
    assert first + rest.losses == full
