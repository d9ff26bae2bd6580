"""FSDP2 ``save_distributed_checkpoint=True`` with ``DurableCheckpoint(async_save=True)`` and ``continuous=True``:
every rank snapshots its own shards into reused CPU buffers at the step boundary, torch DCP writes them in the
background on a gloo group of its own, and rank 0 commits only after every rank's files are written; a failed
write on any rank surfaces on every rank at the next step boundary, nothing of it committed.

Real 2-process jobs (gloo on CPU); each script runs several fits, so the process start is paid once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lplugins.callbacks._record import COMMIT_SUFFIX
from tests._dist import run_together

pytestmark = pytest.mark.distributed

COMMON = r"""
import errno, json, os, sys, time
import torch
import lightning.pytorch as pl
from lplugins.callbacks import CheckpointWriteError, DurableCheckpoint
from lplugins.callbacks import _sharded_async
from lplugins.strategies import FSDP2Strategy
from tests.models import Regression, regression_loader


def model():
    return Regression(8, (16, 16), lr=1e-2, seed=0)


def loader():
    return regression_loader(64, features=8, batch_size=4)


def trainer(cb, extra=(), **kw):
    return pl.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(save_distributed_checkpoint=True),
                      callbacks=[cb, *extra], logger=False, enable_progress_bar=False, enable_model_summary=False,
                      **kw)


