"""Integrity on resume: every byte verified, damaged or disallowed checkpoints skipped (and named), damaged ones
quarantined, markers type-checked, a stable state key, ``weights_only=False`` honoured, disk full said plainly."""

from __future__ import annotations

import errno
import fractions
import json
import logging
import os
import random
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lplugins.callbacks import (
    CheckpointWriteError,
    DamagedCheckpointError,
    DurableCheckpoint,
    InconsistentCheckpointError,
    UnsafeCheckpointError,
    latest_checkpoint,
)
from lplugins.callbacks._record import COMMIT_SUFFIX, QUARANTINE, Record
from lplugins.callbacks._storages import open_storage
from lplugins.callbacks._stream import StreamWriter
from lplugins.callbacks._verify import bytes_problem
from lplugins.callbacks._writer import tree_crc32s
from tests._dist import run_together
from tests.models import Regression, regression_loader

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
STEP2, STEP4 = "step=000000002-epoch=0000.ckpt", "step=000000004-epoch=0000.ckpt"


def fit(
    d: Path | str, max_steps: int, ckpt_path: str | None = None, weights_only: bool | None = None, **kw: Any
) -> tuple[Trainer, Regression]:
    seed_everything(7, verbose=False)
    model = Regression(dropout=0.5, step_lr=3)
    kw.setdefault("every_n_steps", 2)
    trainer = Trainer(callbacks=[DurableCheckpoint(d, keep_last=None, **kw)], max_steps=max_steps, **QUIET)
    trainer.fit(model, regression_loader(64, batch_size=4), ckpt_path=ckpt_path, weights_only=weights_only)
    return trainer, model


@pytest.fixture
def caplog_info(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="lplugins")
    return caplog


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lplugins"]


