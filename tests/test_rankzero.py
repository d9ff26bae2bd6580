"""Single-process tests of lplugins.rankzero: rank detection, the rank-aware logger, print/warn, the guard."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lplugins.rankzero import (
    CollectiveInRankZeroBlockError,
    RankZeroFilter,
    get_logger,
    global_rank,
    in_rank_zero_block,
    rank_info,
    rank_zero_block,
    rank_zero_only,
    rank_zero_print,
    rank_zero_warn,
)

RANK_VARS = (
    "RANK",
    "SLURM_PROCID",
    "JSM_NAMESPACE_RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "SLURM_NTASKS",
)


class _Env:
    """Sets variables for one test and restores the whole environment when the test ends.

    (Not ``monkeypatch``: the root conftest checks for leaks before monkeypatch undoes its changes.)
    """

    def setenv(self, key: str, value: str) -> None:
        os.environ[key] = value


@pytest.fixture
def env() -> Iterator[_Env]:
    saved = dict(os.environ)
    for var in RANK_VARS:
        os.environ.pop(var, None)
    try:
        yield _Env()
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ------------------------------------------------------------------------------------ rank detection
@pytest.mark.parametrize(
    ("variables", "rank", "source"),
    [
        ({}, 0, "default"),
        ({"RANK": "3", "WORLD_SIZE": "4"}, 3, "RANK"),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, 5, "SLURM_PROCID"),
        ({"RANK": "1", "SLURM_PROCID": "7"}, 1, "RANK"),  # torchrun inside a SLURM allocation
        ({"LOCAL_RANK": "1"}, 1, "LOCAL_RANK"),  # Lightning's own launcher, one node
        ({"LOCAL_RANK": "1", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 3, "LOCAL_RANK"),
        ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, 1, "LOCAL_RANK"),  # another node: not rank 0
        ({"NODE_RANK": "1"}, 1, "NODE_RANK"),  # main process of node 1, before Lightning launches anything
        ({"NODE_RANK": "0"}, 0, "default"),
        ({"RANK": "not-a-number", "LOCAL_RANK": "2"}, 2, "LOCAL_RANK"),
    ],
)
def test_rank_from_environment(env: _Env, variables: dict[str, str], rank: int, source: str) -> None:
    for key, value in variables.items():
        env.setenv(key, value)
    info = rank_info()
    assert (info.global_rank, info.source) == (rank, source)
    assert global_rank() == rank


def test_rank_from_initialised_process_group_wins(env: _Env, tmp_path) -> None:
    env.setenv("RANK", "7")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert rank_info().source == "process_group"
        assert global_rank() == 0
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- logging
def test_logger_emits_on_rank_zero_with_rank_attribute(env: _Env, caplog) -> None:
    log = get_logger("lplugins.test.rz")
    with caplog.at_level(logging.INFO, logger="lplugins.test.rz"):
        log.info("hello %s", "world")
        log.debug("filtered by level")
    [record] = caplog.records
    assert record.getMessage() == "hello world"
    assert record.rank == 0
    assert record.filename == "test_rankzero.py"  # the caller, not the adapter
    assert record.funcName == "test_logger_emits_on_rank_zero_with_rank_attribute"


def test_logger_on_other_rank_is_silent_unless_all_ranks(env: _Env, caplog) -> None:
    env.setenv("RANK", "1")
    log = get_logger("lplugins.test.rz1")
    with caplog.at_level(logging.INFO, logger="lplugins.test.rz1"):
        log.info("rank zero only")
        log.warning("everyone %d", 1, all_ranks=True)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed", all_ranks=True)
    assert [r.getMessage() for r in caplog.records] == ["[rank 1] everyone 1", "[rank 1] failed"]
    assert all(r.rank == 1 for r in caplog.records)
    assert caplog.records[1].exc_info is not None

    every = get_logger("lplugins.test.rz1", all_ranks=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lplugins.test.rz1"):
        every.info("per logger")
        every.info("but not this one", all_ranks=False)
    assert [r.getMessage() for r in caplog.records] == ["[rank 1] per logger"]


def test_logger_extra_is_kept(env: _Env, caplog) -> None:
    log = get_logger("lplugins.test.extra")
    with caplog.at_level(logging.INFO, logger="lplugins.test.extra"):
        log.info("x", extra={"step": 5})
    assert caplog.records[0].step == 5
    assert caplog.records[0].rank == 0


def test_rank_zero_filter(env: _Env) -> None:
    record = logging.LogRecord("lib", logging.INFO, __file__, 1, "third-party line", None, None)
    assert RankZeroFilter().filter(record)
    env.setenv("RANK", "2")
    record = logging.LogRecord("lib", logging.INFO, __file__, 1, "third-party line", None, None)
    assert not RankZeroFilter().filter(record)
    assert record.rank == 2
    record.all_ranks = True
    assert RankZeroFilter().filter(record)


def test_rank_zero_print(env: _Env, capsys) -> None:
    rank_zero_print("a", 1)
    env.setenv("RANK", "1")
    rank_zero_print("hidden")
    rank_zero_print("b", all_ranks=True)
    assert capsys.readouterr().out == "a 1\n[rank 1] b\n"


def test_rank_zero_warn(env: _Env) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank_zero_warn("careful", RuntimeWarning)
        env.setenv("RANK", "1")
        rank_zero_warn("hidden")
        rank_zero_warn(UserWarning("loud"), all_ranks=True)
    assert [(str(w.message), w.category) for w in caught] == [
        ("careful", RuntimeWarning),
        ("[rank 1] loud", UserWarning),
    ]
    assert caught[0].filename == __file__


# ---------------------------------------------------------------------------------------- the guard
def test_guard_refuses_torch_collectives_and_restores_them() -> None:
    originals = {name: getattr(dist, name) for name in ("all_reduce", "barrier", "broadcast_object_list")}
    with rank_zero_block():
        assert in_rank_zero_block()
        with pytest.raises(CollectiveInRankZeroBlockError, match=r"torch\.distributed\.all_reduce\(\)") as err:
            dist.all_reduce(torch.ones(1))
        assert err.value.call == "torch.distributed.all_reduce()"
        assert "every rank" in str(err.value) and "global rank 0" in str(err.value)
        assert "test_rankzero" in str(err.value)  # names where it was called from
        with pytest.raises(CollectiveInRankZeroBlockError, match="broadcast_object_list"):
            dist.broadcast_object_list([1])
    assert not in_rank_zero_block()
    # outside any block nothing is patched: the very same function objects
    assert {name: getattr(dist, name) for name in originals} == originals
    with pytest.raises((ValueError, RuntimeError)) as err:  # torch's own "not initialized" error
        dist.barrier()
    assert not isinstance(err.value, CollectiveInRankZeroBlockError)


def test_guard_nests_and_unwinds_on_error() -> None:
    original = dist.barrier
    with pytest.raises(KeyError), rank_zero_block():
        with rank_zero_block():
            pass
        assert in_rank_zero_block()  # still inside the outer block
        raise KeyError("user error")
    assert not in_rank_zero_block()
    assert dist.barrier is original


def test_guard_as_decorator_and_rank_zero_only(env: _Env) -> None:
    @rank_zero_block
    def bare() -> None:
        dist.barrier()

    @rank_zero_block()
    def called() -> None:
        dist.all_gather_object([None], 1)

    for fn in (bare, called):
        with pytest.raises(CollectiveInRankZeroBlockError):
            fn()

    calls: list[int] = []

    @rank_zero_only
    def only_zero(x: int) -> int:
        calls.append(x)
        assert in_rank_zero_block()
        return x * 2

    assert only_zero(2) == 4
    env.setenv("RANK", "1")
    assert only_zero(3) is None
    assert calls == [2]


def test_guard_is_per_thread() -> None:
    """A thread outside any block keeps the real collective while another thread is inside one."""
    inside = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def hold_block() -> None:
        with rank_zero_block():
            inside.set()
            release.wait(30)

    holder = threading.Thread(target=hold_block)
    holder.start()
    try:
        assert inside.wait(30)
        assert not in_rank_zero_block()
        try:
            dist.barrier()  # patched now, but this thread is not in a block: torch's own error
        except BaseException as exc:
            errors.append(exc)
    finally:
        release.set()
        holder.join(30)
    assert len(errors) == 1 and not isinstance(errors[0], CollectiveInRankZeroBlockError)


def test_guard_refuses_lightning_calls_in_a_single_process(env: _Env, tmp_path) -> None:
    """What would deadlock under DDP already fails in a one-process run."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False)
    module = BoringModel()
    log_dir = trainer.log_dir  # fine outside a block
    with rank_zero_block():
        with pytest.raises(
            CollectiveInRankZeroBlockError, match=r"Trainer\.save_checkpoint\(\).*request_checkpoint\(trainer\)"
        ):
            trainer.save_checkpoint(tmp_path / "x.ckpt")
        with pytest.raises(CollectiveInRankZeroBlockError, match=r"Trainer\.log_dir.*before the rank-zero block"):
            _ = trainer.log_dir
        with pytest.raises(CollectiveInRankZeroBlockError, match=r"strategy\.barrier"):
            trainer.strategy.barrier()
        with pytest.raises(CollectiveInRankZeroBlockError, match=r"strategy\.broadcast"):
            trainer.strategy.broadcast(1)
        with pytest.raises(CollectiveInRankZeroBlockError, match=r"BoringModel\.log\(\.\.\., sync_dist=True\)"):
            module.log("loss", 1.0, sync_dist=True)
        with pytest.raises(CollectiveInRankZeroBlockError, match=r"BoringModel\.log\(\.\.\., sync_dist=True\)"):
            module.log("loss", 1.0, False, None, None, None, "mean", False, True)  # sync_dist given by position
        with pytest.raises(CollectiveInRankZeroBlockError, match=r"log_dict\(\.\.\., sync_dist=True\)"):
            module.log_dict({"loss": 1.0}, sync_dist=True)
    assert trainer.log_dir == log_dir
    assert not hasattr(type(trainer).save_checkpoint, "__lplugins_guarded__")


# ---------------------------------------------------------------------------------------- docs
def test_docs_examples_run(
    env: _Env, lplugins_manager, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys, caplog
) -> None:
    """Every ```python block of docs/logging.md runs as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "logging.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for block in blocks:
                exec(compile(block, "docs/logging.md", "exec"), {"__name__": "docs_example"})
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    messages = [(r.rank, r.getMessage()) for r in caplog.records if r.name in ("docs_example", "data")]
    assert messages == [
        (0, "logged once per job"),
        (0, "starting"),
        (0, "[rank 0] shard 3 is empty"),
        (0, "[rank 0] loaded my part"),
        (0, "but this one only on rank 0"),
    ]
    assert [str(w.message) for w in caught if "once per job" in str(w.message)] == ["warned once per job"]
    out = capsys.readouterr().out
    assert "printed once per job" in out and "torch.distributed.barrier()" in out
