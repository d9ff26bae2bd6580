"""A save that fails on rank 0 only: the real error on every rank within seconds, DeepSpeed and FSDP2 included.

DeepSpeed's save ends in its own barrier, which rank 0 never reaches when its part of the save raises;
an error agreement that is a collective would pair with nothing (a 30-minute hang). lplugins agrees
out of band (the store), so both ranks raise, both naming the real error. Real 2-process gloo jobs,
each rank its own process (as torchrun starts them); the process-group timeout is 600 s and each
test's far below it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import run_launched
from tests.test_watchdog import LAUNCH

FAILING_SAVE = (
    LAUNCH
    + r"""
import time
import lplugins
import lightning.pytorch as pl
from lplugins.callbacks import DurableCheckpoint
from tests.models import Regression, regression_loader

STRATEGY = sys.argv[1]
RANK = int(os.environ["RANK"])


class Unpicklable:
    "A hyper-parameter torch.save (pickle protocol 2) refuses on rank 0 only; Lightning's own check passes."

    def __reduce_ex__(self, protocol):
        if RANK == 0 and protocol == 2:
            raise TypeError("cannot pickle 'Unpicklable' object")
        return (Unpicklable, ())

    def __deepcopy__(self, memo):
        return self


class Model(Regression):
    def __init__(self):
        super().__init__(8, (16,), lr=1e-2)
        self.hparams["thing"] = Unpicklable()


start = time.time()
out = {"rank": RANK}
try:
    kwargs = lplugins.compose(strategy=STRATEGY, accelerator="cpu", devices=2, max_steps=4,
                              callbacks=[DurableCheckpoint("ckpts", every_n_steps=2)], logger=False,
                              enable_progress_bar=False, enable_model_summary=False)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(Model(), regression_loader(64, features=8, batch_size=8))
    out["ok"] = True
except BaseException as err:
    out.update(type=type(err).__name__, error=str(err), notes=list(getattr(err, "__notes__", [])))
finally:
    out["seconds"] = time.time() - start
    with open(f"out{RANK}.json", "w") as f:
        json.dump(out, f)
"""
)


def _run(tmp_path: Path, strategy: str) -> list[dict]:
    env = {"LPLUGINS_PG_TIMEOUT": "600", "JOB_DEADLINE": "150"}
    launch = run_launched(FAILING_SAVE, tmp_path, deadline=150, env=env, args=[strategy])
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert None not in launch["codes"], f"the job hung: {launch}\n{logs[0][-3000:]}\n{logs[1][-3000:]}"
    outs = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    return outs


def _check(outs: list[dict]) -> None:
    rank0, rank1 = outs
    assert "cannot pickle 'Unpicklable' object" in rank0["error"], rank0
    # rank 1's save succeeded (or was stuck in the strategy's collective): it raises rank 0's real error
    assert rank1["type"] == "CheckpointWriteError", rank1
    assert "failed on rank 0" in rank1["error"] and "cannot pickle 'Unpicklable' object" in rank1["error"], rank1


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_deepspeed_save_failing_on_rank_zero_raises_the_real_error_on_both_ranks(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    outs = _run(tmp_path, "deepspeed_stage_2_cpu")
    _check(outs)
    # rank 0 learns that rank 1 was stuck in DeepSpeed's own barrier (and why it stops)
    assert any("waits in torch.distributed.barrier()" in note for note in outs[0]["notes"]), outs[0]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_fsdp2_save_failing_on_rank_zero_raises_the_real_error_on_both_ranks(tmp_path: Path) -> None:
    _check(_run(tmp_path, "fsdp2"))