def entry_offset(path: Path, suffix: str) -> tuple[int, int]:
    """(offset, size) of the data of the archive entry whose name ends with ``suffix``."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    raw = path.read_bytes()
    fields = struct.unpack("<IHHHHHIIIHH", raw[info.header_offset : info.header_offset + 30])
    return info.header_offset + 30 + fields[9] + fields[10], info.file_size


def flip(path: Path, offsets: list[int]) -> None:
    data = bytearray(path.read_bytes())
    for at in offsets:
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def damage(path: Path, where: str) -> None:
    """Damage a checkpoint file the ways disks and copies do."""
    size = path.stat().st_size
    if where == "tensor":  # 4 bytes inside the first parameter: torch.load does not notice
        weight = torch.load(path, weights_only=True)["state_dict"]["net.1.weight"]
        at = path.read_bytes().find(weight.numpy().tobytes())
        assert at > 0
        flip(path, [at + 1, at + 2, at + 5, at + 6])
    elif where == "data.pkl":
        at, n = entry_offset(path, "data.pkl")
        flip(path, [at + n // 2])
    elif where == "zip directory":
        at = path.read_bytes().rfind(b"PK\x01\x02")  # the last central directory entry
        flip(path, [at + 20, at + 42])  # its compressed size and its local header offset
    elif where in ("zip name", "zip version"):  # zipfile raises UnicodeDecodeError / NotImplementedError here
        data = bytearray(path.read_bytes())
        at = data.rfind(b"PK\x01\x02")
        data[at + 46 + 3 if where == "zip name" else at + 6] = 0x97 if where == "zip name" else 0xF1
        path.write_bytes(bytes(data))
    else:  # 16 random bytes anywhere
        flip(path, random.Random(where).sample(range(size), 16))


# ------------------------------------------------------------------------------------------ damaged bytes
@pytest.mark.parametrize(
    "where", ["tensor", "data.pkl", "zip directory", "zip name", "zip version", "random-1", "random-2", "random-3"]
)
def test_damaged_newest_is_never_resumed_latest_falls_back_and_quarantines_it(
    tmp_path: Path, where: str, caplog_info: pytest.LogCaptureFixture
) -> None:
    fit(tmp_path, 4)
    damage(tmp_path / STEP4, where)
    trainer, model = fit(tmp_path, 5, "latest", every_n_steps=100, save_on_train_end=False)
    assert trainer.ckpt_path == str(tmp_path / STEP2)
    assert model.steps_run == 3  # resumed at step 2, not 4
    assert latest_checkpoint(tmp_path) == str(tmp_path / STEP2)
    # never deleted: moved aside with its marker and the reason
    folder = tmp_path / QUARANTINE / STEP4
    assert sorted(os.listdir(folder)) == sorted(["REASON.txt", STEP4, STEP4 + COMMIT_SUFFIX])
    assert STEP4 not in os.listdir(tmp_path)
    log = "\n".join(lines(caplog_info))
    assert "damaged" in log and str(folder) in log and "uncommitted" not in log
    assert "disallowed" not in log  # damage is not reported as a malicious file
    assert "resuming from " + str(tmp_path / STEP2) in log
    assert (folder / "REASON.txt").read_text().strip()


def test_an_explicit_damaged_path_raises_and_is_not_a_fallback(tmp_path: Path) -> None:
    fit(tmp_path, 4)
    damage(tmp_path / STEP4, "tensor")
    with pytest.raises(DamagedCheckpointError, match=r"step=000000004.*CRC32 0x[0-9a-f]+ != committed"):
        fit(tmp_path, 5, str(tmp_path / STEP4))
    assert (tmp_path / QUARANTINE / STEP4 / STEP4).exists()


def test_nothing_loadable_left_starts_fresh_and_says_so(tmp_path: Path, caplog_info: pytest.LogCaptureFixture) -> None:
    fit(tmp_path, 4)
    damage(tmp_path / STEP2, "tensor")
    damage(tmp_path / STEP4, "data.pkl")
    trainer, model = fit(tmp_path, 3, "latest", every_n_steps=100, save_on_train_end=False)
    assert trainer.ckpt_path is None and model.steps_run == 3
    [line] = [m for m in lines(caplog_info) if "starting fresh" in m]
    assert "no loadable committed checkpoint" in line and STEP4 in line and STEP2 in line
    assert sorted(os.listdir(tmp_path / QUARANTINE)) == [STEP2, STEP4]


def test_a_marker_that_lies_about_the_step_is_inconsistent_and_skipped(
    tmp_path: Path, caplog_info: pytest.LogCaptureFixture
) -> None:
    fit(tmp_path, 4)
    # a marker saying step 9 for the step-4 state (bytes and CRC fit: only the content disagrees)
    rec = Record.from_json((tmp_path / (STEP4 + COMMIT_SUFFIX)).read_bytes())
    forged = "step=000000009-epoch=0000.ckpt"
    (tmp_path / forged).write_bytes((tmp_path / STEP4).read_bytes())
    rec.name, rec.global_step, rec.seq = forged, 9, rec.seq + 1
    (tmp_path / (forged + COMMIT_SUFFIX)).write_bytes(rec.to_json())
    trainer, _ = fit(tmp_path, 5, "latest", every_n_steps=100, save_on_train_end=False)
    assert trainer.ckpt_path == str(tmp_path / STEP4)
    [line] = [m for m in lines(caplog_info) if "ckpt_path: skipped" in m]
    assert forged in line and "inconsistent" in line
    assert "global_step 4, its commit marker says 9" in line
    assert (tmp_path / QUARANTINE / forged / forged).exists()
    with pytest.raises(InconsistentCheckpointError):
        (tmp_path / forged).write_bytes((tmp_path / STEP4).read_bytes())
        (tmp_path / (forged + COMMIT_SUFFIX)).write_bytes(rec.to_json())
        fit(tmp_path, 5, str(tmp_path / forged))


# ------------------------------------------------------------------------------------------ markers
BAD_FIELDS: list[tuple[str, Any]] = [
    ("seq", "7"),
    ("global_step", True),
    ("epoch", 1.5),
    ("size", "big"),
    ("crc32", -1),
    ("files", ["a"]),
    ("kind", "tar"),
    ("name", "../elsewhere.ckpt"),
    ("zip_crc", 1),
    ("world_size", None),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS, ids=[f for f, _ in BAD_FIELDS])
def test_record_from_json_checks_every_field_type(field: str, value: Any) -> None:
    data = json.loads(Record("a.ckpt", 3, 0, 1.0).to_json())
    data[field] = value
    with pytest.raises(ValueError, match=rf"field '{field}' is .*expected"):
        Record.from_json(json.dumps(data).encode())


@pytest.mark.parametrize("bad", ["seq", "global_step", "not json", "missing step"])
def test_a_bad_marker_skips_only_that_checkpoint(
    tmp_path: Path, bad: str, caplog_info: pytest.LogCaptureFixture
) -> None:
    fit(tmp_path, 4)
    marker = tmp_path / (STEP4 + COMMIT_SUFFIX)
    data = json.loads(marker.read_bytes())
    if bad == "seq":
        data["seq"] = str(data["seq"])  # the case: every fit in the directory failed with TypeError
    elif bad == "global_step":
        data["global_step"] = True
    elif bad == "missing step":
        del data["global_step"]
    marker.write_bytes(b"{not json" if bad == "not json" else json.dumps(data).encode())
    assert latest_checkpoint(tmp_path) == str(tmp_path / STEP2)
    trainer, model = fit(tmp_path, 5, "latest", every_n_steps=100, save_on_train_end=False)
    assert trainer.ckpt_path == str(tmp_path / STEP2) and model.steps_run == 3
    assert sorted(os.listdir(tmp_path / QUARANTINE / STEP4)) == sorted(["REASON.txt", STEP4, STEP4 + COMMIT_SUFFIX])
    [line] = [m for m in lines(caplog_info) if STEP4 in m and "quarantine" in m]
    assert "commit marker" in line
    # a fresh start in that directory works too
    fit(tmp_path, 2, None)


def test_markers_record_world_size_and_strategy(tmp_path: Path) -> None:
    fit(tmp_path, 2)
    rec = Record.from_json((tmp_path / (STEP2 + COMMIT_SUFFIX)).read_bytes())
    assert (rec.world_size, rec.strategy) == (1, "SingleDeviceStrategy")
    assert rec.crc32 is not None and not rec.zip_crc


def test_crc32_false_keeps_the_archive_crcs_so_resume_still_checks_every_byte(tmp_path: Path) -> None:
    fit(tmp_path, 4, crc32=False)
    rec = Record.from_json((tmp_path / (STEP4 + COMMIT_SUFFIX)).read_bytes())
    assert rec.crc32 is None and rec.zip_crc
    damage(tmp_path / STEP4, "tensor")
    trainer, _ = fit(tmp_path, 5, "latest", every_n_steps=100, crc32=False)
    assert trainer.ckpt_path == str(tmp_path / STEP2)


# ------------------------------------------------------------------------------------------ directory checkpoints
def test_directory_checkpoints_are_verified_file_by_file_split_among_ranks(tmp_path: Path) -> None:
    top = tmp_path / "d.ckpt"
    (top / "sub").mkdir(parents=True)
    for i in range(5):
        (top / ("sub" if i % 2 else "") / f"f{i}.pt").write_bytes(os.urandom(1000 + i))
    storage = open_storage(tmp_path)
    files = storage.tree_sizes("d.ckpt")
    rec = Record("d.ckpt", 1, 0, 0.0, kind="dir", files=files, crcs=tree_crc32s(storage, "d.ckpt", list(files)))
    assert sorted(rec.crcs) == sorted(files) and all(bytes_problem(storage, rec, r, 2) is None for r in (0, 1))
    flip(top / "sub" / "f3.pt", [10])
    problems = [bytes_problem(storage, rec, r, 2) for r in (0, 1)]
    assert sum(p is not None for p in problems) == 1  # each file hashed by exactly one rank
    assert "f3.pt: CRC32" in next(p for p in problems if p)
    assert storage.check(rec, deep=True) is not None and storage.check(rec) is None


# ------------------------------------------------------------------------------------------ state key, escape hatch
def test_ckpts_and_ckpts_slash_are_one_state_key_and_resume_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    keys = {DurableCheckpoint(p).state_key for p in ("ckpts", "ckpts/", "./ckpts", "ckpts//")}
    assert len(keys) == 1
    assert DurableCheckpoint("memory://b/ckpts/").state_key == DurableCheckpoint("memory://b/ckpts").state_key
    assert DurableCheckpoint("other").state_key not in keys

    def run(d: str, max_epochs: int, ckpt_path: str | None = None) -> list[float]:
        seed_everything(7, verbose=False)
        model = Regression(dropout=0.5, step_lr=3)
        cb = DurableCheckpoint(d, every_n_epochs=1, keep_last=2)
        trainer = Trainer(callbacks=[cb], max_epochs=max_epochs, **QUIET)
        trainer.fit(model, regression_loader(16, batch_size=4, shuffle=True), ckpt_path=ckpt_path)
        return model.losses

    full = run("full", 4)
    first = run("ckpts", 2)
    rest = run("ckpts/", 4, "latest")  # a restart spelled differently: the RNG state is still restored
    assert first + rest == full


class Trusted(Regression):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ratio"] = fractions.Fraction(1, 3)  # not in torch's weights-only allow-list


def test_weights_only_false_is_honoured_with_one_warning_naming_the_file(tmp_path: Path) -> None:
    seed_everything(7, verbose=False)
    trainer = Trainer(callbacks=[DurableCheckpoint(tmp_path, every_n_steps=2)], max_steps=2, **QUIET)
    trainer.fit(Trusted(dropout=0.5, step_lr=3), regression_loader(64, batch_size=4))
    path = str(tmp_path / STEP2)
    with pytest.raises(UnsafeCheckpointError, match=r"holds fractions\.Fraction.*add_safe_globals\(\[fractions"):
        fit(tmp_path, 3, path)
    with pytest.warns(UserWarning, match="weights_only=False") as record:
        trainer, model = fit(tmp_path, 3, path, weights_only=False, every_n_steps=100, save_on_train_end=False)
    assert model.steps_run == 1 and trainer.ckpt_path == path
    assert [str(w.message).count(path) for w in record if "weights_only=False" in str(w.message)] == [1]


class _Touch:
    """Pickles as a call of ``os.system`` that creates a file: what a tampered checkpoint can carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_weights_only_false_with_latest_names_the_file_before_unpickling_it_and_checks_its_bytes_first(
    tmp_path: Path, caplog_info: pytest.LogCaptureFixture
) -> None:
    """``ckpt_path="latest"`` with ``weights_only=False``: said once on rank zero, naming the file about to be
    unpickled and that safe loading was turned off; a file whose bytes do not match its commit marker is never
    unpickled (its code never runs), even though full unpickling was asked for."""
    d, marker = tmp_path / "ckpts", tmp_path / "PAYLOAD_RAN"
    fit(d, 4)
    newest = d / STEP4
    tampered = torch.load(newest, weights_only=True)
    tampered["hyper_parameters"] = {"lr": _Touch(marker)}
    torch.save(tampered, newest)
    marker_path = d / (STEP4 + COMMIT_SUFFIX)
    forged = Record.from_json(marker_path.read_bytes())
    forged.size = newest.stat().st_size  # the size fits (the start's cleanup keeps it); the CRC32 does not
    marker_path.write_bytes(forged.to_json())
    with pytest.warns(UserWarning, match="opted out of safe loading") as record:
        trainer, model = fit(d, 6, "latest", weights_only=False)
    assert not marker.exists(), "the tampered checkpoint was unpickled"
    assert trainer.ckpt_path == str(d / STEP2) and model.steps_run == 4
    said = [str(w.message) for w in record if "weights_only=False" in str(w.message)]
    assert said == [
        f"lplugins: about to unpickle checkpoint {str(d / STEP2)!r} with weights_only=False: you opted out of safe"
        " loading (passed to the Trainer), so torch.load runs any code pickled in it. Do this only for a file you"
        " wrote yourself or otherwise trust."
    ]
    assert any("every byte checked against its CRC32 before loading" in line for line in lines(caplog_info))
    assert any(STEP4 in str(p) for p in (d / QUARANTINE).rglob("*"))  # set aside, never resumed from


