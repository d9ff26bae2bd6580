"""The strategy advisor: the seed guide's table, the arithmetic, the named strategy and the CLI."""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

import lightning.pytorch  # noqa: F401  (imported first: it sets environment variables on import)
import pytest
import torch

import lplugins
from lplugins.strategies import advisor
from lplugins.strategies._memory import GIB, LocalGPU
from lplugins.strategies.advisor import (
    STRATEGY_NAMES,
    AdvisorError,
    advise,
    advised_strategy,
    bytes_per_parameter,
    parse_count,
    register_cli,
)

#: the seed guide's hardware: nodes of 8 x 80 GB GPUs, AdamW, bf16 (2 TiB of host RAM per node)
SEED_HW: dict[str, Any] = {
    "device_memory_gib": 80,
    "devices_per_node": 8,
    "host_memory_gib": 2048,
    "optimizer": "adamw",
    "precision": "bf16-mixed",
}

# (parameters, extra inputs, expected key, what the seed says and why we agree or not)
TABLE: list[tuple[str, dict[str, Any], str, str]] = [
    ("500M", {}, "ddp", "seed: <1B -> ddp. Agrees: 16 B/param x 0.5B = 7.5 GiB per GPU."),
    ("3B", {}, "ddp", "seed: 1-7B -> ddp or ZeRO-2. Agrees: 45 GiB fits the 64 GiB usable."),
    (
        "6B",
        {},
        "zero2",
        "seed: 1-7B -> ddp or ZeRO-2, and the table says DDP for <7B. DDP stops fitting at ~4.3B "
        "(16 B/param x 6B = 89 GiB > 64 GiB usable); ZeRO-2 needs 2 + 14/8 = 3.75 B/param = 21 GiB.",
    ),
    (
        "13B",
        {},
        "zero2",
        "seed table: ZeRO-2 for 1-13B (agrees); seed code: FSDP for 7-70B (disagrees: ZeRO-2 fits at "
        "45 GiB per GPU and shards less, so it communicates less).",
    ),
    ("30B", {}, "fsdp", "seed: 7-70B -> FSDP. Agrees: 16/8 = 2 B/param = 56 GiB per GPU."),
    (
        "65B",
        {},
        "zero3_offload",
        "seed: 7-70B -> FSDP. Wrong on one node: fully sharded over 8 GPUs it needs 121 GiB per GPU.",
    ),
    ("65B", {"num_nodes": 2}, "fsdp", "seed: 7-70B -> FSDP. Agrees with 2 nodes (16 GPUs): 61 GiB per GPU."),
    ("70B", {}, "zero3_offload", "seed: 70B+ -> ZeRO-3 + offload. Agrees on one node (1,043 GiB of host RAM)."),
    (
        "70B",
        {"num_nodes": 4},
        "fsdp",
        "seed: 70B+ -> ZeRO-3 + offload. Not needed on 4 nodes: sharded over 32 GPUs it is 33 GiB per GPU; "
        "offloading would only slow it down.",
    ),
    ("70B", {"num_nodes": 4, "prefer_deepspeed": True}, "zero3", "seed table: ZeRO-3 for massive models."),
    ("500M", {"num_nodes": 4}, "ddp", "seed table: DDP for a single node. DDP is fine across nodes too."),
    # CPU (gloo) jobs: FSDP is lplugins' fsdp2 there (Lightning refuses its FSDP), offload is pointless
    (
        "400M",
        {"accelerator": "cpu", "devices_per_node": 2, "host_memory_gib": 16, "device_memory_gib": None},
        "ddp",
        "",
    ),
    (
        "500M",
        {"accelerator": "cpu", "devices_per_node": 2, "host_memory_gib": 16, "device_memory_gib": None},
        "zero2",
        "",
    ),
    (
        "700M",
        {"accelerator": "cpu", "devices_per_node": 2, "host_memory_gib": 16, "device_memory_gib": None},
        "fsdp",
        "on CPU, FSDP is lplugins' fsdp2",
    ),
    (
        "700M",
        {
            "accelerator": "cpu",
            "devices_per_node": 2,
            "host_memory_gib": 16,
            "device_memory_gib": None,
            "prefer_deepspeed": True,
        },
        "zero3",
        "",
    ),
]

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")


