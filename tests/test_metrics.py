"""Single-process tests of lplugins.metrics and the built-in ``logging`` plugin."""

from __future__ import annotations

import csv
import logging
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
    cb = MetricsCallback(torchmetrics.classification.MulticlassAccuracy(num_classes=2), stages=["train"])
    trainer = _trainer(tmp_path, [cb], limit_val_batches=0)
    with pytest.raises(LPluginsError) as err:
        trainer.fit(Model(returns="loss"))
    message = str(err.value)
    assert "training_step (train stage) returned a dict with keys ['loss'] (no 'preds', 'target')" in message
    assert 'return {"loss": loss, "preds": logits, "target": y}' in message
    assert "extract=lambda outputs, batch: (preds, target)" in message


def test_validation_step_returning_nothing_is_named(tmp_path: Path) -> None:
    class Silent(Model):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.net(batch[0])

    cb = MetricsCallback({"acc": torchmetrics.classification.MulticlassAccuracy(num_classes=2)}, preds_key="p")
    trainer = _trainer(tmp_path, [cb], num_sanity_val_steps=0)
    with pytest.raises(LPluginsError) as err:
        trainer.fit(Silent())  # the train stage returns "preds", not "p": named first
    assert "training_step (train stage) returned a dict with keys ['loss', 'preds', 'target'] (no 'p')" in str(
        err.value
    )
    cb = MetricsCallback({"acc": torchmetrics.classification.MulticlassAccuracy(num_classes=2)}, stages=["val"])
    with pytest.raises(LPluginsError) as err:
        _trainer(tmp_path, [cb]).validate(Silent(), verbose=False)
    assert "validation_step (val stage) returned nothing (None)" in str(err.value)
    assert 'return {"preds": logits, "target": y}' in str(err.value)


def test_extract_must_return_a_pair(tmp_path: Path) -> None:
    cb = MetricsCallback(torchmetrics.MeanMetric(), stages=["val"], extract=lambda outputs, batch: outputs["preds"])
    with pytest.raises(LPluginsError, match=r"returned a Tensor for the val step; it must return a pair"):
        _trainer(tmp_path, [cb]).validate(Model(), verbose=False)


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


# ---------------------------------------------------------------------------- logits -> probabilities
class ScoreModel(LightningModule):
    """Its ``validation_step`` returns the batch's first column as ``preds`` (fixed scores, no network)."""

    def __init__(self, preds: torch.Tensor, target: torch.Tensor, batch_size: int) -> None:
        super().__init__()
        self.preds, self.target, self.batch_size = preds, target, batch_size

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        preds, target = batch
        return {"preds": preds, "target": target}

    def val_dataloader(self) -> Any:
        return DataLoader(TensorDataset(self.preds, self.target), batch_size=self.batch_size)


def _validate(cb: MetricsCallback, model: LightningModule) -> dict[str, float]:
    Trainer(
        accelerator="cpu", logger=False, callbacks=[cb], enable_progress_bar=False, enable_model_summary=False
    ).validate(model, verbose=False)
    return cb.last_values["val"]


# Binary logits: the first batch is clearly logits; the second lies inside [0, 1] by chance, and
# torchmetrics alone would take it as probabilities (0.3 -> negative, while sigmoid(0.3) > 0.5).
BINARY_LOGITS = torch.tensor([-2.0, 3.0, -0.5, 1.5, 0.3, 0.7, 0.1, 0.9])
BINARY_TARGET = torch.tensor([0, 1, 0, 1, 1, 1, 1, 1])


def test_binary_logits_inside_0_1_are_still_logits_for_the_whole_run(caplog: pytest.LogCaptureFixture) -> None:
    naive = torchmetrics.classification.BinaryAccuracy()
    for chunk in (slice(0, 4), slice(4, 8)):  # torchmetrics' per-update guess: the second batch is "probabilities"
        naive.update(BINARY_LOGITS[chunk], BINARY_TARGET[chunk])
    assert float(naive.compute()) == pytest.approx(6 / 8)  # wrong: every logit here has the right sign
    cb = MetricsCallback({"acc": torchmetrics.classification.BinaryAccuracy()}, stages=["val"])
    with caplog.at_level(logging.INFO, logger="lplugins"):
        values = _validate(cb, ScoreModel(BINARY_LOGITS, BINARY_TARGET, batch_size=4))
    assert values == {"val/acc": pytest.approx(1.0)}
    said = [r.getMessage() for r in caplog.records if "MetricsCallback" in r.getMessage()]
    assert len(said) == 1 and "logits" in said[0] and "sigmoid" in said[0]


def test_logits_true_applies_from_a_first_batch_inside_0_1() -> None:
    cb = MetricsCallback({"acc": torchmetrics.classification.BinaryAccuracy()}, stages=["val"], logits=True)
    reordered = torch.cat([BINARY_LOGITS[4:], BINARY_LOGITS[:4]]), torch.cat([BINARY_TARGET[4:], BINARY_TARGET[:4]])
    assert _validate(cb, ScoreModel(*reordered, batch_size=4)) == {"val/acc": pytest.approx(1.0)}


