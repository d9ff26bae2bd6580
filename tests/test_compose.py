"""compose() and attach(): names into objects for a stock Trainer."""

from __future__ import annotations

import logging
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.precision import DoublePrecision
from lightning.pytorch.strategies import DDPStrategy

import lplugins
from lplugins import CompositionError, PluginError, PluginManager, UnknownNameError
from lplugins.precision import default_precision

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


class Counter(Callback):
    """A stateful callback: counts batches."""

    def __init__(self, tag: str = "a") -> None:
        self.tag = tag
        self.count = 0
        self.loaded: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(tag=self.tag)

    def on_train_batch_end(self, *args: Any) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = dict(state_dict)
        self.count = state_dict["count"]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def _registering(kind: str, name: str, factory: Any, **meta: Any) -> types.SimpleNamespace:
    def hook(register: Any) -> None:
        register(name, factory, description=f"test {name}", **meta)

    return types.SimpleNamespace(**{f"lplugins_register_{kind}": hook})


def test_lightning_names_pass_through(lplugins_manager: PluginManager) -> None:
    kwargs = lplugins.compose(strategy="ddp", precision="bf16-mixed", accelerator="cpu", max_epochs=3)
    assert kwargs == {"strategy": "ddp", "precision": "bf16-mixed", "accelerator": "cpu", "max_epochs": 3}


