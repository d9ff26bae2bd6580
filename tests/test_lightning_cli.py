"""A LightningCLI YAML config using lplugins strategy, precision and schedule names and lplugins callbacks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._dist import run_script

CONFIG = """
trainer:
  strategy: ddp_timeout            # registered by the built-in strategies plugin
  accelerator: cpu
  devices: 2
  max_epochs: 2
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
lplugins:
  precision: auto
  accumulate_grad_batches: {0: 2, 1: 1}   # the Lightning guide's dict form
  callbacks:
    - {name: durable_checkpoint, dirpath: CKPTS, every_n_steps: 2}
    - name: metrics
      stages: [train]
      metrics:
        acc:
          class_path: torchmetrics.classification.MulticlassAccuracy
          init_args: {num_classes: 2}
"""

JOB = """
import os
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule
from lplugins.lightning_cli import LightningCLI
from lplugins.accumulation import AccumulationScheduler


class Model(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.layer(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "preds": logits.detach(), "target": y}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


cli = LightningCLI(Model, run=False, args=["--config", os.environ["CLI_CONFIG"]])
t = cli.trainer
sched = AccumulationScheduler.of(t)
names = sorted(type(cb).__name__ for cb in t.callbacks)
cli.trainer.fit(cli.model)
print(f"RANK={t.global_rank} STRATEGY={type(t.strategy).__name__} PRECISION={t.precision} "
      f"STEPS={t.global_step} FACTOR={sched.factor} CALLBACKS={names}", flush=True)
"""


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_yaml_config_with_lplugins_names(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    config = tmp_path / "conf" / "config.yaml"  # LightningCLI saves the resolved config to tmp_path/config.yaml
    config.write_text(CONFIG.replace("CKPTS", str(tmp_path / "ckpts")))
    result = run_script(JOB, tmp_path, env={"CLI_CONFIG": str(config)}, timeout=150).check()
    lines = sorted(re.findall(r"RANK=\d .*?\]", result.stdout))  # the ranks' prints may interleave
    assert len(lines) == 2
    # 64 samples / 2 ranks / batch 4 = 8 batches per epoch: epoch 0 with factor 2 (4 steps), epoch 1 with 1 (8)
    for line in lines:
        assert "STRATEGY=DDPStrategy PRECISION=32-true STEPS=12 FACTOR=1" in line
        assert "AccumulationScheduler" in line and "DurableCheckpoint" in line and "MetricsCallback" in line
    assert list((tmp_path / "ckpts").glob("*.ckpt"))
    assert "lplugins:" in (tmp_path / "config.yaml").read_text()  # the saved config keeps the section


def test_conflicting_trainer_and_lplugins_values(tmp_path: Path) -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lplugins import CompositionError
    from lplugins.lightning_cli import LightningCLI

    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  precision: bf16-mixed\n  logger: false\nlplugins:\n  precision: 32-true\n")
    with pytest.raises(CompositionError, match=r"Both trainer.precision='bf16-mixed' and lplugins.precision='32-true'"):
        LightningCLI(BoringModel, run=False, args=["--config", str(config)])


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            "lplugins:\n  callbacks:\n    - {name: durable_checkpoint, every_n_step: 2}\n",
            r"DurableCheckpoint has no parameter 'every_n_step'. Did you mean 'every_n_steps'\?",
        ),
        (
            "lplugins:\n  strategy: {name: ddp_timeout, find_unused_params: true}\n",
            r"no parameter 'find_unused_params'. Did you mean 'find_unused_parameters'\?",
        ),
        ("lplugins:\n  accumulate_grad_batches: {name: ramp, start: 4}\n", r"missing required parameter\(s\) 'target'"),
        ("trainer:\n  strategy: deepspeed_stage_2\n", r"Use strategy='deepspeed_stage_2_cpu'"),
        ("lplugins:\n  precision: fp16\n", r"Did you mean '16-mixed'\?"),
    ],
)
def test_cli_config_is_checked_before_the_trainer_is_built(tmp_path: Path, section: str, message: str) -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lplugins import CompositionError, UnknownNameError
    from lplugins.lightning_cli import LightningCLI

    config = tmp_path / "c.yaml"
    base = "trainer:\n  accelerator: cpu\n  logger: false\n"
    if section.startswith("trainer:"):
        base, section = base + section.split("\n", 1)[1], ""
    config.write_text(base + section)
    with pytest.raises((CompositionError, UnknownNameError), match=message):
        LightningCLI(BoringModel, run=False, args=["--config", str(config)])
