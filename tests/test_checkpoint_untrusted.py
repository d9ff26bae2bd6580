"""The checkpoint directory is untrusted input (#38, in part): links, FIFOs and names that leave the directory are
refused with a fallback to the next newest checkpoint, never followed, waited on, read or written outside it.

Each attack puts a *sentinel* beside the checkpoint directory: a FIFO (a read through a followed link would block
the test until its timeout) and files whose bytes and modification times are compared afterwards (a write or a
delete through a link would change them)."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from lightning.pytorch import Trainer, seed_everything

from lplugins._lightning.converted import cached_conversion, committed, converted_dir
from lplugins._lightning.loading import check_dcp_paths, plain_name, read_tag
from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._claim import CLAIM
from lplugins.callbacks._latest import newest_loadable
from lplugins.callbacks._storages import open_storage
from lplugins.callbacks._untrusted import UntrustedEntryError, lstat_beneath, open_beneath
from tests.models import Regression, regression_loader

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
NEWEST = "step=000000004-epoch=0000.ckpt"


def _sentinel(root: Path) -> tuple[Path, dict[str, tuple[bytes, int]]]:
    outside = root / "outside"
    outside.mkdir()
    os.mkfifo(outside / "fifo")
    (outside / "secret.ckpt").write_bytes(b"not yours")
    return outside, _snapshot(outside)


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    def content(p: Path) -> bytes:
        if p.is_fifo():
            return b""
        return str(sorted(os.listdir(p))).encode() if p.is_dir() else p.read_bytes()

    return {p.name: (content(p), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def _two_checkpoints(d: Path) -> None:
    seed_everything(7, verbose=False)
    trainer = Trainer(callbacks=[DurableCheckpoint(d, every_n_steps=2, keep_last=None)], max_steps=4, **QUIET)
    trainer.fit(Regression(), regression_loader(32, batch_size=4))
    assert (d / NEWEST).is_file()


def _resume(d: Path) -> Trainer:
    trainer = Trainer(callbacks=[DurableCheckpoint(d, every_n_steps=2, keep_last=None)], max_steps=6, **QUIET)
    trainer.fit(Regression(), regression_loader(32, batch_size=4), ckpt_path="latest")
    return trainer


# ---------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("name", ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./x", "x\0y"])
def test_a_name_that_leaves_the_directory_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UntrustedEntryError, match="not a name inside the checkpoint directory"):
        open_beneath(str(tmp_path), name)


@pytest.mark.timeout(20)
def test_links_fifos_and_linked_folders_are_refused_at_once_never_followed(tmp_path: Path) -> None:
    outside, before = _sentinel(tmp_path)
    d = tmp_path / "ckpts"
    (d / "real").mkdir(parents=True)
    (d / "real" / "file").write_bytes(b"data")
    os.symlink(outside / "fifo", d / "to_fifo")
    os.symlink(outside / "secret.ckpt", d / "to_secret")
    os.symlink(outside, d / "linked_dir")
    os.mkfifo(d / "fifo")
    began = time.monotonic()
    for name, why in [
        ("to_fifo", "is a symbolic link"),
        ("to_secret", "is a symbolic link"),
        ("fifo", "is a FIFO, not a regular file"),
        ("linked_dir/secret.ckpt", "linked_dir is a symbolic link"),
    ]:
        with pytest.raises(UntrustedEntryError, match=why):
            open_beneath(str(d), name)
    assert time.monotonic() - began < 5  # a FIFO is refused, not waited on
    fd = open_beneath(str(d), "real/file")
    os.close(fd)
    assert stat.S_ISLNK(lstat_beneath(str(d), "to_secret").st_mode)  # its own status: the link, not its target
    assert _snapshot(outside) == before


# ---------------------------------------------------------------------------------- resume fallback
@pytest.mark.timeout(120)
@pytest.mark.parametrize("attack", ["link-same-bytes", "link-to-fifo", "fifo", "fifo-marker"])
def test_a_newest_checkpoint_that_is_a_link_or_a_fifo_falls_back_to_the_older_one(tmp_path: Path, attack: str) -> None:
    outside, _ = _sentinel(tmp_path)
    d = tmp_path / "ckpts"
    _two_checkpoints(d)
    newest = d / NEWEST
    if attack == "link-same-bytes":  # the very bytes its marker commits, but reached through a link
        shutil.move(newest, outside / NEWEST)
        os.symlink(outside / NEWEST, newest)
    elif attack == "link-to-fifo":
        newest.unlink()
        os.symlink(outside / "fifo", newest)
    elif attack == "fifo":
        newest.unlink()
        os.mkfifo(newest)
    else:  # the newest commit marker itself is a FIFO: listing the markers must not block
        marker = d / (NEWEST + ".commit")
        assert marker.exists(), sorted(os.listdir(d))
        marker.unlink()
        os.mkfifo(marker)
    before = _snapshot(outside)
    record, skipped = newest_loadable(open_storage(d))
    assert record is not None and record.global_step == 2, skipped
    began = time.monotonic()
    trainer = _resume(d)
    assert time.monotonic() - began < 60
    assert trainer.global_step == 6
    assert trainer.ckpt_path is not None and trainer.ckpt_path.endswith("step=000000002-epoch=0000.ckpt")
    assert _snapshot(outside) == before


# --------------------------------------------------------------------------------------- conversions
@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["folder", "manifest", "target"])
def test_a_linked_conversion_cache_is_never_written_deleted_or_read_through(tmp_path: Path, where: str) -> None:
    outside, _ = _sentinel(tmp_path)
    (outside / "full.ckpt").write_bytes(b"the attacker's full.ckpt")
    (outside / "full.ckpt.json").write_text('{"source": "forged", "kind": "full.ckpt", "files": {}}')
    before = _snapshot(outside)
    source = tmp_path / "ckpts" / "step=1.ckpt"
    source.parent.mkdir()
    source.write_bytes(b"the checkpoint")
    root = Path(converted_dir(str(source)))
    if where == "folder":
        os.symlink(outside, root)
    else:
        root.mkdir()
        name = "full.ckpt.json" if where == "manifest" else "full.ckpt"
        os.symlink(outside / name, root / name)
    assert committed(str(source), "full.ckpt") is False

    def build(path: str) -> None:
        Path(path).write_bytes(b"made from the checkpoint")

    path, how = cached_conversion(str(source), "full.ckpt", build)
    assert how.startswith("made") and Path(path).read_bytes() == b"made from the checkpoint"
    assert not root.is_symlink() and not any(p.is_symlink() for p in root.iterdir())
    assert cached_conversion(str(source), "full.ckpt", build)[1] == "reused"
    assert _snapshot(outside) == before  # nothing outside was deleted, rewritten or created


# ------------------------------------------------------------------------------- formats' own names
@pytest.mark.parametrize("rel", ["../outside/secret.distcp", "/etc/passwd", "sub/../../x", ""])
def test_a_dcp_metadata_that_sends_reads_outside_the_directory_is_refused(tmp_path: Path, rel: str) -> None:
    metadata = SimpleNamespace(storage_data={"item": SimpleNamespace(relative_path=rel)})
    with pytest.raises(ValueError, match="not an entry of the checkpoint directory: refused"):
        check_dcp_paths(metadata, tmp_path)


def test_a_dcp_metadata_naming_a_link_is_refused_and_plain_files_pass(tmp_path: Path) -> None:
    outside, _ = _sentinel(tmp_path)
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"x")
    os.symlink(outside / "secret.ckpt", d / "__1_0.distcp")
    ok: Any = SimpleNamespace(storage_data={"a": SimpleNamespace(relative_path="__0_0.distcp")})
    check_dcp_paths(ok, d)
    bad: Any = SimpleNamespace(storage_data={"a": SimpleNamespace(relative_path="__1_0.distcp")})
    with pytest.raises(ValueError, match="is not a regular file: refused"):
        check_dcp_paths(bad, d)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("attack", ["dotdot", "absolute", "link-file", "fifo-file", "linked-tag"])
def test_a_deepspeed_latest_tag_that_leaves_the_directory_is_refused(tmp_path: Path, attack: str) -> None:
    outside, _ = _sentinel(tmp_path)
    d = tmp_path / "zero"
    d.mkdir()
    latest = d / "latest"
    if attack == "dotdot":
        latest.write_text("../outside")
    elif attack == "absolute":
        latest.write_text(str(outside))
    elif attack == "link-file":
        (outside / "tag").write_text("global_step4")
        os.symlink(outside / "tag", latest)
    elif attack == "fifo-file":
        os.mkfifo(latest)
    else:
        latest.write_text("global_step4")
        os.symlink(outside, d / "global_step4")
    before = _snapshot(outside)
    with pytest.raises(ValueError, match="refused"):
        read_tag(str(d), "latest")
    (d / "good").mkdir()
    (d / "latest_universal").write_text("good")
    assert read_tag(str(d), "latest_universal") == "good"
    assert plain_name("global_step4", "t") == "global_step4"
    assert _snapshot(outside) == before


# ------------------------------------------------------------------------------- failures that escape
@pytest.mark.timeout(120)
def test_a_load_failing_with_a_base_exception_falls_back_instead_of_ending_the_run(tmp_path: Path) -> None:
    """torch DCP's ``CheckpointException`` derives from ``BaseException``: ``except Exception`` let it end the run."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from torch.distributed.checkpoint.api import CheckpointException

    class FailsOnTheNewest(TorchCheckpointIO):
        def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
            if str(path).endswith(NEWEST):
                raise CheckpointException("the reader failed", {})
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    d = tmp_path / "ckpts"
    _two_checkpoints(d)
    trainer = Trainer(
        callbacks=[DurableCheckpoint(d, every_n_steps=2, keep_last=None)], max_steps=6, plugins=[FailsOnTheNewest()],
        **QUIET,
    )  # fmt: skip
    trainer.fit(Regression(), regression_loader(32, batch_size=4), ckpt_path="latest")
    assert trainer.global_step == 6
    assert trainer.ckpt_path is not None and trainer.ckpt_path.endswith("step=000000002-epoch=0000.ckpt")


