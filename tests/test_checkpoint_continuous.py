"""``DurableCheckpoint(continuous=True)``: a new asynchronous save starts at the first step boundary after the
previous one has committed, never while one is being written; bad combinations are refused before training."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lplugins.callbacks import CheckpointConfigError, DurableCheckpoint, _async
from lplugins.callbacks._background import WRITER_NICE
from lplugins.callbacks._record import Record
from lplugins.callbacks._storages import open_storage
from lplugins.callbacks._writer import CheckpointWriter
from tests.models import Regression, regression_loader

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def test_continuous_without_async_save_is_refused_naming_both() -> None:
    with pytest.raises(CheckpointConfigError, match=r"continuous=True .* set async_save=True"):
        DurableCheckpoint(continuous=True)


def test_continuous_keeping_every_checkpoint_is_refused() -> None:
    with pytest.raises(CheckpointConfigError, match=r"continuous=True with keep_last=None .* set keep_last"):
        DurableCheckpoint(continuous=True, async_save=True, keep_last=None)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_continuous_must_be_a_real_bool(value: Any) -> None:
    with pytest.raises(CheckpointConfigError, match=rf"continuous={value!r} is not allowed; it must be True or False"):
        DurableCheckpoint(continuous=value, async_save=True)


class HeldWrites:
    """Holds every background write until the training thread has taken ``hold`` more step boundaries."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.started: list[int] = []  # the step of each save, when its write began
        self.in_flight = 0
        self.most_in_flight = 0
        self.release = threading.Event()
        self.committed = threading.Event()
        self.lock = threading.Lock()
        self.free = False  # from train end on, writes are not held

    def write_file(self, writer: CheckpointWriter, record: Record, checkpoint: dict[str, Any]) -> None:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.started.append(record.global_step)
        if not self.free:
            assert self.release.wait(60), "the test never released the write"
            self.release.clear()
        try:
            ORIGINAL_WRITE(writer, record, checkpoint)
        finally:
            with self.lock:
                self.in_flight -= 1
            self.committed.set()


ORIGINAL_WRITE = CheckpointWriter.write_file


class Releaser(Callback):
    """Runs before the checkpoint callback (Lightning puts checkpoint callbacks last) at each step boundary:
    ``hold`` boundaries after a save began, it lets that write commit and waits for the commit."""

    def __init__(self, held: HeldWrites) -> None:
        self.held = held

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        held = self.held
        writer = next(c for c in trainer.callbacks if isinstance(c, DurableCheckpoint))._writer
        queue = writer._queue if isinstance(writer, _async.AsyncWriter) else None  # not busy(): it times a step
        deadline = time.monotonic() + 60
        while queue is not None and queue.in_flight and not held.in_flight:  # queued: let its write begin
            assert time.monotonic() < deadline, "the queued write never began"
            time.sleep(0.001)
        if held.in_flight and trainer.global_step == held.started[-1] + held.hold:
            held.committed.clear()
            held.release.set()
            assert held.committed.wait(60)
            if queue is not None:
                queue.flush()  # and the writer's job has ended (the queue counts it in flight until then)

    def on_train_end(self, trainer: Trainer, *args: Any) -> None:
        self.held.free = True
        while self.held.in_flight:  # the last save, before the callback finishes it
            self.held.committed.clear()
            self.held.release.set()
            assert self.held.committed.wait(60)


def test_a_new_save_starts_at_the_first_boundary_after_the_previous_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldWrites(hold=3)
    monkeypatch.setattr(CheckpointWriter, "write_file", lambda self, record, ckpt: held.write_file(self, record, ckpt))
    cb = DurableCheckpoint(tmp_path, continuous=True, async_save=True, keep_last=2, max_slowdown=None)
    trainer = Trainer(max_steps=11, callbacks=[cb, Releaser(held)], **QUIET)
    trainer.fit(Regression(), regression_loader(64, batch_size=4))

    # step 1 saves; its write commits at step 4, where the next save starts; and so on. Train end (step 11)
    # saves what the last continuous save (step 10) left.
    assert held.started == [1, 4, 7, 10, 11]
    assert held.most_in_flight == 1
    records = open_storage(str(tmp_path)).find_committed()
    assert [r.global_step for r in records] == [10, 11]  # keep_last=2
    assert [r.reason for r in records] == ["continuous", "train_end"]
    restored = torch.load(Path(cb.committed[-1]), weights_only=True)
    assert restored["global_step"] == 11


def test_continuous_saves_every_step_when_writes_keep_up(tmp_path: Path) -> None:
    cb = DurableCheckpoint(
        tmp_path, continuous=True, async_save=True, keep_last=1, save_on_train_end=False, max_slowdown=None
    )
    # each step lasts until the previous write has committed, however loaded the machine (no timing assumption)
    Trainer(max_steps=5, callbacks=[cb, WritesKeepUp(cb)], **QUIET).fit(
        Regression(), regression_loader(64, batch_size=4)
    )
    assert len(cb.save_stalls) == 5  # a save at every step boundary
    assert [r.global_step for r in open_storage(str(tmp_path)).find_committed()] == [5]


