"""Resource bombs that pass the CRC check and torch's weights-only rules are refused before torch unpickles them,
and the resume falls back to the next newest checkpoint (#38, item 3).

Without the bounds (:mod:`lplugins._bounds`), the hash bomb hangs ``torch.load`` for hours (2^40 tuple
hashes), the shared lists hang every later walk of the state, a 10^5-deep nesting ends in a ``RecursionError``
after the file was accepted, and the zip bomb makes torch inflate 1 GiB.
"""

from __future__ import annotations

import json
import logging
import pickle
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lplugins._bounds import check_file, check_pickle
from lplugins._bounds._pickle import MAX_DEPTH
from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._errors import UnsafeCheckpointError
from lplugins.callbacks._record import COMMIT_SUFFIX, Record
from tests.models import Regression, regression_loader

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
STEP2, STEP4 = "step=000000002-epoch=0000.ckpt", "step=000000004-epoch=0000.ckpt"


def _shared_tuples(levels: int = 40) -> bytes:
    """The pickle body (no header, no STOP) of ``levels`` nested tuples, each holding the one below twice."""
    nested: tuple[object, ...] = ()
    for _ in range(levels):
        nested = (nested, nested)
    return pickle.dumps(nested, protocol=2)[2:-1]  # memoized: ~10 bytes a level, never hashed here


def _shared_lists(levels: int = 40) -> list[object]:
    nested: list[object] = []
    for _ in range(levels):
        nested = [nested, nested]
    return nested


