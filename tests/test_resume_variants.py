"""Resume anywhere, the variants beyond the matrix: bf16 and fp16 (loss-scaled) ZeRO, DeepSpeed CPU offload, an
optimizer other than Adam, and several optimizers.

Each is saved by 2 ranks and resumed on 1 (another data-parallel world size, another layout); the fp32 weights and
the whole optimizer state (and under fp16 the loss scale) right after the load must be those at the end of the
save, bit for bit, or the cell must be refused before training, naming both layouts and what would work. The
matrix (``test_resume_matrix.py``) covers the layouts in fp32 with Adam.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import run_together

pytest.importorskip("deepspeed")

SCRIPT = r"""
import json, sys
import lightning.pytorch as pl
import torch
import lplugins
from lplugins.callbacks import DurableCheckpoint
from tests.models import Regression, regression_loader

phase, world, which = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)


class Model(Regression):
    def __init__(self, optimizer="adam"):
        super().__init__(8, (24,), lr=1e-2, seed=0, optimizer=optimizer)
        if optimizer == "two":
            self.automatic_optimization = False

    def configure_optimizers(self):
        if self.optimizer == "momentum":  # SGD's state: one momentum buffer per parameter, no step
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        if self.optimizer == "two":  # two optimizers (manual optimization): one per layer
            first, second = self.net[0].parameters(), self.net[2].parameters()
            return [torch.optim.Adam(first, lr=1e-2), torch.optim.SGD(second, lr=1e-2, momentum=0.9)]
        return super().configure_optimizers()

    def training_step(self, batch, batch_idx):
        if self.optimizer != "two":
            return super().training_step(batch, batch_idx)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y.float())
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()


def whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().flatten().tolist()


class Snap(pl.Callback):
    def __init__(self, key, at_end):
        self.key, self.at_end = key, at_end

    def on_train_start(self, trainer, module):
        if not self.at_end:
            self.snap(trainer, module)

    def on_train_end(self, trainer, module):
        if self.at_end:
            self.snap(trainer, module)

    def snap(self, trainer, module):
        state, scale = {}, None
        if isinstance(trainer.strategy, pl.strategies.DeepSpeedStrategy):
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            engine = trainer.strategy.deepspeed_engine
            keys = sorted(k for s in engine.optimizer.optimizer.state.values() for k in s if k != "step")
            for n, p in module.named_parameters():
                state[n] = [whole(safe_get_full_fp32_param(p))]
                state[n] += [whole(safe_get_full_optimizer_state(p, k)) for k in sorted(set(keys))]
            scaler = getattr(engine.optimizer, "loss_scaler", None)
            if engine.fp16_enabled():
                scale = [scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter]
        else:
            for opt in trainer.optimizers:
                for n, p in module.named_parameters():
                    if p in opt.state:
                        st = opt.state[p]
                        state[n] = [whole(p)] + [whole(st[k]) for k in sorted(st) if k != "step"]
        if trainer.is_global_zero:
            with open(f"{self.key}.json", "w") as f:
                json.dump({"step": trainer.global_step, "state": state, "scale": scale}, f)


def build(strategy):
    from lplugins.strategies import DeepSpeedStrategy, FSDP2Strategy

    if strategy == "fsdp2":
        return FSDP2Strategy(save_distributed_checkpoint=True)
    if strategy.startswith("fp16-z"):  # a loss scale that moves within 3 steps (grows every 2 without overflow)
        return DeepSpeedStrategy(stage=int(strategy[-1]), initial_scale_power=8, loss_scale_window=2)
    return strategy


def fp16_supported():
    from lplugins.strategies import _ds_cpu

    return _ds_cpu._fp16_supported()


def fit(strategy, precision, optimizer, dirpath, max_steps, key, at_end):
    kwargs = lplugins.compose(
        strategy=build(strategy), accelerator="cpu", devices=world, max_steps=max_steps, precision=precision,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[DurableCheckpoint(dirpath, keep_last=None), Snap(key, at_end)],
    )
    trainer = pl.Trainer(**kwargs)
    trainer.fit(Model(optimizer), regression_loader(64, features=8, batch_size=2), ckpt_path="latest")


SAVES = {  # name: strategy on 2 ranks, precision, optimizer
    "bf16": ("deepspeed_stage_2_cpu", "bf16-mixed", "adam"),
    "fp16": ("fp16-z2", "16-true", "adam"),  # DeepSpeed's fp16 with its dynamic loss scale ('16-mixed' is GPU-only)
    "offload": ("deepspeed_stage_2_offload_cpu", "32-true", "adam"),
    "momentum": ("deepspeed_stage_3_cpu", "32-true", "momentum"),
    "two": ("ddp_timeout", "32-true", "two"),
    "two-sharded": ("fsdp2", "32-true", "two"),
}
RESUMES = {  # name: source, strategy on 1 rank, precision
    "bf16-z2": ("bf16", "deepspeed_stage_2_cpu", "bf16-mixed"),
    "bf16-ddp": ("bf16", "ddp_timeout", "bf16-mixed"),
    "fp16-z3": ("fp16", "fp16-z3", "16-true"),
    "fp16-ddp": ("fp16", "ddp_timeout", "32-true"),
    "offload-z3offload": ("offload", "deepspeed_stage_3_offload_cpu", "32-true"),
    "offload-ddp": ("offload", "ddp_timeout", "32-true"),
    "momentum-z1": ("momentum", "deepspeed_stage_1_cpu", "32-true"),
    "two-fsdp2": ("two", "fsdp2", "32-true"),
    "two-sharded-ddp": ("two-sharded", "ddp_timeout", "32-true"),
    "two-z2": ("two", "deepspeed_stage_2_cpu", "32-true"),
}
if which == "core":  # what only this test covers: the loss scale, the refusals
    SAVES = {k: v for k, v in SAVES.items() if k in ("fp16", "two")}
    RESUMES = {k: v for k, v in RESUMES.items() if k in ("fp16-z3", "two-fsdp2", "two-z2")}