# ------------------------------------------------------------------------------------------ disk full
def test_disk_full_says_no_space_left_and_the_path_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write = StreamWriter.write

    def full_at_4096(self: StreamWriter, data: Any) -> int:
        if self.tell() > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, data)

    fit(tmp_path, 2)
    monkeypatch.setattr(StreamWriter, "write", full_at_4096)
    with pytest.raises(CheckpointWriteError) as caught:
        fit(tmp_path, 4, "latest")
    message = str(caught.value)
    assert message.startswith(f"No space left on device: {tmp_path / STEP4} ("), message
    assert "unexpected pos" not in message and STEP2 in message  # the intact ones are named
    assert caught.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == [STEP2, STEP2 + COMMIT_SUFFIX]  # nothing half-written left


# ------------------------------------------------------------------------------------------ 2 processes
DDP_JOB = r"""
import fractions, json, logging, os, sys
import torch
import lightning.pytorch as pl
from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._record import COMMIT_SUFFIX, Record
from tests.models import Regression, regression_loader

phase = sys.argv[1]
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("lplugins").addHandler(Keep())

class M(Regression):
    def on_save_checkpoint(self, checkpoint):
        if phase == "plant":
            checkpoint["ratio"] = fractions.Fraction(1, 3)

cb = DurableCheckpoint("ckpts", every_n_steps=2, keep_last=None, save_on_train_end=False)
t = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[cb], logger=False,
               enable_progress_bar=False, enable_model_summary=False,
               max_steps={"train": 4, "plant": 6, "resume": 7}[phase])
if phase == "resume" and t.global_rank == 0:
    # rank 0 trusts the planted type, rank 1 does not: the ranks must still agree to skip it
    torch.serialization.add_safe_globals([fractions.Fraction])
model = M(dropout=0.5)
t.fit(model, regression_loader(64, batch_size=4), ckpt_path=None if phase == "train" else "latest")
with open(f"out.{phase}.{t.global_rank}.json", "w") as f:
    json.dump({"ckpt_path": t.ckpt_path, "steps_run": model.steps_run, "log": seen}, f)
"""


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_ddp_ranks_agree_to_skip_damaged_and_disallowed_and_resume_the_same_older_one(tmp_path: Path) -> None:
    run_together(DDP_JOB, tmp_path, timeout=150, args=["train"]).check()  # steps 2, 4
    run_together(DDP_JOB, tmp_path, timeout=150, args=["plant"]).check()  # resumes at 4, saves 6 (with a Fraction)
    ckpts = tmp_path / "ckpts"
    step6 = "step=000000006-epoch=0000.ckpt"
    assert (ckpts / step6).exists()
    damage(ckpts / STEP4, "tensor")  # and the one before it is damaged
    run_together(DDP_JOB, tmp_path, timeout=150, args=["resume"]).check()
    out = [json.loads((tmp_path / f"out.resume.{rank}.json").read_text()) for rank in (0, 1)]
    # step 6 fails on rank 1 only (disallowed there), step 4 is damaged: both ranks resume from step 2
    assert [o["ckpt_path"] for o in out] == [str(Path("ckpts") / STEP2)] * 2
    assert [o["steps_run"] for o in out] == [5, 5]
    log = "\n".join(out[0]["log"])
    assert f"skipped {Path('ckpts') / step6} (disallowed content" in log and "rank 1: UnsafeCheckpointError" in log
    assert f"skipped {Path('ckpts') / STEP4} (damaged" in log
    assert out[1]["log"] == []  # rank zero speaks
    assert sorted(os.listdir(ckpts / QUARANTINE)) == [STEP4]  # damaged: moved aside; disallowed: left in place
    assert (ckpts / step6).exists()