def full_state(trainer, module):  # every parameter and Adam moment, gathered whole (collective on every rank)
    whole = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().flatten().tolist()
    opt = trainer.optimizers[0]
    out = {}
    for name, p in module.named_parameters():
        state = opt.state.get(p, {})
        out[name] = [whole(p)] + [whole(state[k]) if k in state else None for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


class Snap(pl.Callback):
    def __init__(self):
        self.start = self.end = None

    def on_train_start(self, trainer, module):
        if trainer.global_step:
            self.start = full_state(trainer, module)

    def on_train_end(self, trainer, module):
        self.end = full_state(trainer, module)


BUFFERS = []  # each save's staging buffers (data_ptr), on this rank
ORIGINAL_SAVE = _sharded_async.ShardedAsyncWriter.save
def spy(self, trainer, checkpoint, record):
    ORIGINAL_SAVE(self, trainer, checkpoint, record)
    BUFFERS.append([b.data_ptr() for b in self.last_buffers])
_sharded_async.ShardedAsyncWriter.save = spy
"""


@pytest.mark.timeout(300)
def test_async_sharded_saves_commit_resume_identically_and_reuse_their_buffers(tmp_path: Path) -> None:
    source = (
        COMMON
        + r"""
snap = Snap()
cb = DurableCheckpoint("ckpts", async_save=True, every_n_steps=2, keep_last=None)
t = trainer(cb, [snap], max_steps=6)
t.fit(model(), loader())
rank = t.global_rank
stalls, buffers = cb.save_stalls, list(BUFFERS)
snap2 = Snap()
t2 = trainer(DurableCheckpoint("ckpts", async_save=True, every_n_steps=2, keep_last=None), [snap2], max_steps=7)
t2.fit(model(), loader(), ckpt_path="latest")
print(json.dumps({"rank": rank, "committed": [os.path.basename(p) for p in cb.committed],
                  "resumed": os.path.basename(t2.ckpt_path or ""), "same": snap.end == snap2.start,
                  "has_moments": all(v[1] is not None for v in snap.end.values()), "buffers": buffers,
                  "files": sorted(os.listdir("ckpts/step=000000006-epoch=0000.ckpt")), "stalls": stalls,
                  "diff": {k: [i for i in range(4) if v[i] != snap2.start[k][i]] for k, v in snap.end.items()}}))
"""
    )
    result = run_together(source, tmp_path, timeout=280).check()
    by_rank = {o["rank"]: o for o in result.json_objects() if "committed" in o}
    assert set(by_rank) == {0, 1}, result.stdout
    for o in by_rank.values():
        assert o["resumed"] == "step=000000006-epoch=0000.ckpt", o
        assert o["same"] and o["has_moments"], o["diff"]  # the resumed parameters and Adam state are the saved ones
        # Lightning's sharded layout: each rank's DCP file, the DCP metadata, and the rest of the checkpoint
        assert o["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], o["files"]
        saves = o["buffers"]
        assert len(saves) == 3 and saves[0], saves  # steps 2, 4, 6 (the end of training is step 6 already)
        assert saves[1] == saves[0] and saves[2] == saves[0], "staging buffers were reallocated"
    assert by_rank[0]["committed"] == [f"step=00000000{s}-epoch=0000.ckpt" for s in (2, 4, 6)]
    marker = json.loads((tmp_path / "ckpts" / ("step=000000006-epoch=0000.ckpt" + COMMIT_SUFFIX)).read_text())
    assert set(marker.get("crcs", {})) == set(marker["files"]) and marker["kind"] == "dir", marker


@pytest.mark.timeout(300)
def test_continuous_sharded_saves_commit_several_and_resume(tmp_path: Path) -> None:
    source = (
        COMMON
        + r"""
class WritesKeepUp(pl.Callback):  # before the checkpoint's hook (Lightning runs checkpoints last): each boundary
    def on_train_batch_end(self, trainer, *args):  # finds the last save committed, however loaded the machine
        cb._writer.flush()

cb = DurableCheckpoint("ckpts", continuous=True, async_save=True, keep_last=2, max_slowdown=None)
t = trainer(cb, [WritesKeepUp()], max_steps=12)
t.fit(model(), loader())
saves = len(cb.save_stalls)
snap = Snap()
t2 = trainer(DurableCheckpoint("ckpts", continuous=True, async_save=True, keep_last=2), [snap], max_steps=14)
t2.fit(model(), loader(), ckpt_path="latest")
print(json.dumps({"rank": t.global_rank, "saves": saves, "committed": [os.path.basename(p) for p in cb.committed],
                  "resumed": os.path.basename(t2.ckpt_path or ""), "entries": sorted(os.listdir("ckpts"))}))
"""
    )
    result = run_together(source, tmp_path, timeout=280).check()
    by_rank = {o["rank"]: o for o in result.json_objects() if "saves" in o}
    assert set(by_rank) == {0, 1}, result.stdout
    assert by_rank[0]["saves"] == by_rank[1]["saves"] == 12, by_rank  # every boundary, the same on both ranks
    assert by_rank[0]["resumed"] == by_rank[1]["resumed"] == "step=000000012-epoch=0001.ckpt"
    assert len(by_rank[0]["committed"]) == 2 and by_rank[0]["committed"][-1] == "step=000000012-epoch=0001.ckpt"
    assert not [e for e in by_rank[0]["entries"] if e.startswith(".tmp")], by_rank[0]["entries"]


@pytest.mark.timeout(300)
def test_a_failed_background_write_on_rank_one_raises_on_both_ranks_and_commits_nothing(tmp_path: Path) -> None:
    source = (
        COMMON
        + r"""
ORIGINAL_WRITER = _sharded_async.storage_writer
def failing(path):  # rank 1's shard write of the second save fails (a full disk)
    writer = ORIGINAL_WRITER(path)
    if "step=000000004" in path:
        def write_data(plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        writer.write_data = write_data
    return writer

class Where(pl.Callback):
    step = None
    def on_exception(self, trainer, module, err):
        Where.step = trainer.global_step

cb = DurableCheckpoint("ckpts", async_save=True, every_n_steps=2, keep_last=None)
t = trainer(cb, [Where()], max_steps=12)
if t.global_rank == 1:
    _sharded_async.storage_writer = failing
error = None
try:
    t.fit(model(), loader())
except CheckpointWriteError as err:
    error = str(err)
time.sleep(0.5)
print(json.dumps({"rank": t.global_rank, "error": error, "step": Where.step,
                  "committed": [os.path.basename(p) for p in cb.committed], "entries": sorted(os.listdir("ckpts"))}))
"""
    )
    result = run_together(source, tmp_path, timeout=280).check()
    by_rank = {o["rank"]: o for o in result.json_objects() if "error" in o}
    assert set(by_rank) == {0, 1}, result.stdout
    for o in by_rank.values():
        assert o["error"], o  # CheckpointWriteError on both ranks
    # raised at a step boundary after the save of step 4 (on both ranks the same), not inside that save
    assert by_rank[0]["step"] == by_rank[1]["step"] > 4, by_rank
    assert "No space left on device" in by_rank[1]["error"], by_rank[1]["error"]
    assert by_rank[0]["committed"][0] == "step=000000002-epoch=0000.ckpt", by_rank[0]  # intact
    names = [e for e in by_rank[0]["entries"] if "step=000000004" in e]
    assert names == [], by_rank[0]["entries"]  # nothing of the failed save: no entry, no marker, no temporary
    assert "step=000000002-epoch=0000.ckpt" in by_rank[0]["entries"]


@pytest.mark.timeout(300)
def test_a_failed_commit_on_rank_zero_fails_the_same_save_on_both_ranks_with_two_in_flight(tmp_path: Path) -> None:
    """Rank 0's commit (after every rank wrote) fails: rank 1 learns it for that save, so the two ranks' queues of
    saves stay paired (without it, rank 1's next save waited in a collective rank 0 never made, or paired with
    rank 0's next save and a directory without rank 1's file was committed)."""
    source = (
        COMMON
        + r"""
ORIGINAL_COMMIT = _sharded_async.ShardedAsyncWriter.commit_entry
def failing(self, tmp, record, **kw):  # rank 0's marker of the save of step 4 cannot be written (a full disk)
    if record.global_step == 4:
        raise OSError(errno.ENOSPC, "No space left on device", tmp)
    return ORIGINAL_COMMIT(self, tmp, record, **kw)

cb = DurableCheckpoint("ckpts", async_save=True, every_n_steps=1, keep_last=None, max_in_flight=2)
t = trainer(cb, max_steps=12)
if t.global_rank == 0:
    _sharded_async.ShardedAsyncWriter.commit_entry = failing
error = None
try:
    t.fit(model(), loader())
except CheckpointWriteError as err:
    error = str(err)
time.sleep(0.5)
dirs = {e: sorted(os.listdir(os.path.join("ckpts", e))) for e in os.listdir("ckpts")
        if os.path.isdir(os.path.join("ckpts", e))}
print(json.dumps({"rank": t.global_rank, "error": error, "committed": [os.path.basename(p) for p in cb.committed],
                  "dirs": dirs}))
"""
    )
    result = run_together(source, tmp_path, timeout=280).check()
    by_rank = {o["rank"]: o for o in result.json_objects() if "error" in o}
    assert set(by_rank) == {0, 1}, result.stdout
    assert "No space left on device" in (by_rank[0]["error"] or ""), by_rank[0]
    assert "failed on rank 0" in (by_rank[1]["error"] or ""), by_rank[1]
    committed = by_rank[0]["committed"]
    assert committed and all("step=000000004" not in c for c in committed), committed
    for name in committed:  # every committed checkpoint holds both ranks' shards
        files = by_rank[0]["dirs"][name]
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= set(files), (name, files)


@pytest.mark.timeout(300)
def test_an_async_sharded_checkpoint_resumes_on_another_world_size(tmp_path: Path) -> None:
    """Written in the background by 2 ranks, resumed by 1: every parameter and Adam moment as saved (torch DCP
    reshards on load; the layout is the synchronous save's)."""
    source = (
        COMMON
        + r"""
world = int(sys.argv[1])
snap = Snap()
cb = DurableCheckpoint("ckpts", async_save=True, every_n_steps=2, keep_last=None)
t = pl.Trainer(accelerator="cpu", devices=world, strategy=FSDP2Strategy(save_distributed_checkpoint=True),
               callbacks=[cb, snap], logger=False, enable_progress_bar=False, enable_model_summary=False,
               max_steps=4 if world == 2 else 5)
t.fit(model(), loader(), ckpt_path=None if world == 2 else "latest")
if t.global_rank == 0:
    if world == 2:
        with open("saved.json", "w") as f:
            json.dump(snap.end, f)
    else:
        with open("saved.json") as f:
            saved = json.load(f)
        print(json.dumps({"resumed": os.path.basename(t.ckpt_path or ""), "step": t.global_step,
                          "same": json.loads(json.dumps(snap.start)) == saved, "params": len(saved)}))
"""
    )
    run_together(source, tmp_path, timeout=200, args=["2"]).check()
    result = run_together(source, tmp_path, timeout=200, args=["1"], ranks=1).check()
    (out,) = result.json_objects()
    assert out["resumed"] == "step=000000004-epoch=0000.ckpt" and out["step"] == 5, out
    assert out["same"] and out["params"] == 6, out  # 3 layers' weight and bias, each with its Adam moments
    assert "resuming a checkpoint written by 2 rank(s) on 1 rank(s)" in result.stdout + result.stderr