errors = {}
if not fp16_supported():  # DeepSpeed's CPU accelerator runs fp16 only on CPUs with oneDNN fp16: refused before training
    try:
        fit(*SAVES["fp16"], "fp16", 3, "saved-fp16", True)
    except Exception as err:
        errors["fp16-refused"] = f"{type(err).__name__}: {err}"
    SAVES = {k: v for k, v in SAVES.items() if not k.startswith("fp16")}
    RESUMES = {k: v for k, v in RESUMES.items() if not k.startswith("fp16")}
if phase == "save":
    for name, (strategy, precision, optimizer) in SAVES.items():
        fit(strategy, precision, optimizer, name, 3, f"saved-{name}", True)
else:
    import shutil

    for name, (source, strategy, precision) in RESUMES.items():
        shutil.copytree(source, name)
        try:
            steps = 6 if source.startswith("two") else 4  # two optimizers: 2 steps a batch
            fit(strategy, precision, SAVES[source][2], name, steps, f"resumed-{name}", False)
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"
print("ERRORS " + json.dumps(errors))
"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "which",
    [
        "core",  # fp16 ZeRO-2 on 2 -> ZeRO-3 on 1 (the loss scale), several optimizers refused
        # covered in the default tier by [core] (the same reader and checks) and test_resume_matrix.py (every layout)
        pytest.param("all", marks=pytest.mark.extended),
    ],
)
def test_precision_offload_and_optimizers_resume_on_another_world_size_or_are_refused(
    tmp_path: Path, which: str
) -> None:
    run_together(SCRIPT, tmp_path, args=["save", "2", which], ranks=2, timeout=200).check()
    result = run_together(SCRIPT, tmp_path, args=["resume", "1", which], ranks=1, timeout=200).check()
    said = result.stdout + result.stderr
    errors = json.loads(next(x for x in result.stdout.splitlines() if x.startswith("ERRORS "))[len("ERRORS ") :])

    def state(name: str) -> dict:
        return json.loads((tmp_path / f"{name}.json").read_text())

    fp16 = "fp16-refused" not in errors  # this CPU runs DeepSpeed's fp16 (oneDNN fp16: AVX512-FP16, AMX-FP16)
    everything = ("bf16-z2", "bf16-ddp", "fp16-z3", "fp16-ddp", "offload-z3offload", "offload-ddp", "momentum-z1",
                  "two-sharded-ddp")  # fmt: skip
    checked = everything if which == "all" else ("fp16-z3",)
    for resumed in [r for r in checked if fp16 or not r.startswith("fp16")]:
        assert resumed not in errors, errors.get(resumed)
        source = resumed.rsplit("-", 1)[0]
        saved, loaded = state(f"saved-{source}"), state(f"resumed-{resumed}")
        assert loaded["step"] == saved["step"] > 0, resumed
        assert loaded["state"] == saved["state"], f"{resumed}: the state after the load is not the saved one"
    if fp16:
        # fp16: DeepSpeed's dynamic loss scale moved during the save (it grows every 2 steps) and comes across
        scale = state("saved-fp16")["scale"]
        assert scale[0] > 2.0**8 and scale[1] == 3, scale
        assert state("resumed-fp16-z3")["scale"] == scale
        # ... and where it cannot go (torch's GradScaler, '16-mixed', GPU only) the resume is refused before
        # loading: what those refusals read, here on CPU
        from lplugins._lightning.portable import torch_loss_scale
        from lplugins._lightning.zero_shards import LOSS_SCALE_KEY, full_from_zero, loss_scaled

        saved = str(next(tmp_path.glob("fp16/*.ckpt")))
        assert loss_scaled(saved) and full_from_zero(saved)[LOSS_SCALE_KEY]["cur_scale"] == scale[0]
        assert torch_loss_scale({"MixedPrecision": {"scale": 1024.0}}) and not torch_loss_scale({"MixedPrecision": {}})
        assert list(tmp_path.glob("fp16-z3/*.converted/full.ckpt.json"))
    else:  # refused before training on every rank, saying why and what runs instead; nothing written
        refusal = errors.pop("fp16-refused")
        assert refusal.startswith("DeepSpeedConfigError: Trainer(precision='16-true') with DeepSpeed on CPU"), refusal
        assert "Use precision='bf16-mixed' (any CPU) or '32-true'" in refusal
        assert not list(tmp_path.glob("fp16/*.ckpt"))
    # each ZeRO directory was read in the resuming process, no universal conversion; the full file kept beside it
    reads = said.count("read as one full checkpoint in")
    assert reads == (3 if which == "all" else 0) + (1 if fp16 else 0), reads
    assert not list(tmp_path.glob("*/*.converted/universal*"))
    # several optimizers: a full file into FSDP2 is refused before anything is loaded; DeepSpeed takes one optimizer
    assert errors["two-fsdp2"].startswith("ReshardError: Cannot resume two-fsdp2/step="), errors["two-fsdp2"]
    assert "with the state of 2 optimizers" in errors["two-fsdp2"]
    assert "Resume it with the unsharded (DDP, single device) strategy it was written with" in errors["two-fsdp2"]
    assert not list(tmp_path.glob("resumed-two-fsdp2.json"))  # no training step ran
    assert "DeepSpeed currently only supports single optimizer" in errors["two-z2"]
    assert set(errors) == {"two-fsdp2", "two-z2"}
