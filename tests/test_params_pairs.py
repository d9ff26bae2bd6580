"""Pairs that do not fit together, and precision spellings, refused by compose before training."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, DoublePrecision

import lplugins
from lplugins import CompositionError, PluginManager, UnknownNameError


def _precision(name: str, factory: Any, **kw: Any) -> types.SimpleNamespace:
    def lplugins_register_precisions(register: Any) -> None:
        register(name, factory, description=f"test {name}", **kw)

    return types.SimpleNamespace(lplugins_register_precisions=lplugins_register_precisions)


@pytest.mark.parametrize(
    ("lightning_name", "lplugins_name"),
    [
        ("deepspeed_stage_2", "deepspeed_stage_2_cpu"),
        ("deepspeed_stage_3_offload", "deepspeed_stage_3_offload_cpu"),
        ("deepspeed", "deepspeed_stage_2_cpu"),
        ("fsdp", "fsdp2"),
    ],
)
def test_lightning_gpu_strategy_on_cpu_points_to_the_lplugins_name(
    lplugins_manager: PluginManager, lightning_name: str, lplugins_name: str
) -> None:
    with pytest.raises(CompositionError) as info:
        lplugins.compose(strategy=lightning_name, accelerator="cpu", devices=2)
    message = str(info.value)
    assert f"strategy={lightning_name!r} cannot run with accelerator='cpu'" in message
    assert f"Use strategy={lplugins_name!r}" in message
    lplugins.compose(strategy=lplugins_name, accelerator="cpu", devices=2)  # what it points to composes


def test_lightning_deepspeed_on_cuda_passes(lplugins_manager: PluginManager) -> None:
    assert lplugins.compose(strategy="deepspeed_stage_2", accelerator="cuda")["strategy"] == "deepspeed_stage_2"


@pytest.mark.skipif(torch.cuda.is_available(), reason="accelerator='auto' is CPU only without a GPU")
def test_auto_accelerator_without_a_gpu_is_cpu(lplugins_manager: PluginManager) -> None:
    with pytest.raises(CompositionError, match=r"accelerator='auto' \(the default\), which is 'cpu' on this machine"):
        lplugins.compose(strategy="deepspeed_stage_2")


@pytest.mark.parametrize("precision", ["16-mixed", "16", 16])
def test_fp16_mixed_on_cpu_is_refused_with_the_reason(lplugins_manager: PluginManager, precision: Any) -> None:
    with pytest.raises(CompositionError) as info:
        lplugins.compose(accelerator="cpu", precision=precision)
    message = str(info.value)
    assert "Lightning would silently train in 'bf16-mixed'" in message
    assert "On CPU use one of: 32-true, bf16-mixed" in message


def test_fp16_mixed_on_cuda_passes(lplugins_manager: PluginManager) -> None:
    assert lplugins.compose(accelerator="cuda", precision="16-mixed")["precision"] == "16-mixed"


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("fp16", "16-mixed"),
        ("FP16", "16-mixed"),
        ("float64", "64-true"),
        ("bfloat16", "bf16-mixed"),
        ("fp32", "32-true"),
    ],
)
def test_common_precision_spellings_suggest_lightnings_name(
    lplugins_manager: PluginManager, typed: str, meant: str
) -> None:
    with pytest.raises(UnknownNameError, match=rf"Unknown precision '{typed}'.*Did you mean '{meant}'\?"):
        lplugins.compose(accelerator="cuda", precision=typed)


def test_registered_float64_with_deepspeed_is_refused_like_64_true(
    lplugins_manager: PluginManager, lplugins_register: Any
) -> None:
    lplugins_register(_precision("float64", DoublePrecision), "p")  # declares no strategies
    with pytest.raises(CompositionError, match="'64-true' cannot be used with strategy 'deepspeed_stage_2_cpu'"):
        lplugins.compose(strategy="deepspeed_stage_2_cpu", accelerator="cpu", precision="64-true")
    with pytest.raises(CompositionError) as info:
        lplugins.compose(strategy="deepspeed_stage_2_cpu", accelerator="cpu", precision="float64")
    message = str(info.value)
    assert "Precision 'float64' (DoublePrecision) cannot be used with strategy 'deepspeed_stage_2_cpu'" in message
    assert "DeepSpeedPrecision" in message and "bf16-mixed" in message
    with pytest.raises(CompositionError, match="'float64'"):  # as plugins=[...] too
        lplugins.compose(strategy="deepspeed_stage_2_cpu", accelerator="cpu", plugins=["float64"])
    # with DDP it is fine
    [plugin] = lplugins.compose(strategy="ddp", accelerator="cpu", precision="float64")["plugins"]
    assert isinstance(plugin, DoublePrecision)


def test_a_precision_built_for_deepspeed_or_declared_for_it_passes(
    lplugins_manager: PluginManager, lplugins_register: Any
) -> None:
    lplugins_register(_precision("ds_bf16", lambda: DeepSpeedPrecision("bf16-mixed")), "a")
    lplugins_register(_precision("trusted", DoublePrecision, strategies=("deepspeed_stage_2_cpu",)), "b")
    for name in ("ds_bf16", "trusted"):
        lplugins.compose(strategy="deepspeed_stage_2_cpu", accelerator="cpu", precision=name)


@pytest.mark.parametrize("value", [0, -1, True, False])
def test_accumulate_grad_batches_below_one_or_bool_is_refused(lplugins_manager: PluginManager, value: Any) -> None:
    with pytest.raises(
        CompositionError, match=rf"accumulate_grad_batches={value!r} is not allowed; it must be an int >= 1"
    ):
        lplugins.compose(accumulate_grad_batches=value)


def test_accumulate_grad_batches_one_and_more_pass(lplugins_manager: PluginManager) -> None:
    assert lplugins.compose(accumulate_grad_batches=1)["accumulate_grad_batches"] == 1
    assert lplugins.compose(accumulate_grad_batches=4)["accumulate_grad_batches"] == 4
