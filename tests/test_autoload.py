"""Unchanged projects (#15): ``LPLUGINS_AUTO_NAMES=1`` and the ``pytorch_lightning.callbacks_factory`` entry point.

(Zero-code mode through each namespace's ``callbacks_factory`` group: tests/test_namespace_surface.py.)

The project scripts here never import lplugins. The launcher does what the interpreter does at start
with lplugins installed: it processes the site directory holding ``lplugins_names.pth`` (and, for the
zero-code test, a distribution declaring lplugins' entry points), then runs the project unchanged.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tomllib

from tests._dist import ROOT, run_script

PTH = ROOT / "src" / "lplugins_names.pth"

LAUNCHER = """
import runpy, site, sys
site.addsitedir(sys.argv[1])
runpy.run_path("project.py", run_name="__main__")
"""

PROJECT = """
import sys
{imports}
assert "lplugins" not in sys.modules or "lplugins._composition.autoload" in sys.modules
try:
    trainer = Trainer(strategy="{strategy}", accelerator="cpu", devices=1, logger=False)
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
else:
    print("STRATEGY", type(trainer.strategy).__module__, type(trainer.strategy).__mro__[2].__module__)
print("LPLUGINS_IMPORTED", "lplugins" in sys.modules)
"""


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(PTH, site / PTH.name)
    return site


def _run(tmp_path: Path, imports: str, strategy: str, env: dict[str, str]) -> dict[str, str]:
    (tmp_path / "project.py").write_text(PROJECT.format(imports=imports, strategy=strategy))
    out = run_script(LAUNCHER, tmp_path, env=env, args=[str(_site(tmp_path))], name="launch.py", timeout=180).check()
    lines = {}
    for line in out.stdout.splitlines():
        key, _, rest = line.partition(" ")
        lines[key] = rest
    return lines


@pytest.mark.parametrize(
    ("imports", "module"),
    [
        (
            "from lightning.pytorch import Trainer",
            "lplugins.strategies.deepspeed lightning.pytorch.strategies.deepspeed",
        ),
        (
            "from pytorch_lightning import Trainer",
            "lplugins._pl.strategies.deepspeed pytorch_lightning.strategies.deepspeed",
        ),
    ],
)
def test_strategy_names_work_in_an_unchanged_project_with_the_switch(tmp_path: Path, imports: str, module: str) -> None:
    pytest.importorskip(imports.split()[1])
    lines = _run(tmp_path, imports, "deepspeed_stage_2_cpu", {"LPLUGINS_AUTO_NAMES": "1"})
    assert lines.get("STRATEGY") == module, lines


def test_without_the_switch_nothing_is_imported(tmp_path: Path) -> None:
    lines = _run(
        tmp_path, "from lightning.pytorch import Trainer", "deepspeed_stage_2_cpu", {"LPLUGINS_AUTO_NAMES": "0"}
    )
    assert "invalid strategy name" in lines.get("ERROR", ""), lines
    assert lines["LPLUGINS_IMPORTED"] == "False"


def test_a_broken_plugin_under_the_switch_is_named(tmp_path: Path) -> None:
    site = tmp_path / "plugins"
    (site / "broken_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "broken_plugin-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n"
    )
    (site / "broken_plugin-1.0.dist-info" / "entry_points.txt").write_text("[lplugins]\nbroken = broken_plugin\n")
    (site / "broken_plugin.py").write_text("raise RuntimeError('boom at import')\n")
    env = {"LPLUGINS_AUTO_NAMES": "1", "PYTHONPATH": f"{site}"}
    (tmp_path / "project.py").write_text("from lightning.pytorch import Trainer\n")
    import os

    env["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    out = run_script(LAUNCHER, tmp_path, env=env, args=[str(_site(tmp_path))], name="launch.py", timeout=180)
    assert out.returncode != 0
    assert "PluginError" in out.stderr and "broken" in out.stderr and "boom at import" in out.stderr, out.stderr


def test_pth_and_pytorch_lightning_entry_point_are_packaged() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]["src/lplugins_names.pth"] == (
        "lplugins_names.pth"
    )
    groups = project["project"]["entry-points"]
    factory = "lplugins._pl._composition.factory:callbacks_factory"
    assert groups["pytorch_lightning.callbacks_factory"]["lplugins"] == factory


HYDRA_TRAIN = """
import sys

import hydra
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, TensorDataset
import {package} as pl


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    trainer = hydra.utils.instantiate(cfg.trainer)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    model = Regression()
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer.fit(model, data, ckpt_path=cfg.get("ckpt_path"))
    callbacks = sorted(type(cb).__module__ + "." + type(cb).__name__ for cb in trainer.callbacks)
    print("DONE", trainer.global_step, model.steps_run, type(trainer.strategy).__module__, callbacks)
    other = "pytorch_lightning" if pl.__name__ == "lightning.pytorch" else "lightning.pytorch"
    print("OTHER", other in sys.modules)


if __name__ == "__main__":
    main()
"""

HYDRA_CONFIG = """
trainer:
  _target_: {package}.Trainer
  accelerator: cpu
  devices: 1
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  max_steps: 4
ckpt_path: null
hydra:
  run:
    dir: outputs
"""

HYDRA_LAUNCHER = """
import runpy, site, sys
site.addsitedir(sys.argv[1])
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
"""

#: A third-party plugin that contributes lplugins' durable_checkpoint to every Trainer (zero-code mode).
DURABLE_EVERYWHERE = """
import os
import lplugins


