"""``MetricsCallback(logits=...)``: logits become probabilities the same way for the whole run.

torchmetrics' classification metrics guess at every ``update()`` whether ``preds`` are logits: only
when some value lies outside ``[0, 1]`` do they apply a sigmoid (binary, multilabel) or a softmax
(multiclass). A batch of logits that happens to lie inside ``[0, 1]`` is then taken as probabilities,
and the metric of the window is wrong. :class:`LogitsPolicy` decides once and applies the same
transform to every batch of the run, before torchmetrics sees it, so its guess never fires.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from torchmetrics import MetricCollection

from lplugins._errors import LPluginsError
from lplugins._log import announce

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["LogitsMode", "LogitsPolicy", "transform_of"]

#: ``True``: the steps return logits; ``False``: leave ``preds`` as they are; ``"auto"``: decide at the first batch.
LogitsMode = bool | Literal["auto"]

_KINDS = {"Binary": "sigmoid", "Multilabel": "sigmoid", "Multiclass": "softmax"}
#: How far a row of multiclass probabilities may sum from 1 (float16/bfloat16 softmax included).
_SUM_TOLERANCE = 1e-2


def _kind(metric: Any) -> str | None:
    """``"sigmoid"``/``"softmax"`` for a torchmetrics Binary*/Multilabel*/Multiclass* metric, else ``None``."""
    for cls in type(metric).__mro__:
        if cls.__module__.startswith("torchmetrics.classification"):
            for prefix, kind in _KINDS.items():
                if cls.__name__.startswith(prefix):
                    return kind
    return None


def transform_of(collection: MetricCollection, mode: LogitsMode) -> str | None:
    """The transform logits need for these metrics: ``"sigmoid"``, ``"softmax"`` or ``None``.

    Binary and multilabel classification metrics take a sigmoid, multiclass ones a softmax over the
    class dimension (dim 1, torchmetrics' ``(N, C, ...)`` layout). ``None`` when the collection holds
    no torchmetrics classification metric (nothing to turn into probabilities).

    Raises:
        LPluginsError: ``mode`` is not ``True``, ``False`` or ``"auto"``; ``mode=True`` with no
            classification metric; metrics that need both a sigmoid and a softmax.

    Examples:
        >>> import torchmetrics
        >>> transform_of(MetricCollection([torchmetrics.classification.BinaryAUROC()]), "auto")
        'sigmoid'
    """
    if mode not in (True, False, "auto") or not isinstance(mode, (bool, str)):
        raise LPluginsError(
            f"MetricsCallback(logits={mode!r}): give True, False or 'auto' (True: the steps return logits; "
            f"False: leave preds as they are; 'auto': decide at the first batch)."
        )
    kinds = {name: _kind(metric) for name, metric in collection.items(keep_base=True)}
    found = {kind for kind in kinds.values() if kind is not None}
    if len(found) > 1:
        if mode is False:
            return None
        by_kind = {k: sorted(n for n, v in kinds.items() if v == k) for k in sorted(found)}
        raise LPluginsError(
            f"MetricsCallback(logits={mode!r}): the metrics need both sigmoid ({by_kind['sigmoid']}) and softmax "
            f"({by_kind['softmax']}) on the same preds; use one MetricsCallback per kind, or pass logits=False "
            f"and return probabilities."
        )
    if not found and mode is True:
        raise LPluginsError(
            f"MetricsCallback(logits=True): the metrics {sorted(kinds)} hold no torchmetrics classification metric "
            f"(Binary*, Multiclass*, Multilabel*), so there is no sigmoid or softmax to apply; pass logits=False, "
            f"or turn preds into what the metrics expect with extract=...."
        )
    return next(iter(found), None)


class LogitsPolicy:
    """Turn logits into probabilities, decided once for the whole run.

    Args:
        mode: ``True``, ``False`` or ``"auto"`` (see :class:`~lplugins.metrics.MetricsCallback`).
        transform: ``"sigmoid"``, ``"softmax"`` or ``None``, from :func:`transform_of`.
    """

    def __init__(self, mode: LogitsMode, transform: str | None) -> None:
        self.mode = mode
        self.transform = transform
        #: ``True``: apply the transform to every batch; ``False``: never; ``None``: not decided yet.
        self.logits: bool | None = None if mode == "auto" and transform is not None else bool(mode and transform)
        self._from_scores = False  # "auto" decided "probabilities" from float scores

    def _applies_to(self, preds: Any, target: Any) -> bool:
        """Whether ``preds`` are scores the transform is for (float; a class dim for softmax)."""
        if not isinstance(preds, torch.Tensor) or not preds.is_floating_point():
            return False
        if self.transform == "softmax":
            return isinstance(target, torch.Tensor) and preds.ndim == target.ndim + 1
        return True

    def _look_like_logits(self, preds: torch.Tensor) -> bool:
        if preds.numel() and bool(((preds < 0) | (preds > 1)).any()):
            return True
        if self.transform == "softmax" and preds.numel():
            return not torch.allclose(preds.sum(1), torch.ones((), dtype=preds.dtype), atol=_SUM_TOLERANCE)
        return False

    def __call__(self, stage: str, preds: Any, target: Any, trainer: Trainer) -> Any:
        """Return ``preds`` as the metrics should see them (deciding at the first call in ``"auto"`` mode).

        Raises:
            LPluginsError: ``logits=True`` with preds that are not float scores; ``"auto"`` decided
                "probabilities" and a later batch holds a value outside ``[0, 1]``.
        """
        applies = self._applies_to(preds, target)
        if self.logits is None:
            self._decide(stage, preds, target, applies, trainer)
        if self.logits:
            if not applies:
                raise LPluginsError(self._not_scores(stage, preds, target))
            return preds.sigmoid() if self.transform == "sigmoid" else preds.softmax(1)
        if self._from_scores and applies and preds.numel() and bool(((preds < 0) | (preds > 1)).any()):
            raise LPluginsError(
                f"MetricsCallback(logits='auto') took preds as probabilities at the first batch (all values in "
                f"[0, 1]), but the {stage} step now returned preds with values outside [0, 1] "
                f"(min {float(preds.min()):.4g}, max {float(preds.max()):.4g}): they are logits. Pass "
                f"MetricsCallback(logits=True) when the steps return logits, or return probabilities "
                f"(logits.{self.transform}(...)) from every step."
            )
        return preds

    def _decide(self, stage: str, preds: Any, target: Any, applies: bool, trainer: Trainer) -> None:
        # every rank is here at the same batch (its first update of the run): one collective decides for all
        local = applies and self._look_like_logits(preds)
        self.logits = bool(trainer.strategy.reduce_boolean_decision(local, all=False))
        if self.logits:
            how = "sigmoid" if self.transform == "sigmoid" else "softmax over dim 1"
            announce(
                "lplugins: MetricsCallback(logits='auto') treats preds as logits for the whole run (the first %s "
                "batch has values outside [0, 1]%s): %s applied to every batch. Pass logits=False or True to choose.",
                stage,
                " or rows that do not sum to 1" if self.transform == "softmax" else "",
                how,
            )
        elif applies:
            self._from_scores = True
            announce(
                "lplugins: MetricsCallback(logits='auto') passes preds to the metrics unchanged for the whole run "
                "(the first %s batch holds probabilities: values in [0, 1]%s). Pass logits=True if the steps "
                "return logits.",
                stage,
                ", rows summing to 1" if self.transform == "softmax" else "",
            )
        else:
            announce(
                "lplugins: MetricsCallback(logits='auto') passes preds to the metrics unchanged for the whole run "
                "(the first %s batch's preds are not float scores%s: labels).",
                stage,
                " with a class dimension" if self.transform == "softmax" else "",
            )

    def _not_scores(self, stage: str, preds: Any, target: Any) -> str:
        what = (
            f"a {preds.dtype} tensor of shape {tuple(preds.shape)}"
            if isinstance(preds, torch.Tensor)
            else type(preds).__name__
        )
        need = "float logits" + (
            " of shape (N, C, ...), one more dim than target" if self.transform == "softmax" else ""
        )
        shape = f" (target: {tuple(target.shape)})" if isinstance(target, torch.Tensor) else ""
        return (
            f"MetricsCallback(logits={self.mode!r}) applies a {self.transform} to preds, but the {stage} step returned "
            f"preds as {what}{shape}; return {need}, or pass logits=False for labels or probabilities."
        )
