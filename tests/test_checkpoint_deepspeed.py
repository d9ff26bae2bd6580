"""DurableCheckpoint with DeepSpeed ZeRO-2 on 2 CPU processes: directory checkpoints, committed and resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import run_together

pytest.importorskip("deepspeed")

SCRIPT = r"""
import json, os
import torch
import lightning.pytorch as pl
import lplugins
from lplugins.callbacks import DurableCheckpoint, latest_checkpoint
from lplugins.callbacks._storages import open_storage
from tests.models import Regression, regression_loader


class Start(pl.Callback):
    def on_train_start(self, trainer, module):
        self.step = trainer.global_step


data = regression_loader(64, features=8, batch_size=8)


def fit(max_steps, ckpt_path=None):
    cb, start = DurableCheckpoint("ckpts", every_n_steps=2, keep_last=2), Start()
    kwargs = lplugins.compose(strategy="deepspeed_stage_2_cpu", accelerator="cpu", devices=2, max_steps=max_steps,
                              callbacks=[cb, start], logger=False, enable_progress_bar=False,
                              enable_model_summary=False)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(Regression(8, (16,), lr=1e-2), data, ckpt_path=ckpt_path)
    return trainer, cb, start


t1, cb1, s1 = fit(5, ckpt_path="latest")  # nothing to resume yet: a fresh start
t2, cb2, s2 = fit(7, ckpt_path="latest")
records = [(r.name, r.kind, r.global_step, len(r.files)) for r in open_storage("ckpts").find_committed()]
with open(f"rank{t2.global_rank}.json", "w") as f:
    entries = sorted(e for e in os.listdir("ckpts") if e != ".lplugins-claim.json")  # rank 0 may still hold it
    json.dump({"starts": [s1.step, s2.step], "records": records, "entries": entries,
               "latest": latest_checkpoint("ckpts")}, f)
"""


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_deepspeed_directory_checkpoints_commit_and_resume(tmp_path: Path) -> None:
    run_together(SCRIPT, tmp_path, timeout=400).check()
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["starts"] == [0, 5]  # the second run resumed at the end-of-fit checkpoint of the first
        # every 2 steps and at the end: 2, 4, 5 then 6, 7; keep_last=2
        assert [(kind, step) for _, kind, step, _ in res["records"]] == [("dir", 6), ("dir", 7)]
        assert all(nfiles >= 2 for *_, nfiles in res["records"])  # both ranks' shards are in the record
        names = [name for name, *_ in res["records"]]
        assert res["entries"] == sorted(names + [n + ".commit" for n in names])  # nothing else left behind
        assert res["latest"].endswith(names[-1])


ACCUMULATION_SCRIPT = r"""
import json
import lightning.pytorch as pl
import lplugins
from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._storages import open_storage
from tests.models import Regression, regression_loader

cb = DurableCheckpoint("ckpts", every_n_steps=2, keep_last=None, save_on_train_end=False)
kwargs = lplugins.compose(strategy="deepspeed_stage_2_cpu", accelerator="cpu", devices=2, max_steps=4,
                          accumulate_grad_batches=2, callbacks=[cb], logger=False, enable_progress_bar=False,
                          enable_model_summary=False)
trainer = pl.Trainer(**kwargs)
trainer.fit(Regression(8, (16,), lr=1e-2), regression_loader(64, features=8, batch_size=4))
with open(f"rank{trainer.global_rank}.json", "w") as f:
    json.dump([(r.global_step, r.epoch, r.kind) for r in open_storage("ckpts").find_committed()], f)
"""


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_deepspeed_with_accumulation_never_saves_a_step_0_directory(tmp_path: Path) -> None:
    run_together(ACCUMULATION_SCRIPT, tmp_path, timeout=280).check()
    for rank in (0, 1):
        # 8 micro-batches per rank, 2 per step: steps 1..4; saves at 2 and 4, none mid-window at step 0
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [[2, 0, "dir"], [4, 0, "dir"]]