DEEPSPEED_JOB = r"""
import json, sys
import lightning.pytorch as pl
import lplugins
from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._storages import open_storage
from tests.models import Regression, regression_loader

class Start(pl.Callback):
    def on_train_start(self, trainer, module):
        self.step = trainer.global_step

max_steps, ckpt_path = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else None)
cb, start = DurableCheckpoint("ckpts", every_n_steps=2, keep_last=None, save_on_train_end=False), Start()
kwargs = lplugins.compose(strategy="deepspeed_stage_2_cpu", accelerator="cpu", devices=2, max_steps=max_steps,
                          callbacks=[cb, start], logger=False, enable_progress_bar=False, enable_model_summary=False)
trainer = pl.Trainer(**kwargs)
trainer.fit(Regression(8, (16,), lr=1e-2), regression_loader(64, features=8, batch_size=8), ckpt_path=ckpt_path)
records = {r.name: [r.kind, sorted(r.files), sorted(r.crcs), r.world_size, r.strategy]
           for r in open_storage("ckpts").find_committed()}
with open(f"ds.{max_steps}.{trainer.global_rank}.json", "w") as f:
    json.dump({"start": start.step, "ckpt_path": trainer.ckpt_path, "records": records}, f)
"""


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_deepspeed_directory_checkpoints_carry_per_file_crcs_and_a_damaged_one_is_skipped(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    run_together(DEEPSPEED_JOB, tmp_path, timeout=200, args=["4"]).check()
    first = json.loads((tmp_path / "ds.4.0.json").read_text())
    kind, files, crcs, world, strategy = first["records"][STEP4]
    assert kind == "dir" and files == crcs and len(files) >= 2 and world == 2 and "DeepSpeed" in strategy
    # flip 4 bytes in the middle of the largest file of the newest checkpoint
    biggest = max((p for p in (tmp_path / "ckpts" / STEP4).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    middle = biggest.stat().st_size // 2
    flip(biggest, [middle, middle + 1, middle + 2, middle + 3])
    run_together(DEEPSPEED_JOB, tmp_path, timeout=200, args=["5", "latest"]).check()
    for rank in (0, 1):
        out = json.loads((tmp_path / f"ds.5.{rank}.json").read_text())
        assert out["start"] == 2 and out["ckpt_path"] == str(Path("ckpts") / STEP2)
    assert (tmp_path / "ckpts" / QUARANTINE / STEP4 / STEP4 / biggest.relative_to(tmp_path / "ckpts" / STEP4)).exists()


def test_fsspec_damaged_newest_is_skipped_and_quarantined() -> None:
    import fsspec

    url, fs = "memory://lplugins-integrity-test", fsspec.filesystem("memory")
    try:
        fit(url, 4)
        data = bytearray(fs.cat_file(f"{url}/{STEP4}"))
        data[len(data) // 2] ^= 0xFF
        fs.pipe_file(f"{url}/{STEP4}", bytes(data))
        trainer, model = fit(url, 5, "latest", every_n_steps=100, save_on_train_end=False)
        assert trainer.ckpt_path == f"{url}/{STEP2}" and model.steps_run == 3
        assert fs.exists(f"{url}/{QUARANTINE}/{STEP4}/{STEP4}") and not fs.exists(f"{url}/{STEP4}")
    finally:
        fs.rm("/lplugins-integrity-test", recursive=True)
