"""Every parameter of a named component is checked against its factory's signature, in compose/attach/CLI."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy

import lplugins
from lplugins import CompositionError, PluginManager
from lplugins._errors import ParameterError
from lplugins._plugins.params import accepted

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def _registering(kind: str, name: str, factory: Any, **kw: Any) -> types.SimpleNamespace:
    def hook(register: Any) -> None:
        register(name, factory, description=f"test {name}", **kw)

    return types.SimpleNamespace(**{f"lplugins_register_{kind}": hook})


def test_misspelled_callback_parameter_is_named_with_the_close_one(lplugins_manager: PluginManager) -> None:
    with pytest.raises(ParameterError) as info:
        lplugins.compose(callbacks=[{"name": "durable_checkpoint", "every_n_step": 10}])
    message = str(info.value)
    assert "DurableCheckpoint has no parameter 'every_n_step'. Did you mean 'every_n_steps'? Parameters: " in message
    assert "keep_last" in message  # the list of what is allowed
    assert isinstance(info.value, CompositionError) and isinstance(info.value, TypeError)


def test_missing_required_schedule_parameters_are_named(lplugins_manager: PluginManager) -> None:
    with pytest.raises(ParameterError, match=r"RampSchedule is missing required parameter\(s\) 'target', 'over'"):
        lplugins.compose(accumulate_grad_batches={"name": "ramp", "start": 4})


def test_strategy_kwargs_are_followed_to_torch_ddp(lplugins_manager: PluginManager) -> None:
    # ddp_timeout(**kwargs) -> lplugins DDPStrategy(**kwargs) -> Lightning DDPStrategy(**kwargs) -> torch DDP
    with pytest.raises(ParameterError) as info:
        lplugins.compose(strategy={"name": "ddp_timeout", "find_unused_params": True}, accelerator="cpu")
    message = str(info.value)
    assert "has no parameter 'find_unused_params'. Did you mean 'find_unused_parameters'?" in message
    assert "passed on to DistributedDataParallel: " in message
    strategy = lplugins.compose(strategy={"name": "ddp_timeout", "find_unused_parameters": True})["strategy"]
    assert isinstance(strategy, DDPStrategy)


def test_deepspeed_strategy_parameter(lplugins_manager: PluginManager) -> None:
    with pytest.raises(ParameterError, match=r"DeepSpeedStrategy has no parameter 'stages'. Did you mean 'stage'\?"):
        lplugins.compose(strategy={"name": "deepspeed_stage_2_cpu", "stages": 3}, accelerator="cpu")


def test_lightning_callbacks_by_name_are_checked_too(lplugins_manager: PluginManager) -> None:
    with pytest.raises(ParameterError, match=r"ModelCheckpoint has no parameter 'dirpat'. Did you mean 'dirpath'\?"):
        lplugins.compose(callbacks=[{"name": "model_checkpoint", "dirpat": "x"}])


def test_attach_checks_parameters(lplugins_manager: PluginManager) -> None:
    trainer = Trainer(**QUIET, enable_checkpointing=False)
    with pytest.raises(ParameterError, match="Did you mean 'every_n_steps'"):
        lplugins.attach(trainer, {"name": "durable_checkpoint", "every_n_step": 1})


def test_a_wrong_registered_default_names_the_plugin(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    lplugins_register(
        _registering("strategies", "bad_defaults", DDPStrategy, defaults={"process_group_backed": "gloo"}), "acme"
    )
    with pytest.raises(ParameterError, match=r"'process_group_backed' \(a default registered by plugin 'acme'\)"):
        lplugins.compose(strategy="bad_defaults")


def test_a_third_party_lazy_factory_is_followed_through_its_source(
    lplugins_manager: PluginManager, lplugins_register: Any
) -> None:
    lplugins_register(_registering("strategies", "lazy_ddp", _lazy_ddp), "p")
    with pytest.raises(ParameterError, match=r"'process_group_backed'. Did you mean 'process_group_backend'\?"):
        lplugins.compose(strategy={"name": "lazy_ddp", "process_group_backed": "gloo"})
    composed = lplugins.compose(strategy={"name": "lazy_ddp", "process_group_backend": "gloo"})
    assert isinstance(composed["strategy"], DDPStrategy)


def _lazy_ddp(**kwargs: Any) -> Any:
    """The documented lazy-factory pattern: the class imported inside, the keyword arguments handed on."""
    from lightning.pytorch.strategies import DDPStrategy as Strategy

    return Strategy(**kwargs)


def test_declared_forwarding_is_followed(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    def env(**kwargs: Any) -> Any:
        return _environment_class()(**kwargs)

    assert accepted(env).open  # the class is picked at run time: nothing to read from the source
    env.lplugins_forwards_to = "lightning.fabric.plugins.environments:LightningEnvironment"  # type: ignore[attr-defined]
    assert not accepted(env).open


def _environment_class() -> type:
    return LightningEnvironment


def test_an_open_factory_still_gets_what_it_is_given(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    seen: dict[str, Any] = {}

    def opaque(**kwargs: Any) -> DDPStrategy:  # where kwargs go is not knowable: nothing is refused
        seen.update(kwargs)
        return DDPStrategy()

    lplugins_register(_registering("strategies", "opaque_ddp", opaque), "p")
    lplugins.compose(strategy={"name": "opaque_ddp", "anything": 1})
    assert seen == {"anything": 1}


def test_cluster_environment_parameters_in_plugins(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    def lightning_env(main_port: int = 0) -> LightningEnvironment:
        return LightningEnvironment()

    lplugins_register(_registering("cluster_environments", "acme_env", lightning_env), "p")
    with pytest.raises(ParameterError, match=r"lightning_env has no parameter 'main_prot'. Did you mean 'main_port'\?"):
        lplugins.compose(plugins=[{"name": "acme_env", "main_prot": 1}])
    [env] = lplugins.compose(plugins=[{"name": "acme_env", "main_port": 1}])["plugins"]
    assert isinstance(env, LightningEnvironment)


def test_registered_precision_parameters(lplugins_manager: PluginManager) -> None:
    with pytest.raises(ParameterError, match=r"has no parameter 'backnd'. Did you mean 'backend'\?"):
        lplugins.compose(accelerator="cpu", precision={"name": "fp8", "backnd": "torchao"})


def test_lightning_strategy_names_take_checked_parameters(lplugins_manager: PluginManager) -> None:
    with pytest.raises(ParameterError, match=r"strategy 'ddp': DDPStrategy has no parameter 'find_unused_params'"):
        lplugins.compose(strategy={"name": "ddp", "find_unused_params": True})
    strategy = lplugins.compose(strategy={"name": "ddp", "process_group_backend": "gloo"})["strategy"]
    assert isinstance(strategy, DDPStrategy) and strategy.process_group_backend == "gloo"
    with pytest.raises(lplugins.UnknownNameError, match="Did you mean 'ddp'"):
        lplugins.compose(strategy={"name": "dpp"})


class KeepsOptions:
    """A component that keeps free-form options: nothing can be refused."""

    def __init__(self, size: int = 1, **options: Any) -> None:
        self.size, self.options = size, options


class Cooperative(KeepsOptions):
    def __init__(self, extra: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)


def test_kwargs_kept_by_a_class_are_let_through_but_handed_up_are_followed() -> None:
    assert accepted(KeepsOptions).open
    assert accepted(Cooperative).open  # handed up to a class that keeps them
    from lplugins.strategies.ddp import DDPStrategy as LpluginsDDP

    followed = accepted(LpluginsDDP)  # super().__init__(**kwargs) up to Lightning's, then torch's DDP
    assert not followed.open and {"timeout", "process_group_backend", "find_unused_parameters"} <= followed.names