# ------------------------------------------------------------------------------ found by the attack
@pytest.mark.timeout(120)
@pytest.mark.parametrize("quarantine", ["link-to-outside", "link-to-fifo", "file"])
def test_a_quarantine_that_is_not_a_folder_is_replaced_never_written_through(tmp_path: Path, quarantine: str) -> None:
    outside, _ = _sentinel(tmp_path)
    (outside / "dir").mkdir()
    d = tmp_path / "ckpts"
    _two_checkpoints(d)
    if quarantine == "link-to-outside":
        os.symlink(outside / "dir", d / "quarantine")
    elif quarantine == "link-to-fifo":
        os.symlink(outside / "fifo", d / "quarantine")
    else:
        (d / "quarantine").write_bytes(b"a file")
    before = _snapshot(outside)
    os.truncate(d / NEWEST, 100)  # damaged: moved to the quarantine at the start of fit
    trainer = _resume(d)
    assert trainer.ckpt_path is not None and trainer.ckpt_path.endswith("step=000000002-epoch=0000.ckpt")
    assert (d / "quarantine").is_dir() and not (d / "quarantine").is_symlink()
    assert (d / "quarantine" / NEWEST / NEWEST).is_file()
    assert _snapshot(outside) == before and not any((outside / "dir").iterdir())
    if quarantine == "file":  # kept, out of the way
        assert [p.read_bytes() for p in d.glob("quarantine.not-a-folder.*")] == [b"a file"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attack", ["nested-marker", "huge-marker", "nested-claim"])
def test_markers_and_claims_built_to_exhaust_the_reader_are_refused(tmp_path: Path, attack: str) -> None:
    d = tmp_path / "ckpts"
    _two_checkpoints(d)
    if attack == "nested-marker":
        (d / (NEWEST + ".commit")).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    elif attack == "huge-marker":  # 64 GiB, sparse: read whole, it would take the memory
        with open(d / "step=000000009-epoch=0000.ckpt.commit", "wb") as f:
            f.truncate(64 << 30)
    else:
        (d / CLAIM).write_bytes(b"[" * 100_000 + b"]" * 100_000)  # a claim left by a job: not readable
    trainer = _resume(d)
    expected = "step=000000004-epoch=0000.ckpt" if attack != "nested-marker" else "step=000000002-epoch=0000.ckpt"
    assert trainer.ckpt_path is not None and trainer.ckpt_path.endswith(expected)
    assert trainer.global_step == 6


@pytest.mark.timeout(30)
def test_a_fifo_in_the_conversion_cache_is_never_opened(tmp_path: Path) -> None:
    source = tmp_path / "step=1.ckpt"
    source.write_bytes(b"the checkpoint")
    root = Path(converted_dir(str(source)))
    root.mkdir()
    os.mkfifo(root / "full.ckpt.json")
    assert committed(str(source), "full.ckpt") is False
    path, how = cached_conversion(str(source), "full.ckpt", lambda p: Path(p).write_bytes(b"made"))
    assert how.startswith("made (the one there was not used: it holds a link, FIFO or device")
    assert Path(path).read_bytes() == b"made" and not (root / "full.ckpt.json").is_fifo()


def test_a_conversion_is_bound_to_the_commit_marker_of_its_source(tmp_path: Path) -> None:
    """Same bytes count, same modification time, another commit (its CRC32s): the conversion is made again."""
    source = tmp_path / "step=000000004-epoch=0000.ckpt"
    source.write_bytes(b"source bytes")
    marker = tmp_path / (source.name + ".commit")
    marker.write_bytes(b'{"crc32": 1}')
    built: list[str] = []

    def build(tmp: str) -> None:
        built.append(tmp)
        Path(tmp).write_bytes(b"converted")

    assert cached_conversion(str(source), "full.ckpt", build)[1] == "made"
    assert cached_conversion(str(source), "full.ckpt", build)[1] == "reused" and len(built) == 1
    stat_before = source.stat()
    marker.write_bytes(b'{"crc32": 2}')  # re-committed: the source's size and time unchanged
    os.utime(source, ns=(stat_before.st_atime_ns, stat_before.st_mtime_ns))
    assert not committed(str(source), "full.ckpt")
    how = cached_conversion(str(source), "full.ckpt", build)[1]
    assert how.startswith("made") and "made from other bytes" in how and len(built) == 2
