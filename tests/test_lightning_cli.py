"""A LightningCLI YAML config using lplugins strategy, precision and schedule names and lplugins callbacks,
for both Lightning namespaces (``lplugins.lightning_cli.LightningCLI`` given a ``pytorch_lightning`` model
builds the ``pytorch_lightning`` CLI)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._dist import run_script

PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


@pytest.fixture(params=sorted(PACKAGES))
def package(request: pytest.FixtureRequest) -> str:
    """``lightning.pytorch`` or ``pytorch_lightning``: the namespace the project is written for."""
    pytest.importorskip(PACKAGES[request.param])
    return PACKAGES[request.param]


def _boring_model(package: str) -> type:
    import importlib

    return importlib.import_module(f"{package}.demos.boring_classes").BoringModel


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
from {package} import LightningModule
from lplugins.lightning_cli import LightningCLI


class Model(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.layer(x)
        return {{"loss": torch.nn.functional.cross_entropy(logits, y), "preds": logits.detach(), "target": y}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


cli = LightningCLI(Model, run=False, args=["--config", os.environ["CLI_CONFIG"]])
t = cli.trainer
assert type(t).__module__.startswith("{package}."), type(t)
sched = next(cb for cb in t.callbacks if type(cb).__name__ == "AccumulationScheduler")
names = sorted(type(cb).__name__ for cb in t.callbacks)
cli.trainer.fit(cli.model)
print(f"RANK={{t.global_rank}} STRATEGY={{type(t.strategy).__name__}} PRECISION={{t.precision}} "
      f"STEPS={{t.global_step}} FACTOR={{sched.factor}} CLI={{type(cli).__module__}} CALLBACKS={{names}}", flush=True)
"""


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_yaml_config_with_lplugins_names(tmp_path: Path, package: str) -> None:
    (tmp_path / "conf").mkdir()
    config = tmp_path / "conf" / "config.yaml"  # LightningCLI saves the resolved config to tmp_path/config.yaml
    config.write_text(CONFIG.replace("CKPTS", str(tmp_path / "ckpts")))
    result = run_script(JOB.format(package=package), tmp_path, env={"CLI_CONFIG": str(config)}, timeout=150).check()
    lines = sorted(re.findall(r"RANK=\d .*?\]", result.stdout))  # the ranks' prints may interleave
    assert len(lines) == 2
    # 64 samples / 2 ranks / batch 4 = 8 batches per epoch: epoch 0 with factor 2 (4 steps), epoch 1 with 1 (8)
    for line in lines:
        assert "STRATEGY=DDPStrategy PRECISION=32-true STEPS=12 FACTOR=1" in line
        cli = "lplugins._pl.lightning_cli" if package == "pytorch_lightning" else "lplugins.lightning_cli"
        assert f"CLI={cli} " in line
        assert "AccumulationScheduler" in line and "DurableCheckpoint" in line and "MetricsCallback" in line
    assert list((tmp_path / "ckpts").glob("*.ckpt"))
    assert "lplugins:" in (tmp_path / "config.yaml").read_text()  # the saved config keeps the section


def test_conflicting_trainer_and_lplugins_values(tmp_path: Path, package: str) -> None:
    BoringModel = _boring_model(package)
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
def test_cli_config_is_checked_before_the_trainer_is_built(
    tmp_path: Path, section: str, message: str, package: str
) -> None:
    BoringModel = _boring_model(package)
    from lplugins import CompositionError, UnknownNameError
    from lplugins.lightning_cli import LightningCLI

    config = tmp_path / "c.yaml"
    base = "trainer:\n  accelerator: cpu\n  logger: false\n"
    if section.startswith("trainer:"):
        base, section = base + section.split("\n", 1)[1], ""
    config.write_text(base + section)
    with pytest.raises((CompositionError, UnknownNameError), match=message):
        LightningCLI(BoringModel, run=False, args=["--config", str(config)])


def test_the_cli_of_the_models_namespace_composes_for_it(tmp_path: Path, package: str) -> None:
    from lplugins import CompositionError
    from lplugins.lightning_cli import LightningCLI, PytorchLightningCLI

    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  logger: false\n  strategy: ddp_timeout\n"
        "lplugins:\n  precision: auto\n  callbacks: [durable_checkpoint]\n"
    )
    cli = LightningCLI(_boring_model(package), run=False, args=["--config", str(config)])
    assert type(cli.trainer).__module__.startswith(package + ".")
    assert type(cli.trainer.strategy).__module__.startswith(package + ".") is False  # lplugins' DDPStrategy ...
    assert isinstance(cli.trainer.strategy, __import__(f"{package}.strategies", fromlist=["DDPStrategy"]).DDPStrategy)
    assert any(type(cb).__name__ == "DurableCheckpoint" for cb in cli.trainer.callbacks)
    ours = PytorchLightningCLI if package == "pytorch_lightning" else LightningCLI
    assert type(cli) is ours

    class OtherCLI(LightningCLI if package == "pytorch_lightning" else PytorchLightningCLI):  # type: ignore[misc,valid-type]
        pass

    with pytest.raises(CompositionError, match=r"derive it from lplugins\.lightning_cli\."):
        OtherCLI(_boring_model(package), run=False, args=["--config", str(config)])
