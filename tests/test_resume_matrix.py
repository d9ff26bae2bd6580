"""Resume anywhere: a checkpoint of any built-in strategy and world size resumes with any other, no offline step.

The matrix itself is ``benchmarks/resume_matrix.py`` (save with {single, DDP, FSDP2, ZeRO-1/2/3} x {1, 2, 3} ranks,
resume in every other cell; fp32 weights, Adam moments and step, LR bitwise as saved; the next samples of the epoch
exactly; a constant global batch said once on rank zero). The default tier runs a representative subset: the three
layouts (a DDP file, a ZeRO-2 directory, an FSDP2 sharded directory) written by 2 ranks, each resumed on 1 rank by
ZeRO-3 (a change of family, of ZeRO stage and of world size each); the how-to's ZeRO-2 on 2 -> FSDP2 on 1 and the
stock test below add a ZeRO directory and a file into FSDP2; the whole matrix is ``extended``.
Beside it: conversions made once and reused (committed, verified, removed with their checkpoint; or committed in the
background after a resume that read the checkpoint directly), a stock
Lightning ``ModelCheckpoint`` file resumed by FSDP2 and ZeRO-3, ``lplugins checkpoint export``, and a cell that
cannot work refused before training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import ROOT, run_script, run_together

pytest.importorskip("deepspeed")

MATRIX = ROOT / "benchmarks" / "resume_matrix.py"


def _matrix(tmp_path: Path, *args: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, str(MATRIX), "--work", str(tmp_path / "m"), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return {"summary": json.loads(done.stdout.strip().splitlines()[-1]), "table": done.stdout}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_layout_resumes_with_another_strategy_and_world_size(tmp_path: Path) -> None:
    out = _matrix(tmp_path, "--sources", "ddp@2,z2@2,fsdp2@2", "--targets", "z3@1", timeout=380)
    summary = out["summary"]
    assert summary["cells"] == 3
    assert summary["passed"] == 3, out["table"]
    # each conversion made once, kept beside its checkpoint with its manifest: the ZeRO-2 directory read in memory
    # into ZeRO-3, its full file committed after the load (no universal conversion); the FSDP2 directory's full file
    # made before its load; a DDP file needs none
    resumed = tmp_path / "m" / "resume" / "z3@1"
    for source, kinds in (("z2@2", {"full.ckpt", "full.ckpt.json"}), ("fsdp2@2", {"full.ckpt", "full.ckpt.json"})):
        converted = list((resumed / source).glob("*.ckpt.converted"))
        assert len(converted) == 1, source
        assert {p.name for p in converted[0].iterdir()} == kinds, source
    assert not list((resumed / "ddp@2").glob("*.converted"))
    # lplugins checkpoint export: the plain state dict of a ZeRO-2 and of an FSDP2 checkpoint is the saved one
    import torch

    from lplugins._cli.export import ExportError, export_checkpoint

    for cell in ("z2@2", "fsdp2@2"):
        target = tmp_path / f"{cell}.pt"
        done = export_checkpoint(str(tmp_path / "m" / "save" / cell), str(target))
        assert done["checked"] == "every byte verified against its commit marker"
        exported = torch.load(target, weights_only=True)
        saved = torch.load(tmp_path / "m" / "save" / f"{cell}.end.pt", weights_only=True)
        assert sorted(exported) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
        assert all(torch.equal(exported[k].reshape(-1), saved[k][0]) for k in exported), cell
    assert not list((tmp_path / "m" / "save" / "z2@2").glob("*.converted"))  # read directly: nothing written
    full = export_checkpoint(str(tmp_path / "m" / "save" / "z2@2"), str(tmp_path / "full.ckpt"), full=True)
    loaded = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert full["layout"] == "a DeepSpeed ZeRO directory" and loaded["global_step"] == 3
    assert set(loaded["optimizer_states"][0]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    with pytest.raises(ExportError, match="neither a checkpoint"):
        export_checkpoint(str(tmp_path), str(tmp_path / "x.pt"))


@pytest.mark.extended  # covered in the default tier by test_every_layout_resumes_with_another_strategy_and_world_size
@pytest.mark.distributed
@pytest.mark.timeout(3600)
def test_the_whole_resume_matrix(tmp_path: Path) -> None:
    out = _matrix(tmp_path, timeout=3500)
    assert out["summary"]["cells"] == 16 * 15
    assert out["summary"]["failed"] == 0, out["table"]


STOCK = r"""
import json, sys
import torch
import lightning.pytorch as pl
import lplugins
from lightning.pytorch.callbacks import ModelCheckpoint
from lplugins.callbacks import DurableCheckpoint
from lplugins.strategies import FSDP2Strategy
from tests.models import Regression, regression_loader

