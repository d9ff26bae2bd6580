"""``MetricsCallback``: torchmetrics on the step outputs, synced across ranks, logged once per interval."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from functools import partialmethod
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torchmetrics import Metric, MetricCollection
from typing_extensions import override

from lplugins._errors import LPluginsError
from lplugins._validate import positive_int
from lplugins.metrics._logits import LogitsMode, LogitsPolicy, transform_of
from lplugins.metrics._window import window_length

#: The stages a MetricsCallback can watch.
STAGES: tuple[str, ...] = ("train", "val", "test")
"""The stages a ``MetricsCallback`` can watch."""

Extract = Callable[[Any, Any], tuple[Any, Any]]
MetricsSpec = Metric | MetricCollection | Mapping[str, Any]


def build_metric(spec: Any, name: str = "metric") -> Metric:
    """Build a torchmetrics ``Metric`` from an instance, a dotted class path, or a LightningCLI-style dict.

    Args:
        spec: A ``Metric``; ``"torchmetrics.classification.BinaryAccuracy"``; or
            ``{"class_path": "...", "init_args": {...}}``.
        name: The metric's name, for error messages.

    Returns:
        The metric.

    Raises:
        LPluginsError: ``spec`` is none of those, or does not name a ``Metric`` class.

    Examples:
        >>> build_metric({"class_path": "torchmetrics.MeanMetric"}).__class__.__name__
        'MeanMetric'
    """
    if isinstance(spec, Metric):
        return spec
    init_args: Mapping[str, Any] = {}
    path = spec
    if isinstance(spec, Mapping) and "class_path" in spec:
        path, init_args = spec["class_path"], spec.get("init_args") or {}
    if isinstance(path, str) and "." in path:
        module_name, _, attr = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise LPluginsError(f"Metric {name!r}: cannot import {path!r} ({exc}).") from exc
        if isinstance(cls, type) and issubclass(cls, Metric):
            return cls(**init_args)
        raise LPluginsError(f"Metric {name!r}: {path!r} is {cls!r}, not a torchmetrics.Metric subclass.")
    raise LPluginsError(
        f"Metric {name!r} is {spec!r}; give a torchmetrics.Metric instance, a dotted class path such as "
        f"'torchmetrics.classification.BinaryAccuracy', or {{'class_path': ..., 'init_args': {{...}}}}."
    )


def _as_collection(metrics: Any) -> MetricCollection:
    if isinstance(metrics, MetricCollection):
        return metrics
    if isinstance(metrics, Metric):
        return MetricCollection([metrics])
    if isinstance(metrics, Mapping) and metrics and "class_path" not in metrics:
        return MetricCollection({str(k): build_metric(v, str(k)) for k, v in metrics.items()})
    if isinstance(metrics, str) or (isinstance(metrics, Mapping) and "class_path" in metrics):
        return MetricCollection([build_metric(metrics)])
    raise LPluginsError(
        f"MetricsCallback(metrics={metrics!r}): give a torchmetrics Metric, a MetricCollection, or a non-empty "
        f"dict of name -> Metric (or class path)."
    )


def flatten_values(values: Mapping[str, Any]) -> dict[str, float]:
    """Turn computed metric values into ``name -> float`` for loggers.

    Scalars keep their name; a tensor with ``n > 1`` elements becomes ``name_0 ... name_{n-1}``; a
    nested dict becomes ``name_key``.

    Examples:
        >>> flatten_values({"acc": torch.tensor(0.5), "per_class": torch.tensor([1.0, 0.0])})
        {'acc': 0.5, 'per_class_0': 1.0, 'per_class_1': 0.0}
    """
    flat: dict[str, float] = {}
    for name, value in values.items():
        if isinstance(value, Mapping):
            flat.update(flatten_values({f"{name}_{k}": v for k, v in value.items()}))
        elif isinstance(value, torch.Tensor) and value.numel() != 1:
            for i, item in enumerate(value.detach().flatten().tolist()):
                flat[f"{name}_{i}"] = float(item)
        elif isinstance(value, torch.Tensor):
            flat[name] = float(value.detach().item())
        else:
            flat[name] = float(value)
    return flat


def _describe(outputs: Any) -> str:
    if isinstance(outputs, Mapping):
        return f"a dict with keys {sorted(map(str, outputs))}"
    if outputs is None:
        return "nothing (None)"
    return f"a {type(outputs).__name__}"


#: The LightningModule method behind each stage (named in contract errors).
_STEP_OF = {"train": "training_step", "val": "validation_step", "test": "test_step"}


class MetricsCallback(Callback):
    """Feed torchmetrics from the step outputs; compute them across ranks; log each once per interval.

    **The contract.** The LightningModule's ``training_step`` / ``validation_step`` / ``test_step``
    returns a dict holding the predictions under ``"preds"`` and the targets under ``"target"``
    (``training_step`` also returns ``"loss"`` as usual), or ``extract(outputs, batch)`` returns
    ``(preds, target)`` from whatever the step returns (and the batch). ``metric.update(preds, target)``
    is called for every batch, on every rank, with that rank's data only -- no collective per step.
    A step output without those keys is an error naming the step, the keys found and the ``return``
    line to write.

    **Logits.** ``preds`` may be logits: with ``logits="auto"`` (the default) the callback decides at
    the first batch of the run, on all ranks together, whether they are logits (a value outside
    ``[0, 1]``, or multiclass rows that do not sum to 1) and then applies the same transform to every
    batch -- a sigmoid for Binary*/Multilabel* metrics, a softmax over dim 1 for Multiclass* ones --
    and says which, once. torchmetrics alone guesses at every ``update()`` and takes a batch of logits
    that happens to lie inside ``[0, 1]`` as probabilities. ``logits=True`` always applies the
    transform, ``logits=False`` never does. Labels (integer ``preds``) pass unchanged.

    **When values are logged.** Training metrics accumulate over a window of ``log_every_n_steps``
    training batches (default: the Trainer's ``log_every_n_steps``), and over the rest of the epoch
    at its end; validation and test metrics accumulate over the whole evaluation epoch. At the end of
    a window every rank calls ``compute()``, which gathers the metric states of all ranks (torchmetrics'
    own sync), so the value equals what one process would compute on all ranks' data together; then the
    metrics are reset. Global rank 0 alone hands ``{"<stage>/<name>": value, "epoch": ...}`` to every
    logger of the Trainer, at ``step=trainer.global_step``: one row per window, whatever the number of
    processes. Every rank also puts the values in ``trainer.callback_metrics`` (so ``ModelCheckpoint``
    and ``EarlyStopping`` can monitor ``"val/<name>"``) and in :attr:`last_values`. Nothing is logged
    during the sanity check.

    **Exact results under DDP.** Lightning's ``DistributedSampler`` pads the last batch by repeating
    samples so that every rank has as many: metrics then count a few samples twice. To get exactly
    the single-process answer give each rank its own (uneven) part of the data and pass
    ``use_distributed_sampler=False`` (see ``docs/logging.md``). Training batches must still be as
    many on every rank (DDP needs it); evaluation ranks may differ in batch count but each rank needs
    at least one batch.

    Args:
        metrics: A torchmetrics ``Metric``, a ``MetricCollection``, or a dict of name to ``Metric`` (or
            a class path / ``{"class_path", "init_args"}`` dict, for YAML). Each stage gets its own copy.
        stages: Which of ``"train"``, ``"val"``, ``"test"`` to watch.
        extract: ``extract(outputs, batch) -> (preds, target)``; default reads the dict keys below.
        preds_key: The key of the predictions in the step's output dict.
        target_key: The key of the targets in the step's output dict.
        log_every_n_steps: Training window, in batches; ``None`` uses ``Trainer(log_every_n_steps=...)``.
        prefix: Put in front of each metric name; ``{stage}`` is replaced by the stage name.
        logits: ``"auto"``: decide at the first batch whether ``preds`` are logits, then treat every
            batch the same; ``True``: the steps return logits (sigmoid or softmax applied to every
            batch); ``False``: pass ``preds`` to the metrics as they are.

    Raises:
        LPluginsError: ``metrics``, ``stages``, ``log_every_n_steps``, ``prefix``, the keys or
            ``logits`` is not allowed (at construction: ``logits=True`` needs torchmetrics
            classification metrics of one kind); a step's output does not follow the contract, or
            ``logits="auto"`` took ``preds`` as probabilities and a later batch holds logits (at that batch).

    Example::

        import torchmetrics
        from lightning.pytorch import Trainer
        from lplugins.metrics import MetricsCallback

        class Model(LightningModule):
            def training_step(self, batch, batch_idx):
                x, y = batch
                logits = self(x)
                loss = F.cross_entropy(logits, y)
                return {"loss": loss, "preds": logits, "target": y}  # logits="auto" applies the softmax

        metrics = {"acc": torchmetrics.classification.MulticlassAccuracy(num_classes=10)}
        trainer = Trainer(callbacks=[MetricsCallback(metrics)])
    """

    def __init__(
        self,
        metrics: MetricsSpec,
        *,
        stages: Sequence[str] = ("train", "val"),
        extract: Extract | None = None,
        preds_key: str = "preds",
        target_key: str = "target",
        log_every_n_steps: int | None = None,
        prefix: str = "{stage}/",
        logits: LogitsMode = "auto",
    ) -> None:
        super().__init__()
        collection = _as_collection(metrics)
        if isinstance(stages, str) or not stages:
            raise LPluginsError(f"MetricsCallback(stages={stages!r}): give a non-empty list drawn from {STAGES}.")
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise LPluginsError(f"MetricsCallback(stages={list(stages)!r}): unknown {unknown}; allowed: {STAGES}.")
        positive_int("log_every_n_steps", log_every_n_steps, optional=True, owner="MetricsCallback")
        if len(set(stages)) > 1 and "{stage}" not in prefix:
            raise LPluginsError(
                f"MetricsCallback(prefix={prefix!r}): with several stages the prefix must contain '{{stage}}', "
                f"or the stages would log under the same names."
            )
        if extract is not None and not callable(extract):
            raise LPluginsError(
                f"MetricsCallback(extract={extract!r}): give a callable (outputs, batch) -> (preds, target)."
            )
        for key_name, key in (("preds_key", preds_key), ("target_key", target_key)):
            if not isinstance(key, str) or not key:
                raise LPluginsError(
                    f"MetricsCallback({key_name}={key!r}): give the (non-empty) key of the step's dict."
                )
        #: How preds reach the metrics (``logits=``): the transform, and once decided, whether it applies.
        self.logits_policy = LogitsPolicy(logits, transform_of(collection, logits))
        self.stages = tuple(dict.fromkeys(stages))
        self.extract = extract
        self.preds_key = preds_key
        self.target_key = target_key
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self.collections: dict[str, MetricCollection] = {
            stage: collection.clone(prefix=prefix.format(stage=stage)) for stage in self.stages
        }
        #: The values of the last window, per stage (``name -> float``), on every rank.
        self.last_values: dict[str, dict[str, float]] = {}
        self._train_batches = 0
        self._pending: dict[str, bool] = dict.fromkeys(self.stages, False)

    # ------------------------------------------------------------------------------ plumbing
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for collection in self.collections.values():
            collection.to(pl_module.device)
            collection.reset()

    def _update(self, stage: str, trainer: Trainer, outputs: Any, batch: Any) -> None:
        if self.extract is not None:
            pair = self.extract(outputs, batch)
            if not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2:
                raise LPluginsError(
                    f"MetricsCallback(extract=...) returned {_describe(pair)} for the {stage} step; it must return "
                    f"a pair (preds, target)."
                )
            preds, target = pair
        elif isinstance(outputs, Mapping) and self.preds_key in outputs and self.target_key in outputs:
            preds, target = outputs[self.preds_key], outputs[self.target_key]
        else:
            raise LPluginsError(self._contract_error(stage, outputs))
        if isinstance(preds, torch.Tensor):
            preds = preds.detach()
        if isinstance(target, torch.Tensor):
            target = target.detach()
        self.collections[stage].update(self.logits_policy(stage, preds, target, trainer), target)
        self._pending[stage] = True

    def _contract_error(self, stage: str, outputs: Any) -> str:
        method = _STEP_OF[stage]
        missing = ""
        if isinstance(outputs, Mapping):
            missing = f" (no {', '.join(repr(k) for k in (self.preds_key, self.target_key) if k not in outputs)})"
        loss = '"loss": loss, ' if stage == "train" else ""
        policy = self.logits_policy
        preds = "logits" if policy.transform is not None and policy.mode is not False else "preds"
        return (
            f"MetricsCallback feeds its metrics from what each {method} returns, and {method} ({stage} stage) "
            f"returned {_describe(outputs)}{missing}. End {method} with\n"
            f'    return {{{loss}"{self.preds_key}": {preds}, "{self.target_key}": y}}\n'
            f"(tensors are detached for you"
            + (f"; logits={policy.mode!r} turns logits into probabilities" if preds == "logits" else "")
            + "), or pass MetricsCallback(extract=lambda outputs, batch: (preds, target)) to read another shape, "
            f"or stages=[...] without {stage!r}."
        )

    def _emit(self, stage: str, trainer: Trainer) -> None:
        """Compute (a collective: every rank is here), reset, and log once on global rank 0."""
        collection = self.collections[stage]
        values = flatten_values(collection.compute())
        collection.reset()
        self._pending[stage] = False
        self.last_values[stage] = values
        device = trainer.strategy.root_device
        for name, value in values.items():
            trainer.callback_metrics[name] = torch.tensor(value, device=device)
        if trainer.is_global_zero and trainer.loggers:
            row = {**values, "epoch": float(trainer.current_epoch)}
            for logger in trainer.loggers:
                logger.log_metrics(row, step=trainer.global_step)

    # ------------------------------------------------------------------------------ training
    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if "train" in self.collections:
            self._train_batches = 0
            self.collections["train"].reset()
            self._pending["train"] = False

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if "train" not in self.collections:
            return
        self._update("train", trainer, outputs, batch)
        self._train_batches += 1
        if self._train_batches % window_length(trainer, self.log_every_n_steps) == 0:
            self._emit("train", trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if "train" in self.collections and self._pending["train"]:
            self._emit("train", trainer)

    # ------------------------------------------------------------------------------ evaluation
    # The same three steps for "val" and "test"; Lightning's hooks are bound to them at the end.
    def _eval_start(self, stage: str, trainer: Trainer, pl_module: LightningModule) -> None:
        if stage in self.collections:
            self.collections[stage].reset()
            self._pending[stage] = False

    def _eval_batch(
        self,
        stage: str,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if stage in self.collections and not trainer.sanity_checking:
            self._update(stage, trainer, outputs, batch)

    def _eval_end(self, stage: str, trainer: Trainer, pl_module: LightningModule) -> None:
        if stage in self.collections and not trainer.sanity_checking:
            self._emit(stage, trainer)

    on_validation_epoch_start = partialmethod(_eval_start, "val")
    on_validation_batch_end = partialmethod(_eval_batch, "val")
    on_validation_epoch_end = partialmethod(_eval_end, "val")
    on_test_epoch_start = partialmethod(_eval_start, "test")
    on_test_batch_end = partialmethod(_eval_batch, "test")
    on_test_epoch_end = partialmethod(_eval_end, "test")
