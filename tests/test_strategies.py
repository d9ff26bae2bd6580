"""The built-in ``strategies`` plugin: names, lazy imports, the process-group timeout."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch  # noqa: F401  (imported first: it sets environment variables on import)
import pytest

import lplugins
from lplugins import UnknownNameError
from lplugins._builtins.strategies import DEEPSPEED_STRATEGIES
from lplugins.strategies.timeout import DEFAULT_PG_TIMEOUT, ENV_VAR, resolve_timeout
from tests._dist import run_script, run_together

BUILTIN_STRATEGIES = {*DEEPSPEED_STRATEGIES, "fsdp2", "ddp_timeout", "advised", "ft_ddp", "ft_hsdp"}

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")


def test_builtin_names_are_registered_and_mirrored(lplugins_manager: lplugins.PluginManager) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    registry = lplugins_manager.registry("strategy")
    assert BUILTIN_STRATEGIES <= set(registry)
    for name in BUILTIN_STRATEGIES:
        component = registry.get(name)
        assert component.plugin == "strategies"
        assert component.description
        assert name in StrategyRegistry
    assert set(lplugins_manager.plugin("strategies").registered["strategy"]) == BUILTIN_STRATEGIES
    assert registry.get("deepspeed_stage_3_offload_cpu").defaults == {
        "stage": 3,
        "offload_optimizer": True,
        "offload_parameters": True,
    }


def test_builtin_names_do_not_collide_with_lightning(lplugins_manager: lplugins.PluginManager) -> None:
    # lplugins refuses a name Lightning already owns; the built-ins must not need one
    from lightning.pytorch.strategies import StrategyRegistry

    from lplugins._plugins.manager import _MIRRORED_BY_LPLUGINS

    lplugins_manager.close()
    # names another lplugins manager of this process (e.g. the default one) mirrored are not Lightning's own
    lightning_names = set(StrategyRegistry.available_strategies()) - set(_MIRRORED_BY_LPLUGINS)
    assert not BUILTIN_STRATEGIES & lightning_names
    for name, (stage, offload, _, _) in DEEPSPEED_STRATEGIES.items():
        # every name is Lightning's name for the same setup, plus "_cpu"
        assert name.endswith("_cpu")
        assert name.removesuffix("_cpu") in lightning_names
        assert f"stage_{stage}" in name
        assert ("offload" in name) == offload


def test_unknown_strategy_name_is_refused_with_a_suggestion(lplugins_manager: lplugins.PluginManager) -> None:
    with pytest.raises(UnknownNameError, match=r"'deepspeed_stage_2_cpux'.*Did you mean 'deepspeed_stage_2_cpu'"):
        lplugins.compose(strategy="deepspeed_stage_2_cpux")


@needs_deepspeed
def test_plain_trainer_gets_the_strategy_by_name(lplugins_manager: lplugins.PluginManager) -> None:
    from lightning.pytorch import Trainer

    from lplugins.strategies.deepspeed import DeepSpeedStrategy

    trainer = Trainer(strategy="deepspeed_stage_2_cpu", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is DeepSpeedStrategy
    assert trainer.strategy.config["zero_optimization"]["stage"] == 2


@needs_deepspeed
def test_set_gradient_accumulation_steps_errors_are_lplugins_errors() -> None:
    from lplugins.strategies import DeepSpeedConfigError
    from lplugins.strategies.deepspeed import DeepSpeedEngineNotReady, DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=2)
    with pytest.raises(DeepSpeedConfigError, match="steps=0 is not allowed") as bad:
        strategy.set_gradient_accumulation_steps(0)
    assert isinstance(bad.value, ValueError) and isinstance(bad.value, lplugins.LPluginsError)
    with pytest.raises(DeepSpeedEngineNotReady, match="not set up yet") as early:
        strategy.set_gradient_accumulation_steps(2)
    assert isinstance(early.value, RuntimeError) and isinstance(early.value, lplugins.LPluginsError)


LAZY_SCRIPT = r"""
import json, sys
import lplugins
manager = lplugins.load(autoload=False)
out = {"after_load": "deepspeed" in sys.modules}
lplugins.compose(strategy="ddp_timeout", accelerator="cpu")
out["after_ddp"] = "deepspeed" in sys.modules
strategy = lplugins.compose(strategy="deepspeed_stage_2_cpu", accelerator="cpu")["strategy"]
out["after_deepspeed"] = "deepspeed" in sys.modules
out["class"] = type(strategy).__module__
print(json.dumps(out))
"""


@needs_deepspeed
def test_deepspeed_is_imported_only_when_selected(tmp_path: Path) -> None:
    result = run_script(LAZY_SCRIPT, tmp_path, timeout=120).check()
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {
        "after_load": False,
        "after_ddp": False,
        "after_deepspeed": True,
        "class": "lplugins.strategies.deepspeed",
    }


# ---------------------------------------------------------------------- timeout
def test_timeout_default_argument_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_timeout() == DEFAULT_PG_TIMEOUT == timedelta(minutes=30)
    assert resolve_timeout(90) == timedelta(seconds=90)
    assert resolve_timeout(timedelta(hours=2)) == timedelta(hours=2)
    monkeypatch.setenv(ENV_VAR, "3600")
    assert resolve_timeout() == timedelta(hours=1)
    assert resolve_timeout(60) == timedelta(minutes=1)  # the argument wins over the variable


@pytest.mark.parametrize("value", ["soon", "0", "-5", "inf", "nan"])
def test_timeout_env_invalid(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(lplugins.LPluginsError, match=ENV_VAR):
        resolve_timeout()


@pytest.mark.parametrize("value", [0, -1.0, True, "60"])
def test_timeout_argument_invalid(value: object) -> None:
    with pytest.raises(lplugins.LPluginsError, match="timeout="):
        resolve_timeout(value)  # type: ignore[arg-type]


def test_nccl_timeout_is_called_out() -> None:
    # the seed guide's "export NCCL_TIMEOUT=3600" is read by neither NCCL nor PyTorch
    with pytest.MonkeyPatch.context() as mp:  # undone before the leak check runs
        mp.delenv(ENV_VAR, raising=False)
        mp.setenv("NCCL_TIMEOUT", "3600")
        with pytest.warns(UserWarning, match="NCCL_TIMEOUT is set, but neither NCCL nor PyTorch reads it"):
            assert resolve_timeout() == DEFAULT_PG_TIMEOUT
        mp.setenv(ENV_VAR, "3600")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert resolve_timeout() == timedelta(hours=1)


@pytest.mark.parametrize("name", sorted(set(DEEPSPEED_STRATEGIES) | {"ddp_timeout"}))
def test_every_builtin_distributed_strategy_honours_the_timeout(
    lplugins_manager: lplugins.PluginManager, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    if name.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed extra")
    monkeypatch.setenv(ENV_VAR, "123")
    strategy = lplugins.compose(strategy=name, accelerator="cpu")["strategy"]
    assert strategy._timeout == timedelta(seconds=123)
    strategy = lplugins.compose(strategy={"name": name, "timeout": 7}, accelerator="cpu")["strategy"]
    assert strategy._timeout == timedelta(seconds=7)


def test_ddp_timeout_reaches_the_process_group(tmp_path: Path) -> None:
    # a real 2-process gloo job: the process group's timeout is the one from LPLUGINS_PG_TIMEOUT
    script = r"""