def test_multiclass_logits_get_a_softmax_over_the_class_dim() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 3, generator=g) * 3
    logits[6:] = torch.rand(6, 3, generator=g)  # the second half lies inside [0, 1]
    target = torch.randint(0, 3, (12,), generator=g)
    reference = torchmetrics.classification.MulticlassAUROC(num_classes=3)
    reference.update(logits.softmax(1), target)
    naive = torchmetrics.classification.MulticlassAUROC(num_classes=3)
    naive.update(logits[:6], target[:6])
    naive.update(logits[6:], target[6:])
    assert float(naive.compute()) != pytest.approx(float(reference.compute()))
    cb = MetricsCallback({"auroc": torchmetrics.classification.MulticlassAUROC(num_classes=3)}, stages=["val"])
    assert _validate(cb, ScoreModel(logits, target, batch_size=6)) == {
        "val/auroc": pytest.approx(float(reference.compute()))
    }


def test_probabilities_and_labels_pass_unchanged_in_auto_mode() -> None:
    g = torch.Generator().manual_seed(4)
    probs = torch.randn(8, 3, generator=g).softmax(1)
    target = torch.randint(0, 3, (8,), generator=g)
    reference = torchmetrics.classification.MulticlassAUROC(num_classes=3)
    reference.update(probs, target)
    cb = MetricsCallback({"auroc": torchmetrics.classification.MulticlassAUROC(num_classes=3)}, stages=["val"])
    assert _validate(cb, ScoreModel(probs, target, batch_size=4)) == {
        "val/auroc": pytest.approx(float(reference.compute()))
    }
    labels = probs.argmax(1)
    cb = MetricsCallback({"acc": torchmetrics.classification.MulticlassAccuracy(num_classes=3)}, stages=["val"])
    expected = float(torchmetrics.functional.classification.multiclass_accuracy(labels, target, num_classes=3))
    assert _validate(cb, ScoreModel(labels, target, batch_size=4)) == {"val/acc": pytest.approx(expected)}


def test_auto_decided_probabilities_then_a_logit_is_a_clear_error() -> None:
    cb = MetricsCallback({"acc": torchmetrics.classification.BinaryAccuracy()}, stages=["val"])
    preds = torch.tensor([0.2, 0.9, 0.4, 0.6, 2.5, -1.0, 0.3, 0.8])
    with pytest.raises(LPluginsError, match=r"values outside \[0, 1\].*logits=True"):
        _validate(cb, ScoreModel(preds, BINARY_TARGET, batch_size=4))


def test_logits_false_leaves_preds_to_torchmetrics() -> None:
    cb = MetricsCallback({"acc": torchmetrics.classification.BinaryAccuracy()}, stages=["val"], logits=False)
    assert _validate(cb, ScoreModel(BINARY_LOGITS, BINARY_TARGET, batch_size=4)) == {"val/acc": pytest.approx(6 / 8)}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logits": "yes"}, r"logits='yes'.*True, False or 'auto'"),
        ({"logits": True, "metrics": torchmetrics.MeanMetric()}, r"logits=True.*no torchmetrics classification"),
        (
            {
                "logits": True,
                "metrics": {
                    "a": torchmetrics.classification.BinaryAccuracy(),
                    "b": torchmetrics.classification.MulticlassAccuracy(num_classes=3),
                },
            },
            "both sigmoid .* and softmax",
        ),
    ],
)
def test_logits_option_is_checked_at_construction(kwargs: dict[str, Any], match: str) -> None:
    kwargs.setdefault("metrics", torchmetrics.classification.BinaryAccuracy())
    with pytest.raises(LPluginsError, match=match):
        MetricsCallback(**kwargs)


def test_logits_option_by_name_is_checked_in_compose() -> None:
    with pytest.raises(LPluginsError, match=r"has no parameter 'logit'\. Did you mean 'logits'\?"):
        compose(callbacks=[{"name": "metrics", "metrics": "torchmetrics.MeanMetric", "logit": True}])
    with pytest.raises(LPluginsError, match=r"logits=True.*no torchmetrics classification"):
        compose(callbacks=[{"name": "metrics", "metrics": "torchmetrics.MeanMetric", "logits": True}])
    (cb,) = [
        c
        for c in compose(callbacks=[{"name": "metrics", "metrics": {"acc": BINARY_ACC}, "logits": True}])["callbacks"]
        if isinstance(c, MetricsCallback)
    ]
    assert cb.logits_policy.logits is True and cb.logits_policy.transform == "sigmoid"


BINARY_ACC = {"class_path": "torchmetrics.classification.BinaryAccuracy"}


def test_logits_true_with_labels_is_a_clear_error() -> None:
    cb = MetricsCallback(
        {"acc": torchmetrics.classification.MulticlassAccuracy(num_classes=2)}, stages=["val"], logits=True
    )
    with pytest.raises(
        LPluginsError, match=r"applies a softmax to preds, but the val step returned preds as a torch.int64"
    ):
        _validate(cb, ScoreModel(BINARY_TARGET, BINARY_TARGET, batch_size=4))
