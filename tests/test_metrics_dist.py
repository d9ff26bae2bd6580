"""2-process DDP tests of lplugins.metrics: synced metrics equal a one-process reference on the
concatenated data (uneven last batches included); every log line, file and row appears once."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from tests._dist import run_together

pytestmark = pytest.mark.distributed

JOB = """
import json, logging, sys
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lplugins.metrics import MetricsCallback, ThroughputCallback
from lplugins.rankzero import get_logger

logging.basicConfig(level=logging.INFO, format="LOG %(rank)s %(message)s", stream=sys.stdout)
log = get_logger("job")

# the same data on every rank; each rank takes its own uneven part (no DistributedSampler padding)
g = torch.Generator().manual_seed(0)
X_TRAIN, Y_TRAIN = torch.randn(21, 4, generator=g), torch.randint(0, 3, (21,), generator=g)
X_VAL, Y_VAL = torch.randn(17, 4, generator=g), torch.randint(0, 3, (17,), generator=g)
TRAIN_SPLIT = {0: slice(0, 12), 1: slice(12, 21)}  # batches of 4: [4, 4, 4] and [4, 4, 1]
VAL_SPLIT = {0: slice(0, 10), 1: slice(10, 17)}  # [4, 4, 2] and [4, 3]: not even the same number of batches

class Model(LightningModule):
    def __init__(self, lr=0.1, hidden=8):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))
        self.fed = {"train": [], "val": []}

    def _step(self, stage, batch):
        x, y = batch
        logits = self.net(x)
        # logits, as the docs write it: MetricsCallback(logits="auto") decides once, on both ranks together,
        # and applies the softmax to every batch (torchmetrics alone would skip it for a batch inside [0, 1])
        if not self.trainer.sanity_checking:  # the callback does not feed sanity-check batches either
            self.fed[stage].append((logits.detach().softmax(-1), y.clone()))
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "preds": logits, "target": y}

    def training_step(self, batch, batch_idx):
        return self._step("train", batch)

    def validation_step(self, batch, batch_idx):
        return self._step("val", batch)

    def on_train_epoch_end(self):
        log.info(f"epoch {self.current_epoch} done")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def _loader(self, x, y, part):
        return DataLoader(TensorDataset(x[part], y[part]), batch_size=4, shuffle=False)

    def train_dataloader(self):
        return self._loader(X_TRAIN, Y_TRAIN, TRAIN_SPLIT[self.global_rank])

    def val_dataloader(self):
        return self._loader(X_VAL, Y_VAL, VAL_SPLIT[self.global_rank])

if __name__ == "__main__":
    metrics = torchmetrics.MetricCollection({
        "acc": torchmetrics.classification.MulticlassAccuracy(num_classes=3),
        "f1": torchmetrics.classification.MulticlassF1Score(num_classes=3, average="macro"),
        "auroc": torchmetrics.classification.MulticlassAUROC(num_classes=3, thresholds=None),  # cat states
    })
    cb = MetricsCallback(metrics, log_every_n_steps=2)
    tp = ThroughputCallback(log_every_n_steps=2, seq_len=16)
    ckpt = ModelCheckpoint(dirpath="ckpt", monitor="val/acc", mode="max", save_top_k=1, filename="best")
    model = Model()
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, use_distributed_sampler=False,
                      logger=CSVLogger("logs", name="run"), callbacks=[cb, tp, ckpt], num_sanity_val_steps=1,
                      enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    log.info("fit starts")
    trainer.fit(model)
    rank = trainer.global_rank
    torch.save(model.fed, f"fed_rank{rank}.pt")
    with open(f"values_rank{rank}.json", "w") as f:
        json.dump({"metrics": cb.last_values, "throughput": tp.last_values, "counts": tp.last_counts,
                   "best": float(ckpt.best_model_score)}, f)
    log.info("fit ends")
