"""Unchanged projects (#15): ``LPLUGINS_AUTO_NAMES=1`` and the ``pytorch_lightning.callbacks_factory`` entry point.

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
assert "lplugins" not in sys.modules or "lplugins._autoload" in sys.modules
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
    assert groups["pytorch_lightning.callbacks_factory"]["lplugins"] == "lplugins._pl._factory:callbacks_factory"


def test_zero_code_mode_through_the_pytorch_lightning_entry_point(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    site = _site(tmp_path)
    info = site / "zero_code_pl-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zero-code-pl\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[pytorch_lightning.callbacks_factory]\nlplugins = lplugins._pl._factory:callbacks_factory\n"
        "[lplugins]\nlr_everywhere = lr_everywhere\n"
    )
    (site / "lr_everywhere.py").write_text(
        "import importlib\nimport lplugins\n\n"
        "@lplugins.hookimpl\n"
        "def lplugins_trainer_callbacks(trainer_kwargs):\n"
        "    namespace = lplugins.current_namespace()\n"
        "    package = 'pytorch_lightning' if namespace == 'pytorch_lightning' else 'lightning.pytorch'\n"
        "    return [importlib.import_module(package + '.callbacks').LearningRateMonitor()]\n"
    )
    (tmp_path / "project.py").write_text(
        "import pytorch_lightning as pl\n"
        "trainer = pl.Trainer(accelerator='cpu', logger=False)\n"
        "print('CALLBACKS', sorted(type(cb).__name__ for cb in trainer.callbacks))\n"
        "from torch.utils.data import DataLoader\n"
        "class M(pl.LightningModule):\n"
        "    pass\n"
        "try:\n"
        "    trainer.fit(M(), ckpt_path='latest')\n"
        "except Exception as exc:\n"
        "    print('FIT', type(exc).__name__, str(exc).splitlines()[0])\n"
    )
    out = run_script(
        LAUNCHER, tmp_path, env={"LPLUGINS_AUTO_CALLBACKS": "1"}, args=[str(site)], name="launch.py", timeout=180
    ).check()
    assert "LearningRateMonitor" in out.stdout, out.stdout + out.stderr
    fit = next(line for line in out.stdout.splitlines() if line.startswith("FIT"))
    assert "DurableCheckpoint" in fit or "durable_checkpoint" in fit, fit


HYDRA_TRAIN = """
import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    trainer = hydra.utils.instantiate(cfg.trainer)
    print("STRATEGY", type(trainer.strategy).__module__)


if __name__ == "__main__":
    main()
"""

HYDRA_CONFIG = """
trainer:
  _target_: {package}.Trainer
  accelerator: cpu
  devices: 1
  logger: false
  max_steps: 1
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


@pytest.mark.parametrize(
    ("package", "module"),
    [
        ("lightning.pytorch", "lplugins.strategies.deepspeed"),
        ("pytorch_lightning", "lplugins._pl.strategies.deepspeed"),
    ],
)
def test_an_unchanged_hydra_project_takes_a_strategy_name_override(tmp_path: Path, package: str, module: str) -> None:
    pytest.importorskip("hydra")
    pytest.importorskip(package)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "train.yaml").write_text(HYDRA_CONFIG.format(package=package))
    (tmp_path / "train.py").write_text(HYDRA_TRAIN)
    args = [str(_site(tmp_path)), "+trainer.strategy=deepspeed_stage_2_cpu"]
    out = run_script(HYDRA_LAUNCHER, tmp_path, env={"LPLUGINS_AUTO_NAMES": "1", "HYDRA_FULL_ERROR": "1"}, args=args,
                     name="launch.py", timeout=180)  # fmt: skip
    assert f"STRATEGY {module}" in out.stdout, out.stdout + out.stderr