out = {}


class Model(Regression):
    def __init__(self, optimizer="adam"):
        super().__init__(8, (16,), lr=1e-2, seed=0, optimizer=optimizer)

    def configure_optimizers(self):
        if self.optimizer == "adafactor":  # factored second moments: not one value per element of a parameter
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)
        return super().configure_optimizers()


class Snap(pl.Callback):
    def __init__(self, key, at_end=False):
        self.key, self.at_end = key, at_end

    def on_train_start(self, trainer, module):
        if not self.at_end:
            self.snap(trainer, module)

    def on_train_end(self, trainer, module):
        if self.at_end:
            self.snap(trainer, module)

    def snap(self, trainer, module):
        opt = trainer.optimizers[0]
        if isinstance(trainer.strategy, pl.strategies.DeepSpeedStrategy):
            from deepspeed import zero
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            state = {}
            for n, p in module.named_parameters():
                with zero.GatheredParameters([p]):
                    weights = p.data.flatten().tolist()
                state[n] = [safe_get_full_fp32_param(p).flatten().tolist(), weights,
                            safe_get_full_optimizer_state(p, "exp_avg").flatten().tolist()]
        else:
            whole = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().flatten().tolist()
            state = {n: [whole(p), whole(p), whole(opt.state[p]["exp_avg"]) if p in opt.state else None]
                     for n, p in module.named_parameters()}
        out[self.key] = {"step": trainer.global_step, "state": state}


