"""A simulated 2-node job on localhost: one CPU process per node, started separately, as on a cluster.

Once through an lplugins strategy with the standard variables (``MASTER_ADDR=127.0.0.1``,
``NODE_RANK=0/1``), once through a cluster environment that a plugin registers by name.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests._dist import free_port, run_script

# The driver starts the two "nodes" (the same script, different environment) and waits for both.
DRIVER = r"""
import json, os, subprocess, sys
node_script, out, mode, port = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
procs = []
for node in (0, 1):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE")}
    if mode == "standard":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))
    else:  # the plugin's scheduler speaks its own variables
        env.update(ACME_HEAD="127.0.0.1", ACME_PORT=port, ACME_NODE_INDEX=str(node), ACME_NUM_NODES="2")
    procs.append(subprocess.Popen([sys.executable, node_script, out, mode, str(node)], env=env))
codes = [p.wait(timeout=300) for p in procs]
sys.exit(max(codes))
"""

NODE = r"""
import json, os, sys
import torch
import lightning.pytorch as pl
import lplugins
from lplugins.strategies.environments import VariablesEnvironment
from tests.models import Regression, regression_loader

OUT, MODE, NODE = sys.argv[1], sys.argv[2], int(sys.argv[3])


class AcmePlugin:
    @staticmethod
    @lplugins.hookimpl
    def lplugins_register_cluster_environments(register):
        # a scheduler Lightning does not know, with its own variables; it starts one process per node
        register(
            "acme",
            VariablesEnvironment,
            description="Acme scheduler",
            defaults={"main_address": "ACME_HEAD", "main_port": "ACME_PORT", "node_rank": "ACME_NODE_INDEX",
                      "creates_processes_externally": True},
            detect=lambda: "ACME_NODE_INDEX" in os.environ,
        )


manager = lplugins.load(autoload=False)
kwargs = dict(accelerator="cpu", devices=1, num_nodes=2, max_steps=3, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
if MODE == "standard":
    kwargs = lplugins.compose(strategy="deepspeed_stage_2_cpu", **kwargs)
else:
    manager.register(AcmePlugin, "acme-plugin")
    # node 0 names the environment; node 1 relies on the plugin's detect()
    kwargs = lplugins.compose(strategy="ddp_timeout", plugins=["acme"] if NODE == 0 else [], **kwargs)
trainer = pl.Trainer(**kwargs)
model = Regression(seed=0, optimizer="sgd", lr=0.1)
trainer.fit(model, regression_loader(32, batch_size=4, seed=NODE))  # each node sees different data

import torch.distributed as dist
rank_sum = torch.tensor([float(trainer.global_rank)])
dist.all_reduce(rank_sum)
params = torch.cat([p.detach().flatten() for p in trainer.lightning_module.parameters()]).tolist()
result = {
    "node_rank": trainer.node_rank, "global_rank": trainer.global_rank, "world_size": trainer.world_size,
    "num_nodes": trainer.num_nodes, "environment": type(trainer.strategy.cluster_environment).__name__,
    "strategy": type(trainer.strategy).__module__, "rank_sum": rank_sum.item(), "params": params,
    "global_step": trainer.global_step, "backend": dist.get_backend(),
}
with open(os.path.join(OUT, f"node{NODE}.json"), "w") as f:
    json.dump(result, f)
"""


def _run(tmp_path: Path, mode: str) -> list[dict]:
    node = tmp_path / "node.py"
    node.write_text(NODE)
    run_script(DRIVER, tmp_path, timeout=300, args=[str(node), str(tmp_path), mode, str(free_port())]).check()
    return [json.loads((tmp_path / f"node{n}.json").read_text()) for n in (0, 1)]


@pytest.mark.distributed
@pytest.mark.timeout(320)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")
def test_two_nodes_through_an_lplugins_strategy(tmp_path: Path) -> None:
    results = _run(tmp_path, "standard")
    for node, res in enumerate(results):
        assert res["node_rank"] == node
        assert res["global_rank"] == node
        assert res["world_size"] == 2 and res["num_nodes"] == 2
        assert res["strategy"] == "lplugins.strategies.deepspeed"
        assert res["environment"] == "LightningEnvironment"
        assert res["backend"] == "gloo"
        assert res["rank_sum"] == 1.0  # an all-reduce spanning both nodes
        assert res["global_step"] == 3
    # each node trained on different data; ZeRO-2 keeps the parameters identical
    assert results[0]["params"] == results[1]["params"]


@pytest.mark.distributed
@pytest.mark.timeout(320)
def test_two_nodes_through_a_plugin_cluster_environment(tmp_path: Path) -> None:
    results = _run(tmp_path, "acme")
    for node, res in enumerate(results):
        assert res["environment"] == "VariablesEnvironment"  # node 0 by name, node 1 detected
        assert res["node_rank"] == node and res["global_rank"] == node
        assert res["world_size"] == 2 and res["num_nodes"] == 2
        assert res["strategy"] == "lplugins.strategies.ddp"
        assert res["rank_sum"] == 1.0
        assert res["global_step"] == 3
    assert results[0]["params"] == results[1]["params"]