"""

NAMES = ("acc", "f1", "auroc")
EPOCHS = 2
WINDOWS = [(0, 2), (2, 3)]  # training windows of 2 batches; the last one flushed at epoch end


def _reference(fed: list[dict[str, list[tuple[torch.Tensor, torch.Tensor]]]], stage: str, batches: slice):
    """One process, the concatenated data of both ranks for those batches."""
    import torchmetrics

    metrics = torchmetrics.MetricCollection(
        {
            "acc": torchmetrics.classification.MulticlassAccuracy(num_classes=3),
            "f1": torchmetrics.classification.MulticlassF1Score(num_classes=3, average="macro"),
            "auroc": torchmetrics.classification.MulticlassAUROC(num_classes=3, thresholds=None),
        }
    )
    pairs = [pair for rank_fed in fed for pair in rank_fed[stage][batches]]
    preds = torch.cat([p for p, _ in pairs])
    target = torch.cat([t for _, t in pairs])
    return {k: float(v) for k, v in metrics(preds, target).items()}, len(target)


@pytest.mark.timeout(240)
def test_two_rank_metrics_equal_single_process_reference_and_log_once(tmp_path: Path) -> None:
    res = run_together(JOB, tmp_path, timeout=200).check()

    # ---- what each rank fed its metrics: the uneven split, ragged last batches
    fed = [torch.load(tmp_path / f"fed_rank{r}.pt") for r in (0, 1)]
    assert [len(t) for _, t in fed[0]["train"][:3]] == [4, 4, 4]
    assert [len(t) for _, t in fed[1]["train"][:3]] == [4, 4, 1]
    assert [len(t) for _, t in fed[0]["val"]] == [4, 4, 2] * EPOCHS
    assert [len(t) for _, t in fed[1]["val"]] == [4, 3] * EPOCHS

    # ---- the CSV rows rank 0 wrote: one per window, equal to the one-process reference
    files = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "logs").rglob("*") if p.is_file())
    assert files == ["logs/run/version_0/hparams.yaml", "logs/run/version_0/metrics.csv"]  # once, one version
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["best.ckpt"]
    hparams = (tmp_path / "logs/run/version_0/hparams.yaml").read_text()
    assert hparams.count("lr: 0.1") == 1 and hparams.count("hidden: 8") == 1
    with open(tmp_path / "logs/run/version_0/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train_rows = [r for r in rows if r.get("train/acc")]
    val_rows = [r for r in rows if r.get("val/acc")]
    tp_rows = [r for r in rows if r.get("throughput/samples_per_sec")]
    assert len(train_rows) == EPOCHS * len(WINDOWS)
    assert len(val_rows) == EPOCHS  # once per validation, not once per rank; none for the sanity check
    assert len(tp_rows) == EPOCHS * len(WINDOWS)
    compared = 0
    for epoch in range(EPOCHS):
        for w, (start, stop) in enumerate(WINDOWS):
            expected, n = _reference(fed, "train", slice(3 * epoch + start, 3 * epoch + stop))
            row = train_rows[epoch * len(WINDOWS) + w]
            assert int(float(row["epoch"])) == epoch
            for name in NAMES:
                torch.testing.assert_close(float(row[f"train/{name}"]), expected[name], rtol=1e-6, atol=1e-7)
                compared += 1
            assert n == (8 + 8 if w == 0 else 4 + 1)
        # per epoch: rank 0 fed 3 val batches, rank 1 fed 2
        pairs0, pairs1 = fed[0]["val"][3 * epoch : 3 * epoch + 3], fed[1]["val"][2 * epoch : 2 * epoch + 2]
        expected, n = _reference([{"val": pairs0}, {"val": pairs1}], "val", slice(None))
        assert n == 17
        for name in NAMES:
            torch.testing.assert_close(float(val_rows[epoch][f"val/{name}"]), expected[name], rtol=1e-6, atol=1e-7)
            compared += 1
    assert compared == EPOCHS * (len(WINDOWS) + 1) * len(NAMES)

    # ---- every rank ended with the same synced values; ModelCheckpoint could monitor them on both ranks
    values = [json.loads((tmp_path / f"values_rank{r}.json").read_text()) for r in (0, 1)]
    assert values[0]["metrics"] == values[1]["metrics"]
    assert values[0]["best"] == values[1]["best"] == max(float(r["val/acc"]) for r in val_rows)

    # ---- throughput: both ranks' samples; tokens = samples * seq_len
    for row in tp_rows:
        samples, tokens = float(row["throughput/samples_per_sec"]), float(row["throughput/tokens_per_sec"])
        assert samples > 0
        torch.testing.assert_close(tokens, 16 * samples)
        torch.testing.assert_close(float(row["throughput/samples_per_sec_per_rank"]), samples / 2)
    assert values[0]["throughput"] == values[1]["throughput"]
    counts = values[0]["counts"]  # the last window (batch 3 of epoch 1): 4 samples on rank 0, 1 on rank 1
    assert (counts["samples"], counts["tokens"], counts["batches"], counts["world_size"]) == (5, 80, 1, 2)
    assert counts == values[1]["counts"]

    # ---- log lines: the rank-zero logger's lines once each, from rank 0
    lines = res.stdout.splitlines()
    for message in ("fit starts", "epoch 0 done", "epoch 1 done", "fit ends"):
        assert lines.count(f"LOG 0 {message}") == 1, message
    assert not [line for line in lines if line.startswith("LOG 1")]
    said = [line for line in (res.stdout + res.stderr).splitlines() if "MetricsCallback(logits='auto')" in line]
    assert len(said) == 1 and "treats preds as logits for the whole run" in said[0], said
