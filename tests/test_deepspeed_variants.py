"""ZeRO-1 and the offload variants on 2 CPU processes, and the seed guide's JSON config end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import run_together
from tests.test_deepspeed_config import SEED_CONFIG

pytest.importorskip("deepspeed")

SCRIPT = r"""
import json, os, sys
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
import deepspeed
import lplugins
from tests.models import Regression

OUT, SEED = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=g)
y = x.sum(1, keepdim=True)


def full_loss(module):
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params), torch.no_grad():
        p = next(module.parameters())
        return float(torch.nn.functional.mse_loss(module.net(x.to(p.dtype)).float(), y))


class Probe(pl.Callback):
    def on_train_start(self, trainer, module):
        self.start = full_loss(module)

    def on_train_end(self, trainer, module):
        self.end = full_loss(module)


results = {}
runs = [
    ("deepspeed_stage_1_cpu", {}),
    ("deepspeed_stage_2_offload_cpu", {}),
    ("deepspeed_stage_3_offload_cpu", {}),
    (
        {"name": "deepspeed_stage_3_offload_cpu", "config": SEED},
        {"precision": "bf16-mixed", "accumulate_grad_batches": 2},
    ),
]
for strategy, extra in runs:
    torch.manual_seed(0)
    probe = Probe()
    trainer = pl.Trainer(**lplugins.compose(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=6, callbacks=[probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **extra))
    trainer.fit(Regression(8, (16,), lr=2e-2), DataLoader(TensorDataset(x, y), batch_size=4))
    cfg = trainer.strategy.config
    engine = trainer.strategy.deepspeed_engine
    key = strategy if isinstance(strategy, str) else "seed_json"
    results[key] = {
        "start": probe.start, "end": probe.end, "stage": cfg["zero_optimization"]["stage"],
        "offload_optimizer": cfg["zero_optimization"].get("offload_optimizer", {}).get("device"),
        "offload_param": cfg["zero_optimization"].get("offload_param", {}).get("device"),
        "train_batch_size": engine.train_batch_size(),
        "micro": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(),
        "bf16": engine.bfloat16_enabled(),
        "gradient_clipping": cfg["gradient_clipping"],
    }
with open(os.path.join(OUT, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(results, f)
torch.distributed.barrier()  # rank 0 must not exit (and end the job) before rank 1 has written
"""


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_stage_1_offload_variants_and_seed_json(tmp_path: Path) -> None:
    seed = tmp_path / "deepspeed_config.json"
    seed.write_text(json.dumps(SEED_CONFIG))
    run_together(SCRIPT, tmp_path, timeout=380, args=[str(tmp_path), str(seed)]).check()
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        expected = {
            "deepspeed_stage_1_cpu": (1, None, None),
            "deepspeed_stage_2_offload_cpu": (2, "cpu", None),
            "deepspeed_stage_3_offload_cpu": (3, "cpu", "cpu"),
            "seed_json": (3, "cpu", "cpu"),
        }
        for key, (stage, offload_optimizer, offload_param) in expected.items():
            res = results[key]
            assert (res["stage"], res["offload_optimizer"], res["offload_param"]) == (
                stage,
                offload_optimizer,
                offload_param,
            ), key
            assert res["end"] < res["start"], (key, res)
        # the seed JSON's "auto" values, filled from the Trainer: micro-batch 4 x accumulation 2 x 2 ranks
        seed_run = results["seed_json"]
        assert (seed_run["micro"], seed_run["gas"], seed_run["train_batch_size"]) == (4, 2, 16)
        assert seed_run["bf16"] is True
        assert seed_run["gradient_clipping"] == 0.0
        assert results["deepspeed_stage_1_cpu"]["gas"] == 1
