"""Installing lplugins changes nothing in a Trainer that did not ask for it (#41): every way lplugins enters a
Trainer passes Lightning's own thread-leak rule (``tests_pytorch/conftest.py``: no thread a test started may be
left alive); a Trainer that is only built prints nothing and is not patched; a run's background threads are
stopped and joined when it ends, cleanly, by an exception, or by ``should_stop``."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.distributed

ENTRIES = r"""
import json, sys, threading
import lightning.pytorch as pl
import lplugins
from lplugins.lightning_cli import LightningCLI

def threads():
    return {t for t in threading.enumerate() if t.is_alive()}

def leaked(before):
    # Lightning's rule (tests_pytorch/conftest.py, thread_police_duuu_daaa_duuu_daaa): a thread the test
    # started and left alive is a zombie
    return sorted(t.name for t in threads() - before)

def build(**kwargs):
    return pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, **kwargs)

results = {}
before = threads()
print("installed: begin", file=sys.stderr, flush=True)
trainer = build()
del trainer
print("installed: end", file=sys.stderr, flush=True)
trainer = build()
results["installed"] = {"leaked": leaked(before),
                        "patched": "_select_ckpt_path" in vars(trainer._checkpoint_connector)}
del trainer

before = threads()
lplugins.load()
trainer = build()
results["load"] = {"leaked": leaked(before)}

before = threads()
trainer = pl.Trainer(**lplugins.compose(accelerator="cpu", devices=2, strategy="ddp", logger=False,
                                        callbacks=[{"name": "durable_checkpoint", "dirpath": "ckpts"}]))
results["compose"] = {"leaked": leaked(before), "names": sorted(type(c).__name__ for c in trainer.callbacks)}

before = threads()
trainer = build()
lplugins.attach(trainer, {"name": "durable_checkpoint", "dirpath": "ckpts2"})
results["attach"] = {"leaked": leaked(before)}

before = threads()
cli = LightningCLI(pl.LightningModule, run=False, args=["--trainer.accelerator=cpu", "--trainer.devices=2",
                   "--trainer.strategy=ddp", "--trainer.logger=false"])
results["lightning_cli"] = {"leaked": leaked(before), "world_size": cli.trainer.world_size}
results["namespaces"] = sorted(m for m in ("lightning.pytorch", "pytorch_lightning") if m in sys.modules)
print(json.dumps(results), flush=True)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("namespace", ["lightning", "pytorch_lightning"])
def test_every_way_into_a_trainer_passes_lightnings_thread_leak_rule(lplugins_launch: Any, namespace: str) -> None:
    source = ENTRIES
    if namespace == "pytorch_lightning":  # the same script written for the other namespace
        source = source.replace("import lightning.pytorch as pl", "import pytorch_lightning as pl")
        source = source.replace("from lplugins.lightning_cli import", "from lplugins._pl.lightning_cli import")
    ranks = lplugins_launch(source, ranks=1, env=_env(), timeout=150).check()
    (results,) = ranks.json_objects()
    assert results["namespaces"] == [{"lightning": "lightning.pytorch"}.get(namespace, namespace)]
    for entry in ("installed", "load", "compose", "attach", "lightning_cli"):
        assert results[entry]["leaked"] == [], (entry, results)
    assert results["lightning_cli"]["world_size"] == 2
    # installed, not asked: Trainer() is not patched and prints nothing of lplugins'
    assert results["installed"]["patched"] is False
    built = ranks.stderr.split("installed: begin", 1)[1].split("installed: end", 1)[0]
    assert "lplugins" not in built, built
    assert "DurableCheckpoint" in results["compose"]["names"]


RUNS = r"""
import json, os, sys, threading
import lightning.pytorch as pl
import torch
from tests.models import Regression, regression_loader

class Boom(Regression):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("boom at step 2")
        return super().training_step(batch, batch_idx)

class Stop(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 2:
            trainer.should_stop = True

def ours():
    return sorted(t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith("lplugins"))

def trainer(*callbacks):
    return pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=list(callbacks))

seen = {}
t = trainer()
seen["built"] = ours()
t.fit(Regression(), regression_loader(64, batch_size=4))
seen["clean"] = ours()
t = trainer(Stop())
t.fit(Regression(), regression_loader(64, batch_size=4))
seen["should_stop"] = {"threads": ours(), "step": t.global_step}
try:
    trainer().fit(Boom(), regression_loader(64, batch_size=4))
except RuntimeError as err:
    seen["exception"] = {"threads": ours(), "error": str(err)}
print(json.dumps({"rank": int(os.environ["LOCAL_RANK"]), **seen}), flush=True)
"""


@pytest.mark.timeout(240)
def test_a_runs_threads_are_stopped_and_joined_when_it_ends_however_it_ends(lplugins_launch: Any) -> None:
    # the watchdog's settings are checked in Trainer(); its thread runs only inside each run
    ranks = lplugins_launch(RUNS, ranks=2, env={**_env(), "LPLUGINS_COLLECTIVE_TIMEOUT": "30"}, timeout=200).check()
    records = sorted(ranks.json_objects(), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1], ranks.stdout
    for r in records:
        assert r["built"] == [] and r["clean"] == [], r
        assert r["should_stop"] == {"threads": [], "step": 2}, r
        assert r["exception"] == {"threads": [], "error": "boom at step 2"}, r
    assert "recvValue failed" not in ranks.stderr


def _env() -> dict[str, str]:
    import os
    from pathlib import Path

    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


EARLY_FAILURE = r"""
import os
import lightning.pytorch as pl
from tests.models import Regression, regression_loader

class Boom(Regression):
    def training_step(self, batch, batch_idx):
        if self.global_step == 1 and self.trainer.global_rank == 1:
            raise RuntimeError("boom on rank 1")
        return super().training_step(batch, batch_idx)

pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False, enable_checkpointing=False,
           enable_progress_bar=False, enable_model_summary=False).fit(Boom(), regression_loader(64, batch_size=4))
"""


@pytest.mark.timeout(120)
def test_a_failure_in_the_first_steps_is_named_on_the_other_rank(lplugins_launch: Any) -> None:
    # before the watchdog's first sample: its board and exception hook are set when the run starts
    ranks = lplugins_launch(EARLY_FAILURE, ranks=2, env=_env(), timeout=100)
    assert ranks.returncodes[1] == 1, ranks.stderr
    rank0 = ranks.outputs[0][1]
    assert "rank 1 failed: RuntimeError: boom on rank 1" in rank0, rank0