@pytest.mark.parametrize(("params", "extra", "expected", "why"), TABLE, ids=[f"{r[0]}-{r[2]}" for r in TABLE])
def test_advisor_table(params: str, extra: dict[str, Any], expected: str, why: str) -> None:
    inputs = {**SEED_HW, **extra}
    if extra.get("accelerator") == "cpu":
        inputs["precision"] = "32-true"
    advice = advise(params, **inputs)
    assert advice.key == expected, f"{why}\n{advice}"
    chosen = next(e for e in advice.estimates if e.key == expected)
    assert chosen.fits
    # everything preferred over the choice does not fit, or is not available here, or lost to prefer_deepspeed
    for e in advice.estimates[: advice.estimates.index(chosen)]:
        assert not e.fits or (extra.get("prefer_deepspeed") and e.key == "fsdp")


def test_arithmetic_is_shown() -> None:
    advice = advise("13B", **SEED_HW)
    text = str(advice)
    assert "2+2+12=16" in text  # DeepSpeed bf16: half weights and grads, fp32 master + Adam moments
    assert "4+4+8=16" in text  # torch autocast: fp32 weights and grads + Adam moments
    assert "2+14/8 = 3.75 B" in text
    assert "16/8 = 2 B" in text
    assert "Recommended: DeepSpeed ZeRO-2 -> strategy='deepspeed_stage_2'" in text
    by_key = {e.key: e for e in advice.estimates}
    assert by_key["ddp"].device_bytes == 16 * 13e9
    assert by_key["zero2"].device_bytes == pytest.approx(3.75 * 13e9)
    assert by_key["zero3_offload"].host_bytes_per_node == 16 * 13e9


@pytest.mark.parametrize(
    ("precision", "optimizer", "deepspeed", "expected"),
    [
        ("32-true", "adam", False, (4, 4, 8)),
        ("32-true", "adam", True, (4, 4, 8)),
        ("bf16-mixed", "adamw", False, (4, 4, 8)),
        ("16-mixed", "adamw", True, (2, 2, 12)),
        ("bf16-true", "adamw", False, (2, 2, 4)),
        ("32-true", "sgd", False, (4, 4, 4)),
        ("32-true", "sgd_nomomentum", False, (4, 4, 0)),
        ("32-true", 2, False, (4, 4, 2)),
    ],
)
def test_bytes_per_parameter(precision: str, optimizer: Any, deepspeed: bool, expected: tuple[int, ...]) -> None:
    assert bytes_per_parameter(precision, optimizer, deepspeed=deepspeed) == expected


def test_impossible_fit_is_a_clear_error() -> None:
    with pytest.raises(AdvisorError, match=r"No strategy fits 175,000,000,000 parameters.*would fit on 2 node"):
        advise("175B", **SEED_HW)
    with pytest.raises(AdvisorError, match=r"No strategy fits.*would fit on 2 node"):
        advise("1B", accelerator="cpu", devices_per_node=2, host_memory_gib=16, precision="32-true")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_parameters": "seven billion"}, "Cannot read 'seven billion'"),
        ({"num_parameters": 0}, "positive"),
        ({"num_parameters": "7B", "optimizer": "adamm"}, "Did you mean 'adam'"),
        (
            {"num_parameters": "7B", "precision": "fp8"},
            "precision='fp8' is not a precision the advisor knows; use 'auto'",
        ),
        ({"num_parameters": "7B", "precision": "bf16-mixd"}, "Did you mean 'bf16-mixed'"),
        ({"num_parameters": "7B", "devices_per_node": 0}, "devices_per_node=0 is not allowed; it must be an int >= 1"),
        ({"num_parameters": "7B", "headroom": 1.5}, "headroom"),
        ({"num_parameters": "7B", "accelerator": "tpu"}, "accelerator='tpu'"),
        ({}, "Give either num_parameters or model"),
    ],
)
def test_bad_input(kwargs: dict[str, Any], pattern: str) -> None:
    kwargs.setdefault("device_memory_gib", 80)
    with pytest.raises(AdvisorError, match=pattern):
        advise(**kwargs)