class WritesKeepUp(Callback):
    """Ends each step only once the checkpoint's background writes are done: writes that always keep up."""

    def __init__(self, checkpoint: DurableCheckpoint) -> None:
        self.checkpoint = checkpoint

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        writer = self.checkpoint._writer
        assert writer is not None
        writer.flush()


@pytest.mark.parametrize("value", [0, -0.1, 1, 1.5, float("nan"), float("inf"), "0.05", True])
def test_a_max_slowdown_outside_zero_to_one_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(CheckpointConfigError, match=r"max_slowdown="):
        DurableCheckpoint(continuous=True, async_save=True, max_slowdown=value)


class VirtualSteps(Callback):
    """Steps of ``quiet`` seconds, ``busy`` while a save is being written, on the pacer's clock (no sleep: the
    figures the pacer sees do not depend on the machine's load). Runs before the checkpoint callback."""

    def __init__(self, held: HeldWrites, quiet: float, busy: float) -> None:
        self.held, self.quiet, self.busy = held, quiet, busy
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.now += self.busy if self.held.in_flight else self.quiet


@pytest.mark.parametrize("max_slowdown", [0.05, None])
def test_continuous_saves_rest_as_long_as_their_cost_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, max_slowdown: float | None
) -> None:
    """Each write lasts 2 steps, which it makes 10x slower (10 -> 100 ms): within a 5 % budget the pacer rests
    ``S * (0.9 / 0.05 - 1)`` after each save (S: the save's 0.2 s, 3.4 s) once it has timed 3 steps of each kind;
    None never rests. The steps' times are virtual and each write commits at a chosen boundary: exact counts."""
    held = HeldWrites(hold=2)
    monkeypatch.setattr(CheckpointWriter, "write_file", lambda self, record, ckpt: held.write_file(self, record, ckpt))
    steps = VirtualSteps(held, quiet=0.01, busy=0.1)
    monkeypatch.setattr(_async, "time", SimpleNamespace(monotonic=steps.monotonic, perf_counter=time.perf_counter))
    cb = DurableCheckpoint(
        tmp_path, continuous=True, async_save=True, keep_last=1, save_on_train_end=False, max_slowdown=max_slowdown
    )
    with caplog.at_level("INFO"):
        Trainer(max_steps=50, callbacks=[cb, steps, Releaser(held)], **QUIET).fit(
            Regression(), regression_loader(256, batch_size=4)
        )
    said = [r.getMessage() for r in caplog.records if "a step takes" in r.getMessage()]
    if max_slowdown is None:
        assert held.started == list(range(1, 50, 2)) and not said  # a new save at each commit's boundary
    else:
        # step 1 saves (commit at 3: 2 busy steps timed); the pacer rests to time 3 quiet steps, so step 6 saves
        # (commit at 8: 4 busy); then it rests 3.4 s, 340 quiet steps, past the end of training
        assert held.started == [1, 6], held.started
        assert len(said) == 1 and "at most 5% of throughput (max_slowdown=0.05" in said[0], said


def test_continuous_is_announced_once_on_rank_zero(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = DurableCheckpoint(tmp_path, continuous=True, async_save=True, keep_last=2)
    with caplog.at_level("INFO"):
        Trainer(max_steps=2, callbacks=[cb], **QUIET).fit(Regression(), regression_loader(16, batch_size=4))
    said = [r.getMessage() for r in caplog.records if "saves continuously" in r.getMessage()]
    assert len(said) == 1 and "keeping the newest 2" in said[0], said


def test_continuous_with_a_strategy_that_writes_its_own_checkpoints_is_refused_before_training(
    tmp_path: Path,
) -> None:
    from lightning.fabric.plugins import TorchCheckpointIO

    class OwnIO(TorchCheckpointIO):  # as a sharded strategy's (FSDP2, DeepSpeed) own synchronous writer
        pass

    cb = DurableCheckpoint(tmp_path / "ck", continuous=True, async_save=True)
    trainer = Trainer(max_steps=2, callbacks=[cb], plugins=[OwnIO()], **QUIET)
    model = Regression()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointConfigError, match=r"continuous=True.*writes its own checkpoints.*every_n_steps"):
        trainer.fit(model, regression_loader(16, batch_size=4))
    assert trainer.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())  # nothing claimed or written


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_background_writes_run_at_a_lower_cpu_priority_than_training(tmp_path: Path) -> None:
    seen: list[int] = []

    def spy(writer: CheckpointWriter, record: Record, checkpoint: dict[str, Any]) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        ORIGINAL_WRITE(writer, record, checkpoint)

    training = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CheckpointWriter, "write_file", spy)
        cb = DurableCheckpoint(tmp_path, continuous=True, async_save=True, keep_last=1)
        Trainer(max_steps=2, callbacks=[cb], **QUIET).fit(Regression(), regression_loader(16, batch_size=4))
    assert seen and set(seen) == {min(19, training + WRITER_NICE)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == training  # training's own is unchanged
