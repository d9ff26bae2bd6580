"""Resume on another world size: a checkpoint written by N ranks resumes on M (2->1, 1->2, 2->3), for DDP, FSDP2
(sharded directory) and DeepSpeed ZeRO-1/2/3 on CPU; optimizer state compared numerically; a constant global batch
across a resize follows the uninterrupted run's loss curve; what cannot be done is refused before training.

One script, run four times (world sizes 2, 1, 2, 3), each launch running every strategy's fit in turn: the launches
(process start, imports) are what costs, not the tiny models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import run_together

pytest.importorskip("deepspeed")

SCRIPT = r"""
import json, sys
import torch
import lightning.pytorch as pl
import lplugins
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from lplugins.accumulation import AccumulationScheduler, ConstantGlobalSchedule
from lplugins.callbacks import DurableCheckpoint
from lplugins.strategies import FSDP2Strategy
from tests.models import Regression, regression_data

phase, world = sys.argv[1], int(sys.argv[2])
DATA = TensorDataset(*regression_data(64, features=8))


class Model(Regression):
    def train_dataloader(self):
        t = self.trainer  # the ranks take the epoch in turns, in order: the global batch is the same on any size
        sampler = DistributedSampler(DATA, num_replicas=t.world_size, rank=t.global_rank, shuffle=False)
        return DataLoader(DATA, batch_size=2, sampler=sampler)


class PlainModel(Model):
    def train_dataloader(self):  # Lightning's sampler: none on a single device, its DistributedSampler on DDP
        return DataLoader(DATA, batch_size=2)


def full_state(trainer, module):
    # every parameter's fp32 value and Adam moments, gathered whole (collective on every rank)
    out = {}
    strategy = trainer.strategy
    if isinstance(strategy, pl.strategies.DeepSpeedStrategy):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
        for name, p in strategy.model.module.named_parameters():
            out[name] = [t.flatten().tolist() for t in (safe_get_full_fp32_param(p),
                         safe_get_full_optimizer_state(p, "exp_avg"), safe_get_full_optimizer_state(p, "exp_avg_sq"))]
        return out
    opt = trainer.optimizers[0]
    whole = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().flatten().tolist()
    for name, p in module.named_parameters():
        state = opt.state.get(p, {})
        out[name] = [whole(p)] + [whole(state[k]) if k in state else None for k in ("exp_avg", "exp_avg_sq")]
    return out


class Snap(pl.Callback):
    def __init__(self, tag):
        self.tag = tag

    def on_train_start(self, trainer, module):
        if trainer.global_step:  # resumed (a fresh optimizer has no moments yet)
            self.dump(trainer, module, "start")

    def on_train_end(self, trainer, module):
        self.dump(trainer, module, "end")

    def dump(self, trainer, module, when):
        state = full_state(trainer, module)
        if trainer.is_global_zero:
            with open(f"{self.tag}-{phase}-{when}.json", "w") as f:
                json.dump({"step": trainer.global_step, "state": state}, f)


def strategy(name):
    if name == "fsdp2":
        return FSDP2Strategy(save_distributed_checkpoint=True)
    return {"single": "auto", "ddp": "ddp_timeout", "z1": "deepspeed_stage_1_cpu", "z2": "deepspeed_stage_2_cpu",
            "z3": "deepspeed_stage_3_cpu"}[name]