def test_parse_count() -> None:
    assert [parse_count(v) for v in ("7e9", "7B", "1.3b", "350M", "125k", "7_000", 2.5e9)] == [
        7_000_000_000,
        7_000_000_000,
        1_300_000_000,
        350_000_000,
        125_000,
        7_000,
        2_500_000_000,
    ]


def test_model_is_counted() -> None:
    model = torch.nn.Linear(1000, 1000)
    advice = advise(model=model, accelerator="cpu", devices_per_node=2, host_memory_gib=1, precision="32-true")
    assert advice.num_parameters == 1_001_000
    assert advice.key == "ddp"


# ---------------------------------------------------------------------- the named strategy
@needs_deepspeed
def test_advised_strategy_resolved_at_composition(lplugins_manager: lplugins.PluginManager) -> None:
    from lplugins.strategies import DDPStrategy, DeepSpeedStrategy, FSDP2Strategy

    spec = {"name": "advised", "num_parameters": "500M", "host_memory_gib": 16}
    strategy = lplugins.compose(strategy=spec, accelerator="cpu", devices=2, precision="32-true")["strategy"]
    assert isinstance(strategy, DeepSpeedStrategy)
    assert strategy.config["zero_optimization"]["stage"] == 2
    assert strategy.lplugins_advice.key == "zero2"
    assert strategy.lplugins_advice.world_size == 2  # read from the Trainer arguments

    small = lplugins.compose(strategy={"name": "advised", "num_parameters": 1e6}, accelerator="cpu", devices=2)
    assert type(small["strategy"]) is DDPStrategy

    spec = {"name": "advised", "num_parameters": "700M", "host_memory_gib": 16, "timeout": 5}
    strategy = lplugins.compose(strategy=spec, accelerator="cpu", devices=2, num_nodes=1)["strategy"]
    assert isinstance(strategy, FSDP2Strategy)  # everything sharded; on CPU that is FSDP2
    assert strategy._timeout.total_seconds() == 5

    spec = {"name": "advised", "num_parameters": "700M", "host_memory_gib": 16, "prefer_deepspeed": True}
    strategy = lplugins.compose(strategy=spec, accelerator="cpu", devices=2, num_nodes=1)["strategy"]
    assert strategy.config["zero_optimization"]["stage"] == 3


def test_advised_strategy_error_before_training(lplugins_manager: lplugins.PluginManager) -> None:
    with pytest.raises(AdvisorError, match="No strategy fits"):
        lplugins.compose(
            strategy={"name": "advised", "num_parameters": "5B", "host_memory_gib": 16}, accelerator="cpu", devices=2
        )


def test_advised_strategy_on_gpu_kwargs_without_gpu() -> None:
    # planning for GPUs on a machine without one: the device memory must be given
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    strategy = advised_strategy(
        {"accelerator": "cpu", "devices": 1}, num_parameters=1e6, host_memory_gib=4, device_memory_gib=None
    )
    assert strategy.lplugins_advice.key == "ddp"
    with pytest.raises(AdvisorError, match="pass device_memory_gib"):
        advise("7B", accelerator="cuda")