def fit(strategy, max_steps, callbacks, ckpt_path=None, optimizer="adam"):
    kwargs = lplugins.compose(strategy=strategy, accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                              enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(Model(optimizer), regression_loader(32, features=8, batch_size=4), ckpt_path=ckpt_path)
    return trainer


# a stock Lightning checkpoint: DDP, ModelCheckpoint, no lplugins callback
fit("ddp_timeout", 3, [ModelCheckpoint(dirpath="stock", every_n_train_steps=3, save_last=True), Snap("saved", True)])
for name, strategy in (("fsdp2", FSDP2Strategy()), ("z3", "deepspeed_stage_3_cpu")):
    fit(strategy, 4, [Snap(name)], ckpt_path="stock/last.ckpt")  # no DurableCheckpoint either
# a cell that cannot work: optimizer state DeepSpeed cannot partition, refused before training
fit("ddp_timeout", 2, [DurableCheckpoint("fact", keep_last=None)], optimizer="adafactor")
try:
    fit("deepspeed_stage_2_cpu", 4, [DurableCheckpoint("fact", keep_last=None), Snap("refused")], "latest", "adafactor")
except Exception as err:
    out["refusal"] = f"{type(err).__name__}: {err}"
print("RESULT " + json.dumps(out))
"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stock_lightning_checkpoint_resumes_under_fsdp2_and_zero3_and_a_misfit_is_refused(tmp_path: Path) -> None:
    result = run_together(STOCK, tmp_path, ranks=1, timeout=280).check()
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    saved = out["saved"]
    assert saved["step"] == 3
    for name in ("fsdp2", "z3"):
        assert out[name]["step"] == 3, name
        assert out[name]["state"] == saved["state"], f"{name}: the state after the load is not the saved one"
    refusal = out["refusal"]
    assert "refused" not in out  # no training step ran
    assert refusal.startswith(("ReshardError: Cannot resume", "DeepSpeedReshardError: Cannot resume")), refusal
    assert "(one full checkpoint file) with DeepSpeed ZeRO-2 on 1 rank(s)" in refusal
    assert "optimizer state 'row_var' of parameter 'net.0.weight'" in refusal
    assert "Resume it with the strategy that wrote it (DDP, single device and FSDP2" in refusal


def test_a_conversion_is_committed_reused_verified_and_removed_with_its_checkpoint(tmp_path: Path) -> None:
    from lplugins._lightning.converted import cached_conversion, converted_dir
    from lplugins.callbacks._record import COMMIT_SUFFIX
    from lplugins.callbacks._storages import open_storage

    source = tmp_path / "step=000000003-epoch=0000.ckpt"
    source.write_bytes(b"checkpoint bytes")
    builds: list[str] = []

    def build(tmp: str) -> None:
        builds.append(tmp)
        os.makedirs(tmp)
        Path(tmp, "a.pt").write_bytes(b"converted")

    path, how = cached_conversion(str(source), "universal", build)
    assert how == "made" and Path(path, "a.pt").read_bytes() == b"converted"
    assert not [p for p in Path(converted_dir(str(source))).iterdir() if p.name.startswith(".tmp.")]
    assert cached_conversion(str(source), "universal", build) == (path, "reused") and len(builds) == 1
    Path(path, "a.pt").write_bytes(b"CONVERTED")  # same size, other bytes: not used, made again
    path, how = cached_conversion(str(source), "universal", build)
    assert how.startswith("made (the one there was not used: a.pt does not match its manifest)") and len(builds) == 2
    os.utime(source, ns=(1, 1))  # another checkpoint under the same name
    assert cached_conversion(str(source), "universal", build)[1].startswith("made (the one there was not used: made")

    def broken(tmp: str) -> None:
        os.makedirs(tmp)
        raise ValueError("no such layout")

    with pytest.raises(ValueError, match="no such layout"):
        cached_conversion(str(source), "full.ckpt", broken)
    assert sorted(p.name for p in Path(converted_dir(str(source))).iterdir()) == ["universal", "universal.json"]
    # a resume that read what it needed in memory commits it on a thread, once; a build cut short is cleaned up
    from lplugins._lightning.converted import commit_in_background, committed

    Path(converted_dir(str(source)), ".tmp.full.ckpt.0123456789ab").write_bytes(b"cut short")
    threads = [commit_in_background(str(source), "full.ckpt", build) for _ in range(2)]
    assert threads[0] is not None and threads[0].name == "lplugins-convert-full.ckpt" and not threads[0].daemon
    threads[0].join()
    assert threads[1] is None or (threads[1].join() or True)  # the second found it made or being made
    assert committed(str(source), "full.ckpt") and commit_in_background(str(source), "full.ckpt", build) is None
    assert sorted(p.name for p in Path(converted_dir(str(source))).iterdir()) == [
        "full.ckpt", "full.ckpt.json", "universal", "universal.json"
    ]  # fmt: skip
    Path(converted_dir(str(source)), "full.ckpt", "a.pt").unlink()
    Path(converted_dir(str(source)), "full.ckpt.json").unlink()
    # retention deletes a checkpoint with its conversions; the clean-up at a start removes those of one that is gone
    storage = open_storage(str(tmp_path))
    (tmp_path / (source.name + COMMIT_SUFFIX)).write_text("{}")
    storage.delete(source.name)
    assert list(tmp_path.iterdir()) == []
    orphan = tmp_path / "step=000000009-epoch=0000.ckpt.converted"
    orphan.mkdir()
    storage.clean_leftovers()
    assert not orphan.exists()


HOWTO = ROOT / "docs" / "how-to" / "move-a-run.md"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_move_a_run_how_to(tmp_path: Path) -> None:
    """docs/how-to/move-a-run.md, run as shown: ZeRO-2 on 2 processes, then FSDP2 on 1, then the export. Not run:
    its ZeRO-3 on 3 processes line (the matrix covers every such cell)."""
    import re

    import torch

    text = HOWTO.read_text()
    script = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)[0]
    commands = re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)[0].splitlines()
    assert commands[0].startswith("python train.py deepspeed_stage_2_cpu 2 3")
    assert commands[1].startswith("python train.py fsdp2 1 5")
    # both ranks started at once, as torchrun would (the guide tests cover Lightning's launcher)
    run_together(script, tmp_path, name="train.py", args=["deepspeed_stage_2_cpu", "2", "3"], ranks=2).check()
    second = run_script(script, tmp_path, name="train.py", args=["fsdp2", "1", "5"], start="launcher").check()
    said = second.stdout + second.stderr
    assert "resuming a checkpoint written by 2 rank(s) on 1 rank(s): the DeepSpeed directory was converted" in said
    assert said.count("lplugins: world size changed from 2 to 1 since the checkpoint") == 1
    assert "each of the 1 continues after 18 batches, same order (DistributedSampler)" in said
    assert commands[3].strip() == "lplugins checkpoint export checkpoints model.pt"
    from lplugins.cli import main

    assert main(["checkpoint", "export", str(tmp_path / "checkpoints"), str(tmp_path / "model.pt")]) == 0
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(state) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
