"""DeepSpeed config: dict or JSON file, validated before training, "auto" filled, conflicts explained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch  # noqa: F401  (imported first: it sets environment variables on import)
import pytest

import lplugins
from lplugins.strategies._ds_config import (
    DeepSpeedConfigError,
    TrainerFacts,
    check_against_trainer,
    fill_auto,
    load_config,
    validate_config,
)

pytest.importorskip("deepspeed")

#: the DeepSpeed config from the seed guide, verbatim
SEED_CONFIG: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e6,
    },
    "bf16": {"enabled": True},
}


@pytest.fixture
def seed_json(tmp_path: Path) -> Path:
    path = tmp_path / "deepspeed_config.json"
    path.write_text(json.dumps(SEED_CONFIG, indent=2))
    return path


def test_seed_config_is_valid_as_dict_and_file(seed_json: Path) -> None:
    validate_config(SEED_CONFIG)
    assert load_config(seed_json) == SEED_CONFIG
    loaded = load_config(SEED_CONFIG)
    assert loaded == SEED_CONFIG and loaded is not SEED_CONFIG


def test_seed_config_fills_auto_from_the_trainer() -> None:
    facts = TrainerFacts(
        accumulate_grad_batches=4,
        gradient_clip_val=1.0,
        precision="bf16-mixed",
        micro_batch_size=8,
        world_size=16,
    )
    filled, notes = fill_auto(SEED_CONFIG, facts)
    assert filled["gradient_accumulation_steps"] == 4
    assert filled["train_micro_batch_size_per_gpu"] == 8
    assert filled["train_batch_size"] == 8 * 4 * 16
    assert filled["gradient_clipping"] == 1.0
    assert filled["bf16"] == {"enabled": True}
    assert SEED_CONFIG["train_batch_size"] == "auto"  # the input is not modified
    assert any("train_batch_size = 512" in n for n in notes)


def test_precision_auto_follows_the_trainer() -> None:
    config = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    filled, _ = fill_auto(config, TrainerFacts(precision="32-true", micro_batch_size=2, world_size=2))
    assert filled["bf16"]["enabled"] is False and filled["fp16"]["enabled"] is False
    filled, _ = fill_auto(config, TrainerFacts(precision="16-mixed", micro_batch_size=2, world_size=2))
    assert filled["fp16"]["enabled"] is True and filled["bf16"]["enabled"] is False


def test_json_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DeepSpeedConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2,}}')
    with pytest.raises(DeepSpeedConfigError, match=r"bad.json' is not valid JSON.*line 1"):
        load_config(bad)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(DeepSpeedConfigError, match="must hold a JSON object"):
        load_config(listing)


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        # a typo DeepSpeed itself ignores silently, training without ZeRO
        (
            {"zero_optimisation": {"stage": 2}},
            r"'zero_optimisation' at the top level\. Did you mean 'zero_optimization'",
        ),
        (
            {"zero_optimization": {"stage": 2, "overlap_com": True}},
            r"'overlap_com' in 'zero_optimization'.*'overlap_comm'",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}},
            r"'pin_memroy' in 'zero_optimization.offload_param'.*'pin_memory'",
        ),
        ({"bf16": {"enable": True}}, r"'enable' in 'bf16'.*Did you mean 'enabled'"),
        ({"zero_optimization": {"stage": 4}}, r"'zero_optimization.stage' is 4; allowed: 0, 1, 2, 3"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}, r"device' is 'gpu'; allowed"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "parameter offload needs stage 3"),
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
            r"'zero_optimization.reduce_bucket_size' is 'auto'",
        ),
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}},
            r"'zero_optimization.reduce_bucket_size' is invalid",
        ),
        ({"train_micro_batch_size_per_gpu": 0}, "must be a positive integer or 'auto'"),
        ({"gradient_clipping": -1}, r"'gradient_clipping' is -1"),
        ({"fp16": {"enabled": "yes"}}, r"'fp16.enabled' is 'yes'; allowed: true, false, 'auto'"),
        ({"optimizer": {"params": {"lr": 1e-3}}}, "needs a 'type'"),
    ],
)
def test_invalid_configs_are_named(config: dict[str, Any], pattern: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=pattern):
        validate_config(config)


def test_comment_keys_are_ignored() -> None:
    validate_config({"_comment": "tuned for 8 x A100", "zero_optimization": {"stage": 2}})


@pytest.mark.parametrize(
    ("config", "facts", "pattern"),
    [
        (
            {"gradient_accumulation_steps": 4},
            TrainerFacts(accumulate_grad_batches=2),
            r"'gradient_accumulation_steps' is 4 but Trainer\(accumulate_grad_batches=2\)",
        ),
        ({"gradient_clipping": 1.0}, TrainerFacts(gradient_clip_val=0.5), r"'gradient_clipping' is 1.0 but Trainer"),
        ({"bf16": {"enabled": True}}, TrainerFacts(precision="32-true"), r"enables 'bf16'.*precision='32-true'"),
        ({"fp16": {"enabled": False}}, TrainerFacts(precision="16-mixed"), r"disables 'fp16'"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, TrainerFacts(precision="bf16-mixed"), "both"),
        ({}, TrainerFacts(gradient_clip_algorithm="value"), "clips by norm only"),
        ({"train_micro_batch_size_per_gpu": 4}, TrainerFacts(micro_batch_size=8), "dataloader's batch size is 8"),
        (
            {"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4},
            TrainerFacts(accumulate_grad_batches=2, world_size=2),
            r"micro-batch 4 x accumulation 2 x world size 2 = 16",
        ),
    ],
)
def test_conflicts_with_the_trainer_are_explained(config: dict[str, Any], facts: TrainerFacts, pattern: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=pattern):
        check_against_trainer(config, facts)
    with pytest.raises(DeepSpeedConfigError, match=pattern):
        fill_auto(config, facts)


def test_agreeing_values_are_kept() -> None:
    config = {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "train_batch_size": 8}
    facts = TrainerFacts(accumulate_grad_batches=2, gradient_clip_val=0.5, micro_batch_size=2, world_size=2)
    filled, _ = fill_auto(config, facts)
    assert filled["gradient_accumulation_steps"] == 2 and filled["train_batch_size"] == 8


# ---------------------------------------------------------------------- through compose
def test_compose_validates_the_config_file(lplugins_manager: lplugins.PluginManager, tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}))
    strategy = lplugins.compose(strategy={"name": "deepspeed_stage_2_cpu", "config": str(path)})["strategy"]
    assert strategy.config["zero_optimization"] == {"stage": 2}
    with pytest.raises(DeepSpeedConfigError, match=r"'gradient_clipping' is 1.0 but Trainer\(gradient_clip_val=2.0\)"):
        lplugins.compose(strategy={"name": "deepspeed_stage_2_cpu", "config": str(path)}, gradient_clip_val=2.0)


def test_compose_refuses_a_seed_config_that_contradicts_the_trainer(
    lplugins_manager: lplugins.PluginManager, seed_json: Path
) -> None:
    spec = {"name": "deepspeed_stage_3_offload_cpu", "config": str(seed_json)}
    with pytest.raises(DeepSpeedConfigError, match=r"enables 'bf16'.*Trainer\(precision='32-true'\)"):
        lplugins.compose(strategy=spec, precision="32-true")
    composed = lplugins.compose(strategy=spec, precision="bf16-mixed", accumulate_grad_batches=4)
    assert composed["strategy"].config["gradient_accumulation_steps"] == "auto"  # filled at setup


def test_config_stage_must_match_the_name(lplugins_manager: lplugins.PluginManager, seed_json: Path) -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"'deepspeed_stage_2_cpu' is ZeRO stage 2.*sets .* to 3"):
        lplugins.compose(strategy={"name": "deepspeed_stage_2_cpu", "config": str(seed_json)})


def test_config_without_zero_section_gets_the_named_stage(lplugins_manager: lplugins.PluginManager) -> None:
    spec = {"name": "deepspeed_stage_3_offload_cpu", "config": {"steps_per_print": 10}}
    strategy = lplugins.compose(strategy=spec)["strategy"]
    assert strategy.config["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }


def test_strategy_class_validates_directly() -> None:
    from lplugins.strategies import DeepSpeedStrategy

    with pytest.raises(DeepSpeedConfigError, match="Did you mean 'zero_optimization'"):
        DeepSpeedStrategy(config={"zero_optimizations": {"stage": 2}})


@pytest.mark.parametrize("supported", [True, False])
def test_fp16_on_a_cpu_without_onednn_fp16_is_refused_before_the_trainer(
    lplugins_manager: lplugins.PluginManager, monkeypatch: pytest.MonkeyPatch, supported: bool
) -> None:
    """DeepSpeed's CPU accelerator runs fp16 only where oneDNN does; elsewhere its ``initialize`` fails on every
    rank. compose() asks the same accelerator first (and the strategy again on every rank, before the group)."""
    from lplugins.strategies import _ds_cpu

    monkeypatch.setattr(_ds_cpu, "_fp16_supported", lambda: supported)
    for precision in ("bf16-mixed", "32-true"):  # any CPU
        lplugins.compose(strategy="deepspeed_stage_2_cpu", accelerator="cpu", precision=precision)
    fp16 = {"strategy": "deepspeed_stage_2_cpu", "accelerator": "cpu", "precision": "16-true"}  # ('16-mixed' on CPU:
    if supported:  # refused for every strategy, a GPU's AMP)
        lplugins.compose(**fp16)
        return
    with pytest.raises(DeepSpeedConfigError) as refused:
        lplugins.compose(**fp16)
    said = str(refused.value)
    assert said.startswith("Trainer(precision='16-true') with DeepSpeed on CPU"), said
    assert "(AVX512-FP16 or AMX-FP16)" in said and "Use precision='bf16-mixed' (any CPU) or '32-true'" in said