# ---------------------------------------------------------------------- CLI
def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lplugins")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_advise(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["advise", "13B", "--device-memory-gib", "80", "--devices-per-node", "8", "--host-memory-gib", "2048"]
    assert _cli(argv) == 0
    out = capsys.readouterr().out
    assert "Recommended: DeepSpeed ZeRO-2 -> strategy='deepspeed_stage_2'" in out
    assert _cli([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["key"] == "zero2" and data["world_size"] == 8
    assert [e["key"] for e in data["estimates"]] == ["ddp", "zero2", "fsdp", "zero3", "zero3_offload"]


def test_cli_advise_impossible() -> None:
    with pytest.raises(AdvisorError, match="No strategy fits"):
        _cli(["advise", "1T", "--device-memory-gib", "80", "--devices-per-node", "8", "--host-memory-gib", "512"])


def test_advised_fsdp_gets_the_timeout(lplugins_manager: lplugins.PluginManager) -> None:
    from datetime import timedelta

    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.MonkeyPatch.context() as mp:  # undone before the leak check
        mp.setenv("LPLUGINS_PG_TIMEOUT", "600")
        spec = {"name": "advised", "num_parameters": "30B", "accelerator": "cuda", **SEED_HW}
        spec.pop("precision")
        strategy = lplugins.compose(strategy=spec, precision="bf16-mixed")["strategy"]
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.lplugins_advice.key == "fsdp"
    assert strategy._timeout == timedelta(minutes=10)


def test_advised_without_a_size_says_how(lplugins_manager: lplugins.PluginManager) -> None:
    from lightning.pytorch import Trainer

    with pytest.raises(AdvisorError, match=r"needs the model size.*'num_parameters': 7e9"):
        Trainer(strategy="advised", accelerator="cpu", devices=1, logger=False)


# ---------------------------------------------------------------------- the target's hardware, not this machine's
#: this machine, as the issue found it: 23.5 GiB of RAM and no GPU
SMALL_HOST = 23.5 * GIB
H100 = LocalGPU(count=8, memory=80 * GIB, name="NVIDIA H100 80GB HBM3", bf16=True)


@pytest.fixture
def here(monkeypatch: pytest.MonkeyPatch) -> Any:
    """This machine, made deterministic: 23.5 GiB of RAM and, unless a test says otherwise, no GPU."""

    class Here:
        def gpu(self, gpu: LocalGPU | None) -> None:
            monkeypatch.setattr(advisor, "local_gpu", lambda: gpu)

    monkeypatch.setattr(advisor, "host_memory_bytes", lambda: SMALL_HOST)
    here = Here()
    here.gpu(None)
    return here


def test_70b_on_one_h100_node_uses_the_nodes_host_memory(here: Any) -> None:
    # 70e9 parameters x 16 B (bf16 DeepSpeed: 2 + 2 + 12) = 1.12e12 B = 1,043.1 GiB of state.
    # Sharded over 8 GPUs: 1,043.1 / 8 = 130.4 GiB per GPU > 80 x 0.8 = 64 GiB usable: only offload can fit.
    # Host memory of an 8 x 80 GiB node, not this machine's 23.5 GiB: 8 x 256 = 2,048 GiB (DGX H100: 2 TiB),
    # 2,048 x 0.8 = 1,638.4 GiB usable >= 1,043.1: ZeRO-3 + offload fits. (With 23.5 GiB: 18.8 usable, an error.)
    advice = advise("70B", device_memory_gib=80, devices_per_node=8, precision="bf16-mixed")
    assert advice.key == "zero3_offload"
    assert advice.strategy == "deepspeed_stage_3_offload"
    assert advice.host_bytes_per_node == 2048 * GIB
    offload = advice.estimates[-1]
    assert offload.host_bytes_per_node / GIB == pytest.approx(1043.1, abs=0.05)
    (assumed,) = advice.assumptions
    assert "host memory 2,048.0 GiB per node, typical for 8 x 80.0 GiB GPUs" in assumed
    assert "DGX H100" in assumed and "pass host_memory_gib for yours" in assumed
    assert f"Assumed: {assumed}" in str(advice)


def test_175b_on_h100_nodes_needs_two_nodes_not_six(here: Any) -> None:
    # 175e9 x 16 B = 2.8e12 B = 2,607.7 GiB of state. One node: 1,638.4 GiB usable host memory < 2,607.7.
    # Offload over 2 nodes: 2,607.7 / 2 = 1,303.9 GiB per node <= 1,638.4: 2 nodes.
    # Without offload: 2,607.7 / (8 GPUs x 64 GiB) = 5.09: 6 nodes (what the issue saw, from 23.5 GiB of host RAM).
    with pytest.raises(AdvisorError) as err:
        advise("175B", device_memory_gib=80, devices_per_node=8)
    msg = str(err.value)
    assert "a node has 1,638.4 GiB usable" in msg
    assert "fit on 2 node(s) with ZeRO-3 + offload (num_nodes=2), on 6 node(s) fully sharded" in msg
    assert "Assumed: host memory 2,048.0 GiB per node, typical for 8 x 80.0 GiB GPUs" in msg
    assert advise("175B", device_memory_gib=80, devices_per_node=8, num_nodes=2).key == "zero3_offload"


@pytest.mark.parametrize(
    ("device_gib", "devices", "host_gib"),
    [(80, 8, 2048), (141, 8, 2048), (40, 8, 1024), (24, 4, 192)],  # 256 / 128 GiB per GPU, else 2 x GPU memory
)
def test_typical_host_memory_follows_the_gpus(here: Any, device_gib: float, devices: int, host_gib: float) -> None:
    advice = advise("1B", device_memory_gib=device_gib, devices_per_node=devices)
    assert advice.host_bytes_per_node == host_gib * GIB


def test_this_machine_is_measured_only_when_it_is_the_target(here: Any) -> None:
    here.gpu(H100)
    # this machine's GPUs (measured, or given with the same memory): its own RAM
    for kwargs in ({}, {"device_memory_gib": 80}, {"devices_per_node": 4}):
        advice = advise("1B", **{"devices_per_node": 8, **kwargs})
        assert advice.host_bytes_per_node == SMALL_HOST, kwargs
        assert "this machine's" in advice.assumptions[-1]
    assert "device memory 80.0 GiB, measured on this machine's NVIDIA H100" in advise("1B").assumptions[0]
    # more GPUs than here, or another GPU: another machine, typical host memory
    assert advise("1B", devices_per_node=16).host_bytes_per_node == 16 * 256 * GIB
    assert advise("1B", device_memory_gib=40, devices_per_node=8).host_bytes_per_node == 1024 * GIB
    # given: used as given, nothing assumed
    given = advise("1B", device_memory_gib=40, devices_per_node=8, host_memory_gib=512)
    assert given.host_bytes_per_node == 512 * GIB and given.assumptions == ()
    # CPU: the host is the device memory; this machine's unless the device memory is given
    assert advise("1M", accelerator="cpu", devices_per_node=2).host_bytes_per_node == SMALL_HOST
    cpu = advise("1M", accelerator="cpu", devices_per_node=2, device_memory_gib=64)
    assert cpu.host_bytes_per_node == 128 * GIB
    assert "device_memory_gib x devices_per_node" in cpu.assumptions[0]


# ---------------------------------------------------------------------- precision="auto"
def test_precision_auto_is_resolved_for_the_target(here: Any) -> None:
    from lplugins.precision import default_precision

    cluster = advise("7B", precision="auto", device_memory_gib=80, devices_per_node=8)
    assert cluster.inputs["precision"] == "bf16-mixed"
    assert cluster.inputs["precision"] == default_precision("cuda", {"bf16_supported": True})[0]
    assert "precision 'auto' -> 'bf16-mixed'" in cluster.assumptions[-1]
    assert "Assumed: precision 'auto' -> 'bf16-mixed'" in str(cluster)

    cpu = advise("1M", precision="auto", accelerator="cpu", devices_per_node=2)
    assert cpu.inputs["precision"] == "32-true" == default_precision("cpu", {})[0]

    here.gpu(LocalGPU(count=1, memory=32 * GIB, name="Tesla V100-SXM2-32GB", bf16=False))
    v100 = advise("1B", precision="auto")  # this machine's GPU, which has no bf16
    assert v100.inputs["precision"] == "16-mixed"
    assert v100.inputs["precision"] == default_precision("cuda", {"bf16_supported": False})[0]
    assert "this machine's Tesla V100-SXM2-32GB, which has no bf16" in v100.assumptions[-1]


def test_advised_strategy_resolves_the_trainers_auto(
    here: Any, lplugins_manager: lplugins.PluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    monkeypatch.setattr(advisor, "announce", lambda msg, *args: said.append(msg % args))
    spec = {"name": "advised", "num_parameters": 1e6}
    strategy = lplugins.compose(strategy=spec, accelerator="cpu", devices=2, precision="auto")["strategy"]
    advice = strategy.lplugins_advice
    assert advice.inputs["precision"] == "32-true"
    assert any("precision 'auto' -> '32-true'" in a for a in advice.assumptions)
    (message,) = said  # once, through announce (rank zero only), with the assumptions
    assert message.startswith("lplugins: the 'advised' strategy\n") and "Assumed: precision 'auto'" in message
    unknown = advised_strategy({"accelerator": "cpu", "devices": 1, "precision": "fp8"}, num_parameters=1e6)
    assert "precision 'fp8' is not one the advisor models; counted as '32-true'" in unknown.lplugins_advice.assumptions


# ---------------------------------------------------------------------- names that read right for the target
def test_recommended_names_suit_the_target(lplugins_manager: lplugins.PluginManager) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    ours = lplugins_manager.registry("strategy")
    for name in STRATEGY_NAMES["cuda"].values():  # Lightning's own names, or an lplugins name without _cpu
        assert not name.endswith("_cpu")
        assert name in StrategyRegistry or name in ours, name
    for name in STRATEGY_NAMES["cpu"].values():  # names that run with accelerator="cpu": lplugins'
        assert name in ours, name
    gpu = advise("13B", **SEED_HW)
    assert [e.strategy for e in gpu.estimates] == [
        "ddp_timeout",
        "deepspeed_stage_2",
        "fsdp",
        "deepspeed_stage_3",
        "deepspeed_stage_3_offload",
    ]
    # Lightning's DeepSpeed divides the loss by k twice under accumulation: the advice says so, and names ours
    assert "lplugins' 'deepspeed_stage_2_cpu' is the same strategy on CUDA, dividing once" in str(gpu)
    cpu = advise("500M", accelerator="cpu", devices_per_node=2, host_memory_gib=16, precision="32-true")
    assert cpu.strategy == "deepspeed_stage_2_cpu"
    assert "dividing once" not in str(cpu)


# ---------------------------------------------------------------------- CLI errors name CLI flags
@pytest.mark.parametrize(
    ("argv", "cli_words", "python_words"),
    [
        (["7B"], "pass --device-memory-gib 80", "device_memory_gib"),
        (["7B", "--device-memory-gib", "80", "--devices-per-node", "0"], "--devices-per-node=0 is not allowed", None),
        (["7B", "--device-memory-gib", "80", "--nodes", "0"], "--nodes=0 is not allowed", "num_nodes"),
        (["7B", "--device-memory-gib", "-1"], "--device-memory-gib=-1.0 is not allowed", None),
        (["7B", "--device-memory-gib", "80", "--headroom", "1.5"], "--headroom must be a fraction", None),
        (["7B", "--device-memory-gib", "80", "--precision", "fp16"], "--precision='fp16' is not a precision", None),
        (["1T", "--device-memory-gib", "80", "--devices-per-node", "8"], "(--nodes 10)", "num_nodes"),
        (["1T", "--device-memory-gib", "80", "--devices-per-node", "8"], "pass --host-memory-gib for yours", None),
    ],
)
def test_cli_errors_name_cli_flags(
    here: Any, capsys: pytest.CaptureFixture[str], argv: list[str], cli_words: str, python_words: str | None
) -> None:
    from lplugins.cli import main

    assert main(["advise", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lplugins: error: ") and cli_words in err
    if python_words:
        assert python_words not in err


def test_python_errors_name_python_names(here: Any) -> None:
    with pytest.raises(AdvisorError, match=r"pass device_memory_gib=80 .* or accelerator='cpu'"):
        advise("7B")
    with pytest.raises(AdvisorError, match=r"\(num_nodes=10\)") as err:
        advise("1T", device_memory_gib=80, devices_per_node=8)
    assert "--" not in str(err.value)


def test_cli_precision_auto_and_json(here: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["advise", "13B", "--precision", "auto", "--device-memory-gib", "80", "--devices-per-node", "8"]
    assert _cli([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["precision"] == "bf16-mixed"
    assert data["strategy"] == "deepspeed_stage_2"
    assert any("pass --host-memory-gib for yours" in a for a in data["assumptions"])
    assert _cli(["advise", "1M", "--accelerator", "cpu", "--precision", "auto", "--optimizer", "4"]) == 0
    assert "Assumed: precision 'auto' -> '32-true'" in capsys.readouterr().out