def fit(name, dirpath, max_steps, callbacks=(), ckpt_path="latest", model=None):
    kwargs = lplugins.compose(strategy=strategy(name), accelerator="cpu", devices=world, max_steps=max_steps,
                              callbacks=[DurableCheckpoint(dirpath, keep_last=None), *callbacks], logger=False,
                              enable_progress_bar=False, enable_model_summary=False)
    trainer = pl.Trainer(**kwargs)
    model = model or Model(8, (16,), lr=1e-2, seed=0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def refusal(name, dirpath, max_steps, callbacks=()):
    try:
        fit(name, dirpath, max_steps, callbacks)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def accumulation():
    return AccumulationScheduler(ConstantGlobalSchedule(8), log_changes=True)


PLAN = {  # phase: (strategies, max_steps); each resumes the latest checkpoint in its directory
    "a": (["ddp", "fsdp2", "z1", "z2", "z3"], 3),  # 2 ranks, from scratch
    "b": (["ddp", "fsdp2", "z1", "z2", "z3"], 5),  # 2 -> 1
    "c": (["ddp", "fsdp2", "z1", "z2", "z3"], 7),  # 1 -> 2
    "d": (["ddp", "fsdp2", "z2"], 8),  # 2 -> 3
}
out = {}
names, steps = PLAN[phase]
for name in names:
    trainer, _ = fit(name, name, steps, [Snap(name)])
if phase == "a":  # constant global batch 8 = 2 ranks x micro 2 x 2; uninterrupted, and stopped mid-epoch
    _, full = fit("ddp", "acc_full", 6, [accumulation()], model=Model(8, (16,), lr=1e-2, seed=0, step_lr=2))
    _, part = fit("ddp", "acc", 3, [accumulation()], model=Model(8, (16,), lr=1e-2, seed=0, step_lr=2))
    out.update(acc_full=full.losses, acc_part=part.losses)
if phase == "b":  # resumed on 1 rank x micro 2 x 4
    _, rest = fit("ddp", "acc", 6, [accumulation()], model=Model(8, (16,), lr=1e-2, seed=0, step_lr=2))
    out.update(acc_rest=rest.losses)
    fit("single", "single", 3, [Snap("single")], model=PlainModel(8, (16,), lr=1e-2, seed=0))  # mid-epoch
if phase == "c":  # single device -> DDP on 2: another sampler, so the epoch in progress restarts
    _, single = fit("ddp", "single", 5, [Snap("single")], model=PlainModel(8, (16,), lr=1e-2, seed=0))
    out.update(single_steps=single.steps_run)
if phase == "d":  # global batch 8 cannot be 3 ranks x micro 2 x k
    out.update(indivisible=refusal("ddp", "acc", 9, [accumulation()]))
    import lplugins.strategies.deepspeed as ds

    def broken(path):
        raise ValueError("no such layout")

    ds.full_from_zero = broken  # a ZeRO-1 checkpoint of 2 ranks whose reading fails on every rank
    out.update(conversion=refusal("z1", "z1", 9))
with open(f"out-{phase}-{trainer.global_rank}.json", "w") as f:
    json.dump(out, f)
"""


def _state(tmp_path: Path, name: str, phase: str, when: str) -> dict:
    return json.loads((tmp_path / f"{name}-{phase}-{when}.json").read_text())


def _step_losses(per_rank: list[list[float]], window: int) -> list[float]:
    """The mean loss of each optimizer step's global batch, from every rank's micro-batch losses."""
    steps = len(per_rank[0]) // window
    return [
        sum(sum(r[s * window : (s + 1) * window]) for r in per_rank) / (window * len(per_rank)) for s in range(steps)
    ]


@pytest.mark.distributed
@pytest.mark.extended  # covered by test_resume_matrix.py and test_accumulation_ddp.py (docs/architecture.md)
@pytest.mark.timeout(600)
def test_resume_on_another_world_size(tmp_path: Path) -> None:
    logs = {}
    for phase, world in (("a", 2), ("b", 1), ("c", 2), ("d", 3)):
        result = run_together(SCRIPT, tmp_path, timeout=300, args=[phase, str(world)], ranks=world).check()
        logs[phase] = result.stdout + result.stderr
    # optimizer state exactly as saved: the fp32 weights and Adam moments after the load are those of the save
    resumes = {"b": "a", "c": "b", "d": "c"}
    for phase, saved in resumes.items():
        names = ["ddp", "fsdp2", "z1", "z2", "z3"] if phase != "d" else ["ddp", "fsdp2", "z2"]
        for name in names:
            before, after = _state(tmp_path, name, saved, "end"), _state(tmp_path, name, phase, "start")
            assert after["step"] == before["step"], (name, phase)
            assert after["state"] == before["state"], f"{name}: state after {saved}->{phase} differs"
            assert _state(tmp_path, name, phase, "end")["step"] == {"b": 5, "c": 7, "d": 8}[phase]
    # what happened is said once, on rank zero
    assert "resuming a checkpoint written by 2 rank(s) on 1 rank(s)" in logs["b"]
    assert "read as one full checkpoint in" in logs["b"]
    assert "resuming a checkpoint written by 1 rank(s) on 2 rank(s)" in logs["c"]
    assert "resuming a checkpoint written by 2 rank(s) on 3 rank(s)" in logs["d"]
    assert logs["b"].count("resuming a checkpoint written by 2 rank(s) on 1 rank(s)") == 6  # 5 strategies + acc
    # the epoch in progress (batch 3 of 8 steps): 24 samples trained, each of 1 rank continues after 12 batches
    assert "each of the 1 continues after 12 batches" in logs["b"]
    # single device -> 2 DDP ranks: the state comes across; the epoch in progress restarts, and says so
    assert _state(tmp_path, "single", "c", "start")["state"] == _state(tmp_path, "single", "b", "end")["state"]
    assert _state(tmp_path, "single", "c", "start")["step"] == 3
    assert "sampler is not a DistributedSampler (before and now): epoch 0 restarts from its first batch" in logs["c"]
    assert json.loads((tmp_path / "out-c-0.json").read_text())["single_steps"] == 2
    # a constant global batch across 2 -> 1 ranks follows the uninterrupted run's loss curve
    a = [json.loads((tmp_path / f"out-a-{rank}.json").read_text()) for rank in (0, 1)]
    b = json.loads((tmp_path / "out-b-0.json").read_text())
    full = _step_losses([r["acc_full"] for r in a], 2)
    resized = _step_losses([r["acc_part"] for r in a], 2) + _step_losses([b["acc_rest"]], 4)
    assert len(full) == 6 and len(resized) == 6
    assert resized == pytest.approx(full, rel=1e-5, abs=1e-7)
    # refused, before any step, on every rank, saying why and what to do
    for rank in (0, 1, 2):
        d = json.loads((tmp_path / f"out-d-{rank}.json").read_text())
        assert d["indivisible"].startswith("ScheduleError: Cannot resume a checkpoint written by 1 rank(s) on 3")
        # every rank says the reason; "latest" did not fall back to the older checkpoints, nothing quarantined
        assert d["conversion"].startswith("DeepSpeedReshardError: Cannot resume DeepSpeed checkpoint z1/step=000000007")
        assert "partitions failed (ValueError: no such layout). Resume it on 2 rank(s)" in d["conversion"]
    assert not (tmp_path / "z1" / "quarantine").exists()
    assert not list(tmp_path.glob("*/*.converted/.tmp.*"))  # no conversion left half-made


def test_strategy_families_and_refusals_before_loading(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    from lplugins.callbacks._record import Record
    from lplugins.callbacks._reshard import (
        DEEPSPEED,
        UNSHARDED,
        ReshardError,
        check_resume,
        family,
        needs_full_checkpoint,
    )
    from lplugins.strategies import DeepSpeedStrategy

    assert family(DeepSpeedStrategy) == family("DeepSpeedStrategy") == DEEPSPEED
    assert family(DDPStrategy) == family("SingleDeviceStrategy") == UNSHARDED
    assert family("AcmeStrategy") is None
    ddp = SimpleNamespace(strategy=DDPStrategy(), world_size=1)
    fsdp1 = Record("a.ckpt", 3, 0, 0.0, kind="dir", world_size=2, strategy="FSDPStrategy")  # a layout not converted
    with pytest.raises(ReshardError, match=r"written by FSDPStrategy \(FSDP\) on 2 rank\(s\), as a sharded directory"):
        check_resume(ddp, fsdp1, "a.ckpt")
    # a DeepSpeed directory into DDP is converted (one full checkpoint), not refused (issue #29)
    zero = Record("z.ckpt", 3, 0, 0.0, kind="dir", world_size=2, strategy="DeepSpeedStrategy")
    check_resume(ddp, zero, "z.ckpt")
    assert needs_full_checkpoint(ddp, zero)
    assert not needs_full_checkpoint(ddp, Record("f.ckpt", 3, 0, 0.0, world_size=2, strategy="FSDP2Strategy"))
    check_resume(ddp, Record("b.ckpt", 3, 0, 0.0, world_size=2, strategy="SingleDeviceStrategy"), "b.ckpt")
    check_resume(ddp, Record("c.ckpt", 3, 0, 0.0, kind="dir", world_size=2, strategy="AcmeStrategy"), "c.ckpt")


def test_deepspeed_world_size_is_read_from_the_files_and_a_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    from lplugins.strategies.deepspeed import convert_to_universal, saved_dp_world_size

    ckpt = tmp_path / "step=3.ckpt"
    (ckpt / "checkpoint").mkdir(parents=True)
    (ckpt / "latest").write_text("checkpoint")
    for rank in range(3):
        (ckpt / "checkpoint" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    (ckpt / "checkpoint" / "mp_rank_00_model_states.pt").touch()
    assert saved_dp_world_size(ckpt) == 3
    assert saved_dp_world_size(tmp_path / "missing") is None
    work = tmp_path / ".tmp.universal.step=3.ckpt"
    with pytest.raises(Exception):  # noqa: B017 - whatever DeepSpeed's converter raises for empty files
        convert_to_universal(str(ckpt), str(work))
    assert not work.exists()