import json, torch, lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
import lplugins

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def on_train_start(self):
        import torch.distributed as dist
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        self.seen = {"backend": dist.get_backend(), "timeout_s": backend.options._timeout.total_seconds(),
                     "strategy_timeout_s": self.trainer.strategy._timeout.total_seconds()}

kw = lplugins.compose(strategy="ddp_timeout", accelerator="cpu", devices=2, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer = pl.Trainer(**kw)
model = M()
trainer.fit(model, DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2))
with open(f"seen{trainer.global_rank}.json", "w") as f:
    json.dump(model.seen, f)
trainer.strategy.barrier()  # rank 0 must not exit (and end the job) before rank 1 has written
"""
    run_together(script, tmp_path, timeout=120, env={ENV_VAR: "77"}).check()
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    for item in seen:
        assert item["backend"] == "gloo"
        assert item["strategy_timeout_s"] == 77
        assert item["timeout_s"] == 77


@needs_deepspeed
def test_docs_examples_run(lplugins_manager: lplugins.PluginManager, capsys: pytest.CaptureFixture[str]) -> None:
    """Every ```python block of docs/strategies.md runs, in order, in one namespace.

    (Blocks fenced as ```py need several processes or a plugin package and are shown, not run.)
    """
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "strategies.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    assert len(blocks) >= 5
    namespace: dict[str, object] = {"__name__": "docs_strategies"}
    for block in blocks:
        exec(compile(block, "docs/strategies.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "Did you mean 'zero_optimization'?" in out
    assert "enables 'bf16'" in out
    assert "Recommended: DeepSpeed ZeRO-2 -> strategy='deepspeed_stage_2_cpu'" in out
    assert "DeepSpeedStrategy zero2" in out
    # the printed outputs shown on the page are the real ones
    for line in ("DDP                             4+4+8=16", "DeepSpeed ZeRO-2                2+2+12=16"):
        assert line in out and line in text


@needs_deepspeed
def test_lightning_cli_accepts_the_deepspeed_name(lplugins_manager: lplugins.PluginManager, tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lplugins.strategies.deepspeed import DeepSpeedStrategy

    cli = LightningCLI(
        BoringModel,
        run=False,
        args=[
            "--trainer.strategy=deepspeed_stage_3_cpu",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=false",
        ],
    )
    assert type(cli.trainer.strategy) is DeepSpeedStrategy
    assert cli.trainer.strategy.zero_stage_3


# ---------------------------------------------------------------------- cluster environments
def test_variables_environment() -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone before the leak check
        from lplugins.strategies.environments import VariablesEnvironment

        env = VariablesEnvironment(main_address="ACME_HEAD", main_port="ACME_PORT", node_rank="ACME_NODE")
        with pytest.raises(lplugins.LPluginsError, match=r"needs the environment variable ACME_HEAD \(main_address\)"):
            _ = env.main_address
        monkeypatch.setenv("ACME_HEAD", "10.0.0.1")
        monkeypatch.setenv("ACME_PORT", "port")
        monkeypatch.setenv("ACME_NODE", "3")
        assert env.main_address == "10.0.0.1"
        with pytest.raises(lplugins.LPluginsError, match=r"ACME_PORT='port' \(main_port\) is not an integer"):
            _ = env.main_port
        monkeypatch.setenv("ACME_PORT", "29500")
        assert env.main_port == 29500 and env.node_rank() == 3
        assert not env.creates_processes_externally and not VariablesEnvironment.detect()
        env.set_world_size(8)
        env.set_global_rank(6)
        assert (env.world_size(), env.global_rank(), env.local_rank()) == (8, 6, 0)
        full = VariablesEnvironment(
            main_address="ACME_HEAD",
            main_port="ACME_PORT",
            node_rank="ACME_NODE",
            world_size="ACME_WORLD",
            global_rank="ACME_RANK",
            local_rank="ACME_LOCAL",
            creates_processes_externally=True,
        )
        monkeypatch.setenv("ACME_WORLD", "16")
        monkeypatch.setenv("ACME_RANK", "13")
        monkeypatch.setenv("ACME_LOCAL", "1")
        full.set_world_size(2)  # the variables win over what the strategy computes
        assert (full.world_size(), full.global_rank(), full.local_rank()) == (16, 13, 1)


def test_registered_environment_resolves_by_name_and_detect(
    lplugins_manager: lplugins.PluginManager, lplugins_register: Any
) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone before the leak check
        from lplugins.strategies.environments import VariablesEnvironment

        class AcmePlugin:
            @staticmethod
            @lplugins.hookimpl
            def lplugins_register_cluster_environments(register: Any) -> None:
                register(
                    "acme",
                    VariablesEnvironment,
                    defaults={"main_address": "ACME_HEAD", "main_port": "ACME_PORT", "node_rank": "ACME_NODE"},
                    detect=lambda: "ACME_NODE" in os.environ,
                )

        lplugins_register(AcmePlugin, "acme-plugin")
        by_name = lplugins.compose(plugins=["acme"], accelerator="cpu")["plugins"]
        assert [type(p) for p in by_name] == [VariablesEnvironment]
        assert "plugins" not in lplugins.compose(accelerator="cpu")  # not detected: the variable is not set
        monkeypatch.setenv("ACME_NODE", "0")
        detected = lplugins.compose(accelerator="cpu")["plugins"]
        assert [type(p) for p in detected] == [VariablesEnvironment]