@lplugins.hookimpl
def lplugins_trainer_callbacks(trainer_kwargs):
    component = lplugins.get_manager().get("callback", "durable_checkpoint")
    return [component.create(dirpath=os.environ["CKPT_DIR"], every_n_steps=2)]
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("package", "twin"),
    [("lightning.pytorch", "lplugins."), ("pytorch_lightning", "lplugins._pl.")],
)
def test_an_unchanged_hydra_project_with_names_callbacks_and_resume(tmp_path: Path, package: str, twin: str) -> None:
    """A Hydra project written the way lightning-hydra-template is (``_target_: <package>.Trainer``),
    run unchanged with ``LPLUGINS_AUTO_NAMES=1``: a ``trainer.strategy=<lplugins name>`` override, a
    callback a plugin contributes in zero-code mode (``durable_checkpoint``), and a second run with
    ``ckpt_path=latest`` that resumes where the first one stopped."""
    pytest.importorskip("hydra")
    pytest.importorskip(package)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "train.yaml").write_text(HYDRA_CONFIG.format(package=package))
    (tmp_path / "train.py").write_text(HYDRA_TRAIN.replace("{package}", package))
    site = _site(tmp_path)
    info = site / "durable_everywhere-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: durable-everywhere\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lplugins]\ndurable_everywhere = durable_everywhere\n")
    (site / "durable_everywhere.py").write_text(DURABLE_EVERYWHERE)
    env = {
        "LPLUGINS_AUTO_NAMES": "1",
        "LPLUGINS_AUTO_CALLBACKS": "1",
        "CKPT_DIR": str(tmp_path / "ckpts"),
        "HYDRA_FULL_ERROR": "1",
    }

    def run(*overrides: str) -> list[str]:
        out = run_script(HYDRA_LAUNCHER, tmp_path, env=env, args=[str(site), *overrides], name="launch.py", timeout=180)
        done = [line for line in out.stdout.splitlines() if line.startswith("DONE")]
        assert out.returncode == 0 and done, out.stdout + out.stderr[-4000:]
        assert "OTHER False" in out.stdout  # the namespace the project does not use is never imported
        return done[0].split(" ", 4)

    _, step, ran, strategy, callbacks = run("+trainer.strategy=ddp_timeout")
    assert (step, ran, strategy) == ("4", "4", f"{twin}strategies.ddp")
    assert f"{twin}callbacks.checkpoint.DurableCheckpoint" in callbacks
    assert list((tmp_path / "ckpts").glob("*.commit"))

    _, step, ran, strategy, _ = run("+trainer.strategy=ddp_timeout", "trainer.max_steps=6", "ckpt_path=latest")
    assert (step, ran) == ("6", "2")  # resumed at step 4


ACME_PLUGIN = """
import importlib
import lplugins

PACKAGES = {
    "lightning": ("lightning.pytorch", "lightning.fabric"),
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
}


def environment():
    fabric = PACKAGES[lplugins.current_namespace()][1]
    base = importlib.import_module(fabric + ".plugins.environments").LightningEnvironment
    return type("AcmeEnvironment", (base,), {})()


def double():
    return importlib.import_module(PACKAGES[lplugins.current_namespace()][0] + ".plugins").DoublePrecision()


@lplugins.hookimpl
def lplugins_register_cluster_environments(register):
    register("acme_env", environment)


@lplugins.hookimpl
def lplugins_register_precisions(register):
    register("acme_double", double)
"""

NAMES_PROJECT = """
from {package} import Trainer

for kwargs in ({{"plugins": ["acme_env"]}}, {{"plugins": ["acme_double"]}}, {{"precision": "acme_double"}}):
    try:
        Trainer(accelerator="cpu", devices=1, logger=False, **kwargs)
        print("PLAIN ok")
    except Exception as exc:
        print("PLAIN", type(exc).__name__, str(exc).splitlines()[0])

import lplugins  # the documented way: lplugins composes what Lightning takes only as objects

trainer = lplugins.compose_trainer(
    accelerator="cpu", devices=1, logger=False, strategy="ddp_timeout", plugins=["acme_env", "acme_double"]
)
print("COMPOSED", type(trainer.strategy.cluster_environment).__name__, type(trainer.precision_plugin).__name__)
"""


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_precision_and_cluster_environment_names_are_objects_to_lightning(tmp_path: Path, package: str) -> None:
    """Under the switch, a third party's precision and cluster-environment names are registered (as
    strategy names are), but Lightning 2.6 takes neither by name: ``plugins=`` accepts only
    instances (any string: "Found invalid type for plugin") and ``precision=`` only its own fixed
    strings; it has no registry for them (docs/how-to/hydra.md, "Names in an unchanged project").
    The same names work through ``compose``/``compose_trainer``, in either namespace."""
    pytest.importorskip(package)
    site = _site(tmp_path)
    info = site / "acme_names-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-names\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lplugins]\nacme_names = acme_names\n")
    (site / "acme_names.py").write_text(ACME_PLUGIN)
    (tmp_path / "project.py").write_text(NAMES_PROJECT.format(package=package))
    out = run_script(
        LAUNCHER, tmp_path, env={"LPLUGINS_AUTO_NAMES": "1"}, args=[str(site)], name="launch.py", timeout=180
    ).check()
    plain = [line for line in out.stdout.splitlines() if line.startswith("PLAIN")]
    assert plain[0].startswith("PLAIN MisconfigurationException Found invalid type for plugin acme_env"), plain
    assert plain[1].startswith("PLAIN MisconfigurationException Found invalid type for plugin acme_double"), plain
    assert plain[2].startswith("PLAIN ValueError Precision 'acme_double' is invalid"), plain
    assert "COMPOSED AcmeEnvironment DoublePrecision" in out.stdout, out.stdout + out.stderr
