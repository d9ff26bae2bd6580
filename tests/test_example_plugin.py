"""The example plugin package, really installed: discovery, CLI listing, 2-process DDP by name,
LightningCLI, zero-code mode."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lplugins
from lplugins import PluginManager
from tests._dist import run_script


def _env(site: Path, **extra: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), **extra}


def test_installed_plugin_is_discovered_from_its_real_entry_point(acme_on_path: Path) -> None:
    manager = PluginManager().load(disable=[])
    try:
        info = manager.plugin("acme")
        assert (info.distribution, info.version, info.builtin) == ("acme-lplugins", "1.2.0", False)
        assert info.entry_point == "acme = acme_lplugins.plugin"
        assert info.registered == {"strategy": ["acme_ddp"], "precision": ["acme-double"], "callback": ["acme_audit"]}
        assert info.contributes_callbacks
        assert StrategyRegistry["acme_ddp"]["description"] == "DDP over gloo with acme's defaults"
        assert isinstance(StrategyRegistry.get("acme_ddp"), DDPStrategy)
    finally:
        manager.close()
    assert "acme_ddp" not in StrategyRegistry


def test_lightning_cli_accepts_a_plugin_strategy_name(acme_on_path: Path, tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    manager = PluginManager().load(disable=[])
    try:
        cli = LightningCLI(
            BoringModel,
            run=False,
            args=[
                "--trainer.strategy=acme_ddp",
                "--trainer.accelerator=cpu",
                "--trainer.devices=1",
                f"--trainer.default_root_dir={tmp_path}",
                "--trainer.logger=false",
            ],
        )
        assert isinstance(cli.trainer.strategy, DDPStrategy)
        assert cli.trainer.strategy.process_group_backend == "gloo"
    finally:
        manager.close()


def test_cli_list_json_shows_the_plugin(acme_site: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lplugins", "list", "--json"],
        env={**os.environ, **_env(acme_site)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    plugins = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert plugins["acme"]["distribution"] == "acme-lplugins" and plugins["acme"]["version"] == "1.2.0"
    assert plugins["acme"]["registered"]["strategy"] == ["acme_ddp"]
    assert plugins["core"]["builtin"] is True


def test_cli_list_shows_blocked_and_failed(acme_site: Path, tmp_path: Path) -> None:
    env = {**os.environ, **_env(acme_site), "LPLUGINS_DISABLE": "acme"}
    text = subprocess.run(
        [sys.executable, "-m", "lplugins", "list"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "acme  [blocked]  external, acme-lplugins 1.2.0" in text
    # a broken installed plugin: strict exits 2 with the named error, --lenient lists it as failed
    broken = tmp_path / "site"
    dist = broken / "broken_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[lplugins]\nbroken = broken_plugin_missing.plugin\n")
    env = {**os.environ, **_env(broken)}
    strict = subprocess.run([sys.executable, "-m", "lplugins", "list"], env=env, capture_output=True, text=True)
    assert strict.returncode == 2
    assert 'plugin "broken" (broken-plugin 0.1, entry point "broken = broken_plugin_missing.plugin")' in strict.stderr
    lenient = subprocess.run(
        [sys.executable, "-m", "lplugins", "list", "--json", "--lenient"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    failed = [p for p in json.loads(lenient.stdout)["plugins"] if p["status"] == "failed"]
    assert [p["name"] for p in failed] == ["broken"] and "broken_plugin_missing" in failed[0]["error"]


DDP_JOB = """
import os, sys
import lplugins
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

lplugins.load()
# a plain Trainer takes the plugin's strategy by name (mirrored into Lightning's StrategyRegistry);
# compose adds the plugin's precision by name and its contributed callback
kwargs = lplugins.compose(strategy="acme_ddp", precision="acme-double", accelerator="cpu", devices=2, max_steps=4,
                          logger=False, enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=False)
trainer = Trainer(**kwargs)
trainer.fit(BoringModel())
audit = [cb for cb in trainer.callbacks if type(cb).__name__ == "AcmeAudit"]
print(f"RANK={trainer.global_rank} WORLD={trainer.world_size} STRATEGY={type(trainer.strategy).__name__} "
      f"BACKEND={trainer.strategy.process_group_backend} PRECISION={type(trainer.precision_plugin).__name__} "
      f"DTYPE={next(trainer.lightning_module.parameters()).dtype} AUDIT_STEPS={audit[0].steps}", flush=True)
"""


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_plugin_strategy_precision_and_callback_in_two_process_ddp(acme_site: Path, tmp_path: Path) -> None:
    audit = tmp_path / "audit.log"
    result = run_script(DDP_JOB, tmp_path, env=_env(acme_site, ACME_AUDIT_FILE=str(audit)), timeout=150).check()
    lines = sorted(re.findall(r"RANK=\d .*?AUDIT_STEPS=\d+", result.stdout))  # the ranks' prints may interleave
    assert lines == [
        f"RANK={r} WORLD=2 STRATEGY=DDPStrategy BACKEND=gloo PRECISION=DoublePrecision DTYPE=torch.float64 "
        "AUDIT_STEPS=4"
        for r in (0, 1)
    ]
    assert audit.read_text() == "fit ended: world_size=2 steps=4\n"  # written once, by rank 0


ZERO_CODE_JOB = """
from lightning.pytorch import Trainer
trainer = Trainer(accelerator="cpu", logger=False)
print("CALLBACKS=" + ",".join(sorted(type(cb).__name__ for cb in trainer.callbacks)))
"""


@pytest.mark.timeout(120)
def test_zero_code_mode_gives_plain_trainers_the_contributed_callbacks(acme_site: Path, tmp_path: Path) -> None:
    on = run_script(ZERO_CODE_JOB, tmp_path, env=_env(acme_site, LPLUGINS_AUTO_CALLBACKS="1")).check()
    assert "AcmeAudit" in on.stdout.split("CALLBACKS=")[1]
    off = run_script(ZERO_CODE_JOB, tmp_path, env=_env(acme_site)).check()
    assert "AcmeAudit" not in off.stdout.split("CALLBACKS=")[1]
    blocked = run_script(
        ZERO_CODE_JOB, tmp_path, env=_env(acme_site, LPLUGINS_AUTO_CALLBACKS="1", LPLUGINS_DISABLE="acme")
    ).check()
    assert "AcmeAudit" not in blocked.stdout.split("CALLBACKS=")[1]


def test_zero_code_factory_isolates_a_failing_plugin(
    lplugins_manager: PluginManager, lplugins_register: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    from lplugins._composition.factory import callbacks_factory

    def lplugins_trainer_callbacks(trainer_kwargs: Any) -> None:
        raise RuntimeError("cannot reach audit server")

    lplugins_register(
        types.SimpleNamespace(lplugins_trainer_callbacks=lplugins_trainer_callbacks),
        "audit",
        distribution="audit-dist",
        version="9",
    )
    assert callbacks_factory() == []  # off by default: costs nothing, changes nothing
    monkeypatch.setenv("LPLUGINS_AUTO_CALLBACKS", "1")
    with pytest.raises(lplugins.PluginError, match=r'plugin "audit" \(audit-dist 9\).*cannot reach audit server'):
        callbacks_factory()
    lplugins_manager.strict = False
    with pytest.warns(lplugins.PluginWarning):
        assert callbacks_factory() == []
