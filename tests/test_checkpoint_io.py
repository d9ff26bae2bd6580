"""DurableCheckpoint's write path: the streaming writer and its CRC32, deferred async copies, background retention."""

from __future__ import annotations

import ctypes
import io
import json
import logging
import os
import random
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lplugins.callbacks import DurableCheckpoint, _async, latest_checkpoint
from lplugins.callbacks._async import DeferredCopy, snapshot
from lplugins.callbacks._crc import CRC32_IMPLEMENTATION, crc32, crc32_combine
from lplugins.callbacks._record import COMMIT_SUFFIX, Record
from lplugins.callbacks._serialization import cpu_storages, torch_save
from lplugins.callbacks._storage import Storage
from lplugins.callbacks._storages import open_storage
from lplugins.callbacks._stream import StreamWriter
from tests.test_checkpoint import fit, names, steps


# ------------------------------------------------------------------------------------------ CRC32
def test_crc32_combine_matches_zlib_on_random_splits() -> None:
    rng = random.Random(0)
    for _ in range(300):
        a, b = rng.randbytes(rng.randint(0, 3000)), rng.randbytes(rng.randint(0, 3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = rng.randbytes(5 << 20)
    assert crc32_combine(zlib.crc32(b"head"), zlib.crc32(big), len(big)) == zlib.crc32(b"head" + big)


def test_checkpoint_crc32_is_isal_and_equals_zlib_on_every_buffer_kind_the_writer_hashes() -> None:
    """Markers written with ISA-L's CRC32 must verify with zlib's (and the other way round)."""
    assert CRC32_IMPLEMENTATION == "isal"  # the dependency is installed: the fast path is the one tested
    rng = random.Random(1)
    data = bytearray(rng.randbytes(3 << 20))
    for piece in (b"", bytes(data[:1]), memoryview(data)[5:], (ctypes.c_char * len(data)).from_buffer(data)):
        assert crc32(piece) == zlib.crc32(piece)
        assert crc32(piece, 0xDEADBEEF) == zlib.crc32(piece, 0xDEADBEEF)


def big_state() -> dict[str, Any]:
    """Large tensors (hashed in place), small ones, a bfloat16 one and plain Python values."""
    g = torch.Generator().manual_seed(1)
    return {
        "w": [torch.randn(300, 300, generator=g) for _ in range(4)],
        "small": torch.arange(10),
        "bf16": torch.randn(256, 256, generator=g).to(torch.bfloat16),
        "view": torch.randn(400, 400, generator=g)[100:],  # a view: its whole storage is written
        "meta": {"step": 3, "name": "x" * 100_000},  # a big pickle record, not a tensor
    }


@pytest.mark.parametrize("checksum", [True, False])
def test_stream_writer_output_loads_and_its_crc32_is_the_files(tmp_path: Path, checksum: bool) -> None:
    state = big_state()
    path = tmp_path / "x.ckpt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with StreamWriter(fd, checksum=checksum, stable=cpu_storages(state)) as stream:
            torch_save(state, stream)
            crc = stream.finish()
    finally:
        os.close(fd)
    assert crc == (zlib.crc32(path.read_bytes()) if checksum else None)
    loaded = torch.load(path, weights_only=True)
    torch.testing.assert_close(loaded["w"], state["w"], rtol=0, atol=0)
    torch.testing.assert_close(loaded["bf16"], state["bf16"], rtol=0, atol=0)
    torch.testing.assert_close(loaded["view"], state["view"], rtol=0, atol=0)
    assert loaded["meta"] == state["meta"]


def test_stream_writer_to_a_file_object_hashes_the_same() -> None:
    state = big_state()
    buffer = io.BytesIO()
    with StreamWriter(buffer, checksum=True, stable=cpu_storages(state)) as stream:
        torch_save(state, stream)
        crc = stream.finish()
    assert crc == zlib.crc32(buffer.getvalue())


def test_committed_marker_holds_the_files_crc32_and_deep_verify_uses_it(tmp_path: Path) -> None:
    fit(DurableCheckpoint(tmp_path, every_n_steps=1, keep_last=None), max_steps=2)
    for record in open_storage(tmp_path).find_committed():
        assert record.crc32 == zlib.crc32((tmp_path / record.name).read_bytes())
    # torch's own per-record CRCs are not written (the marker's CRC32 replaces them), and yet deep
    # verification accepts the intact checkpoints and rejects one with a flipped byte
    assert latest_checkpoint(tmp_path, deep=True) == str(tmp_path / "step=000000002-epoch=0000.ckpt")
    newest = tmp_path / "step=000000002-epoch=0000.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) == str(newest)
    assert latest_checkpoint(tmp_path, deep=True) == str(tmp_path / "step=000000001-epoch=0000.ckpt")


def test_without_crc32_there_is_no_checksum_and_deep_verify_does_not_reject(tmp_path: Path) -> None:
    fit(DurableCheckpoint(tmp_path, every_n_steps=1, keep_last=None, crc32=False), max_steps=2)
    records = open_storage(tmp_path).find_committed()
    assert [r.crc32 for r in records] == [None, None]
    assert latest_checkpoint(tmp_path, deep=True) == str(tmp_path / "step=000000002-epoch=0000.ckpt")


def test_a_marker_of_lplugins_0_1_is_deep_checked_by_the_archive_crcs(tmp_path: Path) -> None:
    """Markers written before the whole-file CRC32 have no ``crc32``; their archives carry torch's CRCs."""
    storage = open_storage(tmp_path)
    for step in (1, 2):
        name = f"step={step:09d}-epoch=0000.ckpt"
        storage.write_durable(name, lambda target: torch.save(big_state(), target))  # torch's default: zip CRCs
        legacy = Record(name=name, global_step=step, epoch=0, time=0.0, size=storage.size(name), seq=step)
        raw = {k: v for k, v in vars(legacy).items() if k not in ("crc32", "zip_crc")}
        (tmp_path / (name + COMMIT_SUFFIX)).write_text(json.dumps(raw))
    newest = tmp_path / "step=000000002-epoch=0000.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) == str(newest)
    assert latest_checkpoint(tmp_path, deep=True) == str(tmp_path / "step=000000001-epoch=0000.ckpt")


# ------------------------------------------------------------------------------------------ deferred copies
def test_snapshot_defers_only_the_listed_storages_and_the_copy_completes() -> None:
    param, buffer = torch.randn(100), torch.randn(5)
    state = {"param": param.detach(), "buffer": buffer, "n": 3}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    data = snapshot(state, defer=frozenset({param.untyped_storage().data_ptr()}), deferred=pairs)
    assert [src.data_ptr() for _, src in pairs] == [param.data_ptr()]
    assert torch.equal(data["buffer"], buffer) and data["buffer"].data_ptr() != buffer.data_ptr()
    copy = DeferredCopy(pairs)
    waited, intact = copy.complete()
    assert intact and copy.result() and waited >= 0
    assert torch.equal(data["param"], param)


def test_inference_tensors_are_never_deferred() -> None:
    """They have no version counter, so a change could not be detected: they are copied at the save."""
    with torch.inference_mode():
        frozen = torch.randn(50)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    data = snapshot({"t": frozen}, defer=frozenset({frozen.untyped_storage().data_ptr()}), deferred=pairs)
    assert pairs == []
    assert torch.equal(data["t"], frozen)


def test_deferred_copy_reports_a_source_changed_in_place_before_completion() -> None:
    src = torch.zeros(1000)
    dst = torch.empty(1000)
    copy = DeferredCopy([(dst, src)])
    with torch.no_grad():
        src.add_(1)  # what an optimizer step would do, too early
    assert copy.complete()[1] is False
    assert copy.result() is False


class SlowCopies:
    """Make every deferred copy start late, so training reaches the next optimizer step before it is done."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay: float = 0.2) -> None:
        original = _async.DeferredCopy._run

        def late(copy: DeferredCopy) -> None:
            time.sleep(delay)
            original(copy)

        monkeypatch.setattr(_async.DeferredCopy, "_run", late)


def test_async_saves_wait_for_their_copies_before_the_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fit(DurableCheckpoint(tmp_path / "sync", every_n_steps=1, keep_last=None), max_steps=4)
    SlowCopies(monkeypatch)
    cb = DurableCheckpoint(tmp_path / "async", every_n_steps=1, keep_last=None, async_save=True, max_in_flight=2)
    fit(cb, max_steps=4)
    assert steps(tmp_path / "async") == [1, 2, 3, 4]
    for name in names(tmp_path / "sync"):
        a = torch.load(tmp_path / "async" / name, weights_only=True)
        s = torch.load(tmp_path / "sync" / name, weights_only=True)
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step"):
            torch.testing.assert_close(a[key], s[key], rtol=0, atol=0)


class NudgeWeights(Callback):
    """Changes a parameter in place at the start of every batch: outside ``optimizer.step()``."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            pl_module.net[-1].weight.mul_(0.999)  # type: ignore[index, union-attr]


def test_in_place_change_outside_the_optimizer_drops_the_torn_snapshot_and_goes_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fit(DurableCheckpoint(tmp_path / "sync", every_n_steps=1, keep_last=None), max_steps=4, extra=[NudgeWeights()])
    SlowCopies(monkeypatch)
    cb = DurableCheckpoint(tmp_path / "async", every_n_steps=1, keep_last=None, async_save=True)
    with pytest.warns(UserWarning, match="changed in place"):
        fit(cb, max_steps=4, extra=[NudgeWeights()])
    assert steps(tmp_path / "async") == [2, 3, 4]  # step 1's copy was torn: dropped, never written
    for name in names(tmp_path / "async"):
        a = torch.load(tmp_path / "async" / name, weights_only=True)
        s = torch.load(tmp_path / "sync" / name, weights_only=True)
        torch.testing.assert_close(a["state_dict"], s["state_dict"], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ retention
def test_a_failed_retention_delete_warns_and_keeps_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(self: Storage, name: str) -> None:
        raise PermissionError(13, "Permission denied", self.path(name))

    monkeypatch.setattr(Storage, "delete", refuse)
    with caplog.at_level(logging.WARNING, logger="lplugins"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(DurableCheckpoint(tmp_path, every_n_steps=1, keep_last=1), max_steps=3)
    assert "could not delete old checkpoint" in caplog.text
    assert steps(tmp_path) == [1, 2, 3]  # nothing lost; training finished


def test_retention_runs_off_the_training_thread_and_is_done_when_fit_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: set[str] = set()
    original = Storage.delete

    def record_thread(self: Storage, name: str) -> None:
        threads.add(threading.current_thread().name)
        original(self, name)

    monkeypatch.setattr(Storage, "delete", record_thread)
    model = fit(DurableCheckpoint(tmp_path, every_n_steps=1, keep_last=2), max_steps=5)
    assert model.steps_run == 5
    assert threads and threading.main_thread().name not in threads
    assert steps(tmp_path) == [4, 5]
    assert names(tmp_path) == ["step=000000004-epoch=0000.ckpt", "step=000000005-epoch=0001.ckpt"]


@pytest.mark.parametrize("user_setting", [True, False])
def test_torchs_process_wide_crc32_option_is_restored(tmp_path: Path, user_setting: bool) -> None:
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(user_setting)
    try:
        fit(DurableCheckpoint(tmp_path, every_n_steps=1, async_save=True, max_in_flight=2), max_steps=3)
        assert torch.serialization.get_crc32_options() is user_setting
    finally:
        torch.serialization.set_crc32_options(previous)
