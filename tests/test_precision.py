"""Precision by name: fp8's explained error, strategy/precision pairs, fp16 loss-scale logging."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

import lplugins
from lplugins import CompositionError, PluginManager
from lplugins.precision import Float8Unavailable, LossScaleMonitor, fp8_precision


def test_fp8_on_cpu_says_what_is_missing(lplugins_manager: PluginManager) -> None:
    with pytest.raises(Float8Unavailable) as info:
        lplugins.compose(accelerator="cpu", precision="fp8")
    message = str(info.value)
    assert "precision 'fp8' cannot run here" in message
    assert "a CUDA GPU (the Trainer's accelerator is 'cpu')" in message
    assert "transformer-engine or torchao installed" in message
    assert "precision='auto'" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_fp8_asked_for_cuda_without_a_gpu() -> None:
    with pytest.raises(Float8Unavailable, match="a CUDA GPU"):
        fp8_precision(accelerator="cuda")


def test_fp8_rejects_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match="fp8 backend='apex' is not one of 'auto', 'transformer-engine', 'torchao'"):
        fp8_precision(backend="apex")


@pytest.mark.parametrize(
    ("strategy", "precision", "family"),
    [
        ("deepspeed_stage_2", "64-true", "DeepSpeed"),
        ("fsdp", "64-true", "FSDP"),
        ("fsdp", "transformer-engine", "FSDP"),
    ],
)
def test_incompatible_strategy_and_lightning_precision(
    lplugins_manager: PluginManager, strategy: str, precision: str, family: str
) -> None:
    with pytest.raises(CompositionError) as info:
        lplugins.compose(strategy=strategy, precision=precision)
    message = str(info.value)
    assert f"Precision {precision!r} cannot be used with strategy {strategy!r} ({family}" in message
    assert "bf16-mixed" in message  # what would work


def test_compatible_pair_passes_through(lplugins_manager: PluginManager) -> None:
    kwargs = lplugins.compose(strategy="deepspeed_stage_2", accelerator="cuda", precision="bf16-mixed")
    assert kwargs["precision"] == "bf16-mixed"


class Overflow(BoringModel):
    """Produces an infinite loss at one step, so that GradScaler skips that optimizer step."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if batch_idx == 3:
            out["loss"] = out["loss"] * float("inf")
        return out


def test_fp16_contributes_the_monitor(lplugins_manager: PluginManager) -> None:
    kwargs = lplugins.compose(accelerator="cuda", precision="16-mixed")  # fp16 AMP is refused on CPU
    assert [type(cb) for cb in kwargs["callbacks"]] == [LossScaleMonitor]  # through the built-in plugin's hook


def test_fp16_logs_loss_scale_and_skipped_steps(lplugins_manager: PluginManager, tmp_path: Path) -> None:
    # Lightning turns 16-mixed on CPU into bf16-mixed (no scaler), so build the fp16 plugin with a
    # CPU GradScaler explicitly: the same scaler logic that runs on CUDA
    from lightning.pytorch.plugins.precision import MixedPrecision

    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=16.0))
    kwargs = lplugins.compose(
        accelerator="cpu",
        plugins=[fp16],
        callbacks=["loss_scale_monitor"],
        max_steps=6,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="run"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    monitors = [cb for cb in kwargs["callbacks"] if isinstance(cb, LossScaleMonitor)]
    assert len(monitors) == 1
    trainer = Trainer(**kwargs)
    trainer.fit(Overflow())
    assert monitors[0].skipped_steps == 1
    rows = list(csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").open()))
    scales = [float(r["precision/loss_scale"]) for r in rows if r.get("precision/loss_scale")]
    skipped = [float(r["precision/skipped_steps"]) for r in rows if r.get("precision/skipped_steps")]
    assert scales and scales[0] == 16.0 and scales[-1] == 8.0  # halved once, at the overflow
    assert skipped[-1] == 1.0


def test_no_monitor_without_fp16_and_no_duplicate(lplugins_manager: PluginManager) -> None:
    assert "callbacks" not in lplugins.compose(precision="bf16-mixed")
    kwargs = lplugins.compose(accelerator="cuda", precision="16-mixed", callbacks=["loss_scale_monitor"])
    assert [type(cb) for cb in kwargs["callbacks"]] == [LossScaleMonitor]