def test_registered_strategy_name_becomes_an_instance(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    lplugins_register(_registering("strategies", "gloo_ddp", DDPStrategy), "p")
    lplugins_manager.registry("strategy").get("gloo_ddp")
    kwargs = lplugins.compose(strategy="gloo_ddp")
    assert isinstance(kwargs["strategy"], DDPStrategy)


def test_strategy_with_params_and_trainer_kwargs(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    seen: dict[str, Any] = {}

    def factory(trainer_kwargs: Any, backend: str = "nccl") -> DDPStrategy:
        seen.update(trainer_kwargs)
        return DDPStrategy(process_group_backend=backend)

    lplugins_register(_registering("strategies", "ctx_ddp", factory), "p")
    kwargs = lplugins.compose(strategy={"name": "ctx_ddp", "backend": "gloo"}, devices=2, accelerator="cpu")
    assert kwargs["strategy"].process_group_backend == "gloo"
    assert seen["devices"] == 2


def test_unknown_strategy_lists_names_and_closest(lplugins_manager: PluginManager) -> None:
    with pytest.raises(UnknownNameError, match=r"Unknown strategy 'dpp'.*ddp_spawn.*Did you mean 'ddp'") as info:
        lplugins.compose(strategy="dpp")
    assert "auto" in info.value.available


def test_unknown_trainer_argument(lplugins_manager: PluginManager) -> None:
    with pytest.raises(CompositionError, match=r"Unknown Trainer argument 'max_epoch'. Did you mean 'max_epochs'"):
        lplugins.compose(max_epoch=3)


def test_auto_precision_on_cpu_logs_why(lplugins_manager: PluginManager, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lplugins"):
        kwargs = lplugins.compose(accelerator="cpu", precision="auto")
    assert kwargs["precision"] == "32-true"
    assert [r.getMessage() for r in caplog.records if "auto" in r.getMessage()] == [
        "lplugins: precision='auto' chose '32-true' (CPU: full precision is fastest and exact unless CPU bf16 "
        "is opted into (cpu_bf16=True))"
    ]
    assert lplugins.compose(accelerator="cpu", precision="auto", cpu_bf16=True)["precision"] == "bf16-mixed"


@pytest.mark.parametrize(
    ("accelerator", "caps", "expected"),
    [
        ("cuda", {"cuda_capability": (9, 0), "bf16_supported": True}, "bf16-mixed"),  # H100 / H200
        ("cuda", {"cuda_capability": (8, 0), "bf16_supported": True}, "bf16-mixed"),  # A100
        ("cuda", {"cuda_capability": (7, 0), "bf16_supported": False}, "16-mixed"),  # V100
        ("cpu", {}, "32-true"),
        ("cpu", {"cpu_bf16": True}, "bf16-mixed"),
        ("xla", {}, "32-true"),
    ],
)
def test_auto_precision_decision_table(accelerator: str, caps: dict[str, Any], expected: str) -> None:
    assert default_precision(accelerator, caps)[0] == expected


def test_plugin_can_choose_the_auto_precision(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    def lplugins_choose_precision(accelerator: str, capabilities: Any) -> str | None:
        return "64-true" if accelerator == "cpu" else None

    lplugins_register(types.SimpleNamespace(lplugins_choose_precision=lplugins_choose_precision), "chooser")
    assert lplugins.compose(accelerator="cpu", precision="auto")["precision"] == "64-true"


class DtypeProbe(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        self.seen.append(out.dtype)
        return out


def test_bf16_mixed_by_name_runs_under_autocast_on_cpu(lplugins_manager: PluginManager) -> None:
    model = DtypeProbe()
    trainer = Trainer(**lplugins.compose(accelerator="cpu", precision="bf16-mixed", max_steps=2, **QUIET))
    trainer.fit(model)
    assert model.seen and set(model.seen) == {torch.bfloat16}


def test_registered_precision_becomes_a_plugin(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    lplugins_register(_registering("precisions", "dbl", DoublePrecision, accelerators=("cpu",)), "p")
    kwargs = lplugins.compose(accelerator="cpu", precision="dbl", max_steps=1, **QUIET)
    assert "precision" not in kwargs and isinstance(kwargs["plugins"][0], DoublePrecision)
    model = DtypeProbe()
    Trainer(**kwargs).fit(model)
    assert set(model.seen) == {torch.float64}


def test_precision_factory_gets_the_injected_arguments(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    seen: dict[str, Any] = {}

    def factory(accelerator: str, strategy: str) -> DoublePrecision:
        seen.update(accelerator=accelerator, strategy=strategy)
        return DoublePrecision()

    lplugins_register(_registering("precisions", "probe", factory), "p")
    lplugins.compose(accelerator="cpu", strategy="ddp", precision="probe")
    assert seen == {"accelerator": "cpu", "strategy": "ddp"}


def test_incompatible_precision_and_accelerator(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    lplugins_register(_registering("precisions", "gpu-only", DoublePrecision, accelerators=("cuda",)), "p")
    with pytest.raises(CompositionError, match="'gpu-only' does not support accelerator 'cpu'; it supports: cuda"):
        lplugins.compose(accelerator="cpu", precision="gpu-only")


def test_incompatible_precision_and_strategy(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    lplugins_register(_registering("precisions", "ddp-only", DoublePrecision, strategies=("ddp",)), "p")
    with pytest.raises(CompositionError, match="'ddp-only' cannot be used with strategy 'fsdp'; it works with: ddp"):
        lplugins.compose(strategy="fsdp", precision="ddp-only")
    assert isinstance(lplugins.compose(strategy="ddp", precision="ddp-only")["plugins"][0], DoublePrecision)


def test_unknown_precision(lplugins_manager: PluginManager) -> None:
    with pytest.raises(UnknownNameError, match=r"Unknown precision 'bf16-mixd'.*Did you mean 'bf16-mixed'"):
        lplugins.compose(precision="bf16-mixd")


def test_callbacks_by_name_and_contributed(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    def lplugins_trainer_callbacks(trainer_kwargs: Any) -> list[Callback]:
        assert trainer_kwargs["max_steps"] == 5
        return [Counter("contributed")]

    lplugins_register(types.SimpleNamespace(lplugins_trainer_callbacks=lplugins_trainer_callbacks), "contrib")
    kwargs = lplugins.compose(callbacks=["lr_monitor", {"name": "model_checkpoint", "save_top_k": 0}], max_steps=5)
    types_ = [type(cb) for cb in kwargs["callbacks"]]
    assert types_ == [LearningRateMonitor, ModelCheckpoint, Counter]
    assert kwargs["callbacks"][1].save_top_k == 0


def test_contributing_plugin_that_raises_is_named(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    def lplugins_trainer_callbacks(trainer_kwargs: Any) -> None:
        raise KeyError("missing config")

    lplugins_register(
        types.SimpleNamespace(lplugins_trainer_callbacks=lplugins_trainer_callbacks),
        "flaky",
        distribution="flaky-dist",
        version="0.3",
    )
    with pytest.raises(PluginError, match=r'plugin "flaky" \(flaky-dist 0.3\).*KeyError') as info:
        lplugins.compose()
    assert isinstance(info.value.__cause__, KeyError)
    lplugins_manager.strict = False
    with pytest.warns(lplugins.PluginWarning, match='plugin "flaky"'):
        assert "callbacks" not in lplugins.compose()


def test_contributed_non_callback_is_rejected(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    lplugins_register(types.SimpleNamespace(lplugins_trainer_callbacks=lambda trainer_kwargs: ["nope"]), "weird")
    with pytest.raises(PluginError, match=r"returned 'nope', which is not a lightning.pytorch.Callback"):
        lplugins.compose()


def test_duplicate_stateful_callbacks_are_refused(lplugins_manager: PluginManager) -> None:
    with pytest.raises(CompositionError, match=r"share the state key .*Counter\{'tag': 'a'\}"):
        lplugins.compose(callbacks=[Counter(), Counter()])
    assert len(lplugins.compose(callbacks=[Counter("a"), Counter("b")])["callbacks"]) == 2


def test_cluster_environment_by_name_and_detection(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    lplugins_register(_registering("cluster_environments", "testenv", LightningEnvironment), "envs")
    assert isinstance(lplugins.compose(plugins=["testenv"])["plugins"][0], LightningEnvironment)
    assert "plugins" not in lplugins.compose()
    lplugins_register(_registering("cluster_environments", "detected", LightningEnvironment, detect=lambda: True), "d")
    assert isinstance(lplugins.compose()["plugins"][0], LightningEnvironment)


def test_attach_orders_refuses_duplicates_and_checks_state(lplugins_manager: PluginManager, tmp_path: Path) -> None:
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    counter = Counter()
    mc = {"name": "model_checkpoint", "dirpath": str(tmp_path / "mc"), "every_n_epochs": 2}
    attached = lplugins.attach(trainer, mc, counter)
    assert attached[1] is counter and isinstance(attached[0], ModelCheckpoint)
    assert trainer.callbacks.index(counter) < trainer.callbacks.index(attached[0])  # checkpoint callbacks stay last
    assert isinstance(trainer.callbacks[-1], ModelCheckpoint)
    with pytest.raises(CompositionError, match="share the state key"):
        lplugins.attach(trainer, Counter())
    trainer.fit(BoringModel())
    assert counter.count == 3
    ckpt = tmp_path / "attached.ckpt"
    trainer.save_checkpoint(ckpt)

    resumed = Trainer(
        default_root_dir=tmp_path,
        max_steps=5,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    counter2 = Counter()
    lplugins.attach(resumed, counter2)
    resumed.fit(BoringModel(), ckpt_path=ckpt)
    assert counter2.loaded == {"count": 3}  # the attached callback's state came back from the checkpoint
    assert counter2.count == 5


def test_attach_refuses_while_running(lplugins_manager: PluginManager) -> None:
    class AttachDuringFit(LightningModule):
        pass

    trainer = Trainer(max_steps=1, accelerator="cpu", **QUIET, enable_checkpointing=False)
    errors: list[Exception] = []

    class TryAttach(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            try:
                lplugins.attach(trainer, Counter())
            except CompositionError as exc:
                errors.append(exc)

    trainer.callbacks.append(TryAttach())
    trainer.fit(BoringModel())
    assert len(errors) == 1 and "before trainer.fit()" in str(errors[0])
    assert not any(isinstance(cb, Counter) for cb in trainer.callbacks)  # the refused callback was not added
    assert trainer.state.finished  # and the fit it was refused in ran to its end


def test_int_accumulation_with_a_scheduler_callback_is_refused(lplugins_manager: PluginManager) -> None:
    from lplugins.accumulation import AccumulationScheduler, EpochSchedule

    with pytest.raises(CompositionError, match="accumulate_grad_batches=4 and an AccumulationScheduler"):
        lplugins.compose(accumulate_grad_batches=4, callbacks=[AccumulationScheduler(EpochSchedule({0: 2}))])


def test_old_precision_spellings_are_checked_like_the_new_ones(lplugins_manager: PluginManager) -> None:
    assert lplugins.compose(strategy="fsdp", accelerator="cuda", precision="bf16")["precision"] == "bf16"
    with pytest.raises(CompositionError, match="'64' cannot be used with strategy 'fsdp'"):
        lplugins.compose(strategy="fsdp", accelerator="cuda", precision="64")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_auto_precision_for_a_gpu_that_is_not_there(lplugins_manager: PluginManager) -> None:
    with pytest.raises(CompositionError, match="no CUDA device is available here"):
        lplugins.compose(accelerator="gpu", precision="auto")


def test_auto_precision_is_announced_on_rank_zero_only(
    lplugins_manager: PluginManager, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")  # as torchrun sets it on the second process
    with caplog.at_level(logging.INFO, logger="lplugins"):
        assert lplugins.compose(accelerator="cpu", precision="auto")["precision"] == "32-true"
    assert not [r for r in caplog.records if "auto" in r.getMessage()]


def test_attach_checkpoint_replaces_lightnings_default_model_checkpoint(
    lplugins_manager: PluginManager, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer(**QUIET, max_steps=2)  # enable_checkpointing=True: Lightning adds a ModelCheckpoint()
    default = trainer.checkpoint_callback
    assert isinstance(default, ModelCheckpoint)
    with caplog.at_level(logging.INFO, logger="lplugins"):
        [durable] = lplugins.attach(trainer, {"name": "durable_checkpoint", "dirpath": str(tmp_path / "c")})
    assert default not in trainer.callbacks and trainer.checkpoint_callbacks == [durable]
    [line] = [r.getMessage() for r in caplog.records if "default ModelCheckpoint" in r.getMessage()]
    assert "attach() removed Lightning's default ModelCheckpoint" in line and "DurableCheckpoint writes" in line
    trainer.fit(BoringModel())
    written = list(tmp_path.rglob("*.ckpt"))
    assert written and all(p.parent == tmp_path / "c" for p in written)  # one system writes, in one place


def test_attach_keeps_a_configured_model_checkpoint(lplugins_manager: PluginManager, tmp_path: Path) -> None:
    configured = ModelCheckpoint(dirpath=tmp_path / "mine", save_top_k=2, monitor="train_loss")
    trainer = Trainer(**QUIET, callbacks=[configured])
    lplugins.attach(trainer, {"name": "durable_checkpoint", "dirpath": str(tmp_path / "c")})
    assert configured in trainer.callbacks and len(trainer.checkpoint_callbacks) == 2
    # a default one that has already been used (state changed) is not "untouched" either
    used = Trainer(**QUIET, max_steps=1)
    used.fit(BoringModel())
    lplugins.attach(used, LearningRateMonitor())  # not a checkpoint callback: nothing removed
    assert isinstance(used.checkpoint_callback, ModelCheckpoint)