BOMBS = {
    # a dict key of shared tuples: hashing it visits 2^40 tuples
    "hash": (b"\x80\x02}" + _shared_tuples() + b"K\x01s.", "expand to more than"),
    # a set of them (torch allows builtins.set)
    "set": (b"\x80\x02c__builtin__\nset\n]" + _shared_tuples() + b"a\x85R.", "expand to more than"),
    # a "billion laughs" in the optimizer state, which the background prefault and export walk
    "laughs": (pickle.dumps({"optimizer_states": [_shared_lists()]}, protocol=2), "expand to more than"),
    "laughs-protocol-4": (pickle.dumps({"optimizer_states": [_shared_lists()]}, protocol=4), "expand to more than"),
    # lists nested 10^5 deep (a RecursionError in any walk)
    "deep": (b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b".", f"nested more than {MAX_DEPTH} deep"),
    # a list that holds itself (an endless walk)
    "cycle": (b"\x80\x02]q\x00h\x00a.", "holds itself"),
    # a list put 1000 times in another, then grown to 10^5 items: counted as used, not as first seen
    "grown-after-use": (
        b"\x80\x02]q\x000]q\x01(" + b"h\x00" * 1000 + b"eh\x00(" + b"K\x01" * 100_000 + b"e0.",
        "expand to more than",
    ),
    "truncated": (pickle.dumps({"a": [1, 2]}, protocol=2)[:-3], "no STOP"),
    # 1000 int keys that share one hash: building the dict is quadratic (10^5 of them: minutes)
    "hash-flood": (
        pickle.dumps({k * (2**61 - 1): 0 for k in range(1, 1001)}, protocol=2),
        "keys of a dict or set of it share one hash",
    ),
    # the same with keys that are tuples of such ints, or complex numbers: no large number in sight
    "hash-flood-tuples": (
        pickle.dumps({(k * (2**61 - 1),): 0 for k in range(1, 1001)}, protocol=2),
        "keys of a dict or set of it share one hash",
    ),
    "hash-flood-complex": (
        pickle.dumps({complex(-1000003 * k, k): 0 for k in range(1, 1001)}, protocol=2),
        "keys of a dict or set of it share one hash",
    ),
    # bytearray(10**9) through REDUCE: torch allows bytearray, and would allocate a GB for 30 bytes
    "bytearray": (b"\x80\x02c__builtin__\nbytearray\nJ\x00\xca\x9a\x3b\x85R.", "bytearray with something else"),
    # ... or with a string and a slow codec; or through torch._tensor._rebuild_from_type_v2, which calls its first
    # argument with its third
    "bytearray-codec": (
        b"\x80\x02c__builtin__\nbytearray\nX\x03\x00\x00\x00abcX\x08\x00\x00\x00punycode\x86R.",
        "bytearray with something else",
    ),
    "bytearray-from-type": (
        b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n(c__builtin__\nbytearray\nctorch\nTensor\n"
        b"J\x00\xca\x9a;\x85}tR.",
        "bytearray with something else",
    ),
    # torch.FloatTensor(5e8): a legacy constructor torch allows, 2 GB for 30 bytes
    "legacy-constructor": (b"\x80\x02ctorch\nFloatTensor\nJ\x00e\xcd\x1d\x85R.", "FloatTensor with a size"),
    # _codecs.encode(..., "punycode"): torch allows _codecs.encode with any codec; punycode is quadratic
    "punycode": (
        b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x08\x00\x00\x00punycode\x86R.",
        "another encoding than latin1",
    ),
}


def _zip(path: Path, data: bytes, compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as archive:
        archive.writestr("archive/data.pkl", data)
    return path


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", list(BOMBS))
def test_each_bomb_is_refused_naming_its_bound(tmp_path: Path, name: str) -> None:
    data, why = BOMBS[name]
    path = _zip(tmp_path / "bomb.ckpt", data)
    with pytest.raises(UnsafeCheckpointError, match=why) as refused:
        check_file(path)
    assert str(path) in str(refused.value) and "nothing in it was unpickled" in str(refused.value)


@pytest.mark.timeout(20)
def test_a_zip_declaring_far_more_than_it_holds_is_refused(tmp_path: Path) -> None:
    path = _zip(tmp_path / "zip.ckpt", b"\x80\x02]q\x00(" + b"K\x01" * 50_000_000 + b"e.", zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 200_000
    with pytest.raises(UnsafeCheckpointError, match=r"declare 100000008 bytes in a file of \d+ bytes"):
        check_file(path)
    (tmp_path / "raw.ckpt").write_bytes(b"a legacy or foreign file")
    with pytest.raises(UnsafeCheckpointError, match="not a zip file"):
        check_file(tmp_path / "raw.ckpt")


def _entries(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return path


@pytest.mark.timeout(20)
def test_a_zip_that_python_and_torch_would_read_differently_is_refused(tmp_path: Path) -> None:
    bomb, empty = BOMBS["hash"][0], pickle.dumps({}, protocol=2)
    # torch finds archive/data.pkl without case: it could read the bomb where Python reads {}
    cased = _entries(tmp_path / "cased.ckpt", {"archive/DATA.PKL": bomb, "archive/data.pkl": empty})
    with pytest.raises(UnsafeCheckpointError, match="same name but for case"):
        check_file(cased)
    good = _entries(tmp_path / "good.ckpt", {"archive/data.pkl": empty}).read_bytes()
    check_file(tmp_path / "good.ckpt")
    # bytes before the archive: Python's reader moves every offset, torch's reads what the end record says
    (tmp_path / "prefixed.ckpt").write_bytes(b"JUNK" * 16 + good)
    with pytest.raises(UnsafeCheckpointError, match="central directory is not where its end record says"):
        check_file(tmp_path / "prefixed.ckpt")
    (tmp_path / "trailing.ckpt").write_bytes(good + b"x")
    with pytest.raises(UnsafeCheckpointError, match="a comment or bytes after it"):
        check_file(tmp_path / "trailing.ckpt")
    # an entry marked encrypted: zipfile raises its own error, refused naming the file
    flagged = bytearray(good)
    central = flagged.index(b"PK\x01\x02")
    flagged[central + 8] |= 1
    (tmp_path / "encrypted.ckpt").write_bytes(bytes(flagged))
    with pytest.raises(UnsafeCheckpointError, match=r"encrypted.ckpt.*cannot be read as torch.save writes it"):
        check_file(tmp_path / "encrypted.ckpt")


def test_what_torch_and_lightning_write_passes(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    tied = torch.randn(4)
    state = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "a": tied, "b": tied[1:]}
    torch.save(state, tmp_path / "ok.ckpt")
    check_file(tmp_path / "ok.ckpt")
    check_pickle(pickle.dumps({"x": [1, (2, 3)], "y": {4}}, protocol=4))  # the general reader
    # bytes and bytearrays (protocol 2 writes them with _codecs.encode(..., "latin1")), floats, big ints as values
    check_pickle(pickle.dumps({"b": b"\x00\xff", "a": bytearray(b"xy"), "f": [0.5] * 1000, "i": 2**80}, protocol=2))
    # keys whose hashes are many but distinct: floats, 64-bit ids, tuples of ints, complex numbers
    keyed = {
        "floats": {i + 0.5: i for i in range(1000)},
        "ids": {2**56 + i: 0 for i in range(1000)},
        "u64": {2**63 + 7919 * i: 0 for i in range(1000)},
        "pairs": {(i, i + 1): 0 for i in range(1000)},
        "complex": {complex(i, 1): 0 for i in range(1000)},
        "set": set(range(1000)),
    }
    check_pickle(pickle.dumps(keyed, protocol=2))
    check_pickle(b"\x80\x02" + b"]" * MAX_DEPTH + b"a" * (MAX_DEPTH - 1) + b".")  # as deep as allowed


def _two_checkpoints(d: Path) -> None:
    seed_everything(7, verbose=False)
    trainer = Trainer(callbacks=[DurableCheckpoint(d, every_n_steps=2, keep_last=None)], max_steps=4, **QUIET)
    trainer.fit(Regression(), regression_loader(32, batch_size=4))


def _replace_committed(d: Path, name: str, data: bytes) -> None:
    """Put ``data`` in place of a committed checkpoint, its marker rewritten to match: it passes every CRC check."""
    (d / name).write_bytes(data)
    marker = d / (name + COMMIT_SUFFIX)
    record = Record.from_json(marker.read_bytes())
    record.size, record.crc32 = len(data), zlib.crc32(data)
    marker.write_bytes(record.to_json())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["hash", "laughs", "deep", "hash-flood-tuples", "bytearray-from-type"])
def test_a_bomb_as_the_newest_checkpoint_falls_back_to_the_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    d = tmp_path / "ckpts"
    _two_checkpoints(d)
    _replace_committed(d, STEP4, _zip(tmp_path / "bomb", BOMBS[name][0]).read_bytes())
    caplog.set_level(logging.INFO, logger="lplugins")
    trainer = Trainer(callbacks=[DurableCheckpoint(d, every_n_steps=100)], max_steps=6, **QUIET)
    trainer.fit(Regression(), regression_loader(32, batch_size=4), ckpt_path="latest")
    assert trainer.ckpt_path == str(d / STEP2) and trainer.global_step == 6
    [skipped] = [r.getMessage() for r in caplog.records if "ckpt_path: skipped" in r.getMessage()]
    assert STEP4 in skipped and BOMBS[name][1] in skipped
    with pytest.raises(UnsafeCheckpointError, match=BOMBS[name][1]):  # named explicitly: refused, no fallback
        Trainer(callbacks=[DurableCheckpoint(d)], max_steps=6, **QUIET).fit(
            Regression(), regression_loader(32, batch_size=4), ckpt_path=str(d / STEP4)
        )
    assert (d / STEP4).exists()  # left in place, as torch's own refusals are


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deep", [False, True], ids=["checked-while-loading", "checked-before-loading"])
def test_a_file_swapped_after_its_crc_check_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, deep: bool
) -> None:
    """An adversary's timing: the newest file is replaced (same bytes, another file) right after its CRC32 pass."""
    from lplugins.callbacks import _resume

    d = tmp_path / "ckpts"
    _two_checkpoints(d)
    real = _resume.bytes_problem

    def then_swap(storage, record, *args, **kwargs):  # type: ignore[no-untyped-def]
        problem = real(storage, record, *args, **kwargs)
        if record.name == STEP4:
            (d / "copy").write_bytes((d / STEP4).read_bytes())
            (d / "copy").replace(d / STEP4)
        return problem

    monkeypatch.setattr(_resume, "bytes_problem", then_swap)
    if not deep:  # the check runs beside the load: make it finish before the load opens the file
        monkeypatch.setattr(_resume, "Overlapped", _CheckFirst)
    caplog.set_level(logging.INFO, logger="lplugins")
    trainer = Trainer(
        callbacks=[DurableCheckpoint(d, every_n_steps=100, verify="deep" if deep else "quick")], max_steps=6, **QUIET
    )
    trainer.fit(Regression(), regression_loader(32, batch_size=4), ckpt_path="latest")
    assert trainer.ckpt_path == str(d / STEP2)
    [skipped] = [r.getMessage() for r in caplog.records if "ckpt_path: skipped" in r.getMessage()]
    assert STEP4 in skipped and "is not the one whose CRC32 was checked" in skipped


class _CheckFirst:
    """``Overlapped`` with the check run at once, on this thread (so a swap after it lands before the load)."""

    def __init__(self, check):  # type: ignore[no-untyped-def]
        self._problem = check()

    def __enter__(self) -> _CheckFirst:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def result(self):  # type: ignore[no-untyped-def]
        return self._problem


DDP_JOB = r"""
import json, logging, sys
import lightning.pytorch as pl
from lplugins.callbacks import DurableCheckpoint
from tests.models import Regression, regression_loader

seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("lplugins").addHandler(Keep())
resume = sys.argv[1] == "resume"
cb = DurableCheckpoint("ckpts", every_n_steps=2, keep_last=None, save_on_train_end=False)
t = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[cb], logger=False, enable_progress_bar=False,
               enable_model_summary=False, max_steps=6 if resume else 4)
model = Regression()
t.fit(model, regression_loader(64, batch_size=4), ckpt_path="latest" if resume else None)
with open(f"out.{t.global_rank}.json", "w") as f:
    json.dump({"ckpt_path": t.ckpt_path, "steps_run": model.steps_run, "log": seen}, f)
"""


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_two_ranks_fall_back_together_past_a_bomb(tmp_path: Path) -> None:
    from tests._dist import run_together

    run_together(DDP_JOB, tmp_path, timeout=150, args=["train"]).check()  # steps 2 and 4
    _replace_committed(tmp_path / "ckpts", STEP4, _zip(tmp_path / "bomb", BOMBS["hash"][0]).read_bytes())
    run_together(DDP_JOB, tmp_path, timeout=60, args=["resume"]).check()  # a hang would be this timeout
    out = [json.loads((tmp_path / f"out.{rank}.json").read_text()) for rank in (0, 1)]
    assert [o["ckpt_path"] for o in out] == [str(Path("ckpts") / STEP2)] * 2
    assert [o["steps_run"] for o in out] == [4, 4]
    [skipped] = [line for line in out[0]["log"] if "ckpt_path: skipped" in line]
    assert STEP4 in skipped and "expand to more than" in skipped
    assert out[1]["log"] == []  # rank zero speaks


@pytest.mark.timeout(60)
def test_a_checkpoint_that_is_not_a_dict_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "ckpts"
    _two_checkpoints(d)
    torch.save([1, 2], tmp_path / "list")  # a real torch file, whose top level is a list
    _replace_committed(d, STEP4, (tmp_path / "list").read_bytes())
    caplog.set_level(logging.INFO, logger="lplugins")
    trainer = Trainer(callbacks=[DurableCheckpoint(d, every_n_steps=100)], max_steps=6, **QUIET)
    trainer.fit(Regression(), regression_loader(32, batch_size=4), ckpt_path="latest")
    assert trainer.ckpt_path == str(d / STEP2)
    [skipped] = [r.getMessage() for r in caplog.records if "ckpt_path: skipped" in r.getMessage()]
    assert STEP4 in skipped and "holds a list, not a checkpoint's dict" in skipped
