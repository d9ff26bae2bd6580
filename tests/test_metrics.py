"""Single-process tests of lplugins.metrics and the built-in ``logging`` plugin."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lplugins import LPluginsError, PluginManager, compose
from lplugins.metrics import MetricsCallback, ThroughputCallback, build_metric, flatten_values, infer_batch_size

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(10, 4, generator=G), torch.randint(0, 2, (10,), generator=G)


class Model(LightningModule):
    def __init__(self, returns: str = "dict") -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.returns = returns
        self.fed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.net(x)
        self.fed.append((logits.detach().clone(), y))
        loss = torch.nn.functional.cross_entropy(logits, y)
        if self.returns == "loss":
            return loss
        if self.returns == "tuple":
            return {"loss": loss, "out": (logits, y)}
        return {"loss": loss, "preds": logits, "target": y}

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return {"preds": self.net(x), "target": y}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return DataLoader(TensorDataset(X, Y), batch_size=4)  # 4, 4, 2

    def val_dataloader(self) -> Any:
        return DataLoader(TensorDataset(X, Y), batch_size=3)


def _trainer(tmp_path: Path, callbacks: list[Any], **kwargs: Any) -> Trainer:
    return Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=CSVLogger(tmp_path, name="logs"),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        **kwargs,
    )


def _rows(tmp_path: Path) -> list[dict[str, str]]:
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"metrics": 3}, "give a torchmetrics Metric"),
        ({"metrics": {}}, "give a torchmetrics Metric"),
        ({"metrics": {"acc": "nope"}}, "Metric 'acc' is 'nope'"),
        ({"metrics": {"acc": "torchmetrics.NoSuchMetric"}}, "cannot import 'torchmetrics.NoSuchMetric'"),
        ({"metrics": {"acc": "torch.nn.Linear"}}, "not a torchmetrics.Metric subclass"),
        ({"stages": ("train", "eval")}, r"unknown \['eval'\]; allowed: \('train', 'val', 'test'\)"),
        ({"stages": "train"}, "non-empty list"),
        ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
        ({"prefix": "m/"}, "must contain '{stage}'"),
        ({"extract": "preds"}, "extract='preds'"),
    ],
)
def test_metrics_callback_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    kwargs.setdefault("metrics", torchmetrics.MeanMetric())
    with pytest.raises(LPluginsError, match=match):
        MetricsCallback(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 0}, "seq_len=0"),
        ({"log_every_n_steps": 1.5}, "log_every_n_steps=1.5"),
        ({"seq_len": 4, "tokens_fn": len}, "not both"),
        ({"batch_size_fn": 3}, "batch_size_fn=3"),
    ],
)
def test_throughput_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(LPluginsError, match=match):
        ThroughputCallback(**kwargs)


def test_build_metric_and_flatten() -> None:
    metric = build_metric({"class_path": "torchmetrics.classification.BinaryAccuracy", "init_args": {"threshold": 0.3}})
    assert isinstance(metric, torchmetrics.classification.BinaryAccuracy) and metric.threshold == 0.3
    assert isinstance(build_metric("torchmetrics.MeanMetric"), torchmetrics.MeanMetric)
    assert flatten_values({"a": torch.tensor([1.0, 2.0]), "b": {"x": torch.tensor(3.0)}, "c": 4}) == {
        "a_0": 1.0,
        "a_1": 2.0,
        "b_x": 3.0,
        "c": 4.0,
    }
    assert infer_batch_size([(torch.zeros(5, 2),), torch.zeros(3)]) == 5
    with pytest.raises(LPluginsError, match="cannot find a tensor in a batch of type dict"):
        infer_batch_size({"a": "text"})


def test_metrics_logged_once_per_window_equal_reference(tmp_path: Path) -> None:
    cb = MetricsCallback({"acc": torchmetrics.classification.MulticlassAccuracy(num_classes=2)}, log_every_n_steps=2)
    tp = ThroughputCallback(log_every_n_steps=2, seq_len=8)
    model = Model()
    trainer = _trainer(tmp_path, [cb, tp], num_sanity_val_steps=2)
    trainer.fit(model)
    rows = _rows(tmp_path)
    train = [float(r["train/acc"]) for r in rows if r.get("train/acc")]
    val = [float(r["val/acc"]) for r in rows if r.get("val/acc")]
    reference = torchmetrics.classification.MulticlassAccuracy(num_classes=2)
    expected = []
    for window in (model.fed[0:2], model.fed[2:3]):  # 2 batches, then the rest flushed at epoch end
        reference.reset()
        for preds, target in window:
            reference.update(preds, target)
        expected.append(float(reference.compute()))
    assert train == pytest.approx(expected)
    assert len(val) == 1  # one validation epoch; the sanity check logs nothing
    assert cb.last_values["train"] == {"train/acc": pytest.approx(expected[-1])}
    assert float(trainer.callback_metrics["val/acc"]) == pytest.approx(val[0])
    throughput = [r for r in rows if r.get("throughput/samples_per_sec")]
    assert len(throughput) == 2
    for row in throughput:
        assert float(row["throughput/tokens_per_sec"]) == pytest.approx(8 * float(row["throughput/samples_per_sec"]))


def test_extract_function_and_test_stage(tmp_path: Path) -> None:
    seen: list[int] = []

    def extract(outputs: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(len(batch[1]))
        return outputs["out"]

    cb = MetricsCallback(
        torchmetrics.classification.MulticlassAccuracy(num_classes=2), stages=["train"], extract=extract
    )
    trainer = _trainer(tmp_path, [cb], limit_val_batches=0)
    trainer.fit(Model(returns="tuple"))
    assert seen == [4, 4, 2]
    assert list(cb.last_values["train"]) == ["train/MulticlassAccuracy"]

    test_cb = MetricsCallback({"acc": torchmetrics.classification.MulticlassAccuracy(num_classes=2)}, stages=["test"])

    class TestModel(Model):
        def test_step(self, batch: Any, batch_idx: int) -> Any:
            return self.validation_step(batch, batch_idx)

        def test_dataloader(self) -> Any:
            return self.val_dataloader()

    results = Trainer(
        accelerator="cpu", logger=False, callbacks=[test_cb], enable_progress_bar=False, enable_model_summary=False
    ).test(TestModel(), verbose=False)
    assert results == [{}]  # nothing logged through self.log
    assert set(test_cb.last_values["test"]) == {"test/acc"}


def test_step_output_that_breaks_the_contract_is_named(tmp_path: Path) -> None:
    cb = MetricsCallback(torchmetrics.MeanMetric(), stages=["train"])
    trainer = _trainer(tmp_path, [cb], limit_val_batches=0)
    with pytest.raises(
        LPluginsError, match=r"train step returned a dict with keys \['loss'\]; return a dict with 'preds'"
    ):
        trainer.fit(Model(returns="loss"))


def test_builtin_logging_plugin_registers_callbacks_by_name(lplugins_manager: PluginManager) -> None:
    registry = lplugins_manager.registry("callback")
    assert {"metrics", "rank_throughput"} <= set(registry.names())
    assert lplugins_manager.plugin("logging").registered["callback"] == ["metrics", "rank_throughput"]
    kwargs = compose(
        callbacks=[
            {"name": "metrics", "metrics": {"acc": {"class_path": "torchmetrics.classification.BinaryAccuracy"}}},
            {"name": "rank_throughput", "seq_len": 128},
        ]
    )
    metrics_cb, throughput_cb = [
        cb for cb in kwargs["callbacks"] if isinstance(cb, (MetricsCallback, ThroughputCallback))
    ]
    assert isinstance(metrics_cb, MetricsCallback) and set(metrics_cb.collections) == {"train", "val"}
    assert isinstance(throughput_cb, ThroughputCallback) and throughput_cb.seq_len == 128
