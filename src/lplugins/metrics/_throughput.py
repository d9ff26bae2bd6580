"""``ThroughputCallback``: samples/s (and tokens/s) of the whole job, measured across ranks."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lplugins._errors import LPluginsError
from lplugins._validate import positive_int
from lplugins.metrics._window import window_length


def infer_batch_size(batch: Any) -> int:
    """The size of the first dimension of the first tensor in ``batch`` (searched depth-first).

    Raises:
        LPluginsError: ``batch`` holds no tensor.

    Examples:
        >>> infer_batch_size({"x": torch.zeros(8, 3), "y": torch.zeros(8)})
        8
    """
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return int(item.shape[0]) if item.dim() else 1
        if isinstance(item, Mapping):
            stack[:0] = list(item.values())
        elif isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
            stack[:0] = list(item)
    raise LPluginsError(
        f"ThroughputCallback cannot find a tensor in a batch of type {type(batch).__name__}; pass "
        f"batch_size_fn=lambda batch: <number of samples>."
    )


class ThroughputCallback(Callback):
    """Measure training throughput of the whole job: samples/s, batches/s and (when told) tokens/s.

    Each rank counts the samples it trained on and the wall time of the window (data loading
    included). Every ``log_every_n_steps`` training batches, and at the end of each epoch, the ranks
    gather their counts with one ``all_gather`` (every rank is there, outside any rank-zero branch), and
    global rank 0 logs, through the Trainer's loggers, once:

    * ``throughput/samples_per_sec``: samples of all ranks / the slowest rank's wall time;
    * ``throughput/samples_per_sec_per_rank``: that divided by the number of ranks;
    * ``throughput/batches_per_sec``: training batches per second, per rank;
    * ``throughput/tokens_per_sec``: with ``seq_len`` (tokens = samples * seq_len) or ``tokens_fn``.

    Nothing but counting happens on the other steps; on CUDA the device is synchronised only at the
    window boundaries. The last values are kept in :attr:`last_values`.

    Args:
        log_every_n_steps: Window, in training batches; ``None`` uses the Trainer's ``log_every_n_steps``.
        seq_len: Tokens per sample, for ``tokens_per_sec``.
        tokens_fn: ``tokens_fn(batch) -> int`` for variable-length batches (instead of ``seq_len``).
        batch_size_fn: ``batch_size_fn(batch) -> int``; default: the first dimension of the first tensor.
        prefix: Put in front of the names.

    Raises:
        LPluginsError: an argument is not allowed.

    Example::

        trainer = Trainer(callbacks=[ThroughputCallback(seq_len=2048)])
    """

    def __init__(
        self,
        *,
        log_every_n_steps: int | None = None,
        seq_len: int | None = None,
        tokens_fn: Callable[[Any], int] | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
        prefix: str = "throughput/",
    ) -> None:
        super().__init__()
        for name, value in (("log_every_n_steps", log_every_n_steps), ("seq_len", seq_len)):
            positive_int(name, value, optional=True, owner="ThroughputCallback")
        if seq_len is not None and tokens_fn is not None:
            raise LPluginsError("ThroughputCallback: give seq_len or tokens_fn, not both.")
        for name, fn in (("tokens_fn", tokens_fn), ("batch_size_fn", batch_size_fn)):
            if fn is not None and not callable(fn):
                raise LPluginsError(f"ThroughputCallback({name}={fn!r}): give a callable batch -> int.")
        self.log_every_n_steps = log_every_n_steps
        self.seq_len = seq_len
        self.tokens_fn = tokens_fn
        self.batch_size_fn = batch_size_fn
        self.prefix = prefix
        #: The values of the last window (``name -> float``), on every rank.
        self.last_values: dict[str, float] = {}
        #: What the last window counted, all ranks together: ``samples``, ``tokens``, ``batches`` (per
        #: rank, the most), ``seconds`` (the slowest rank's), ``world_size``.
        self.last_counts: dict[str, float] = {}
        self._start = 0.0
        self._samples = 0
        self._tokens = 0
        self._batches = 0
        self._seen = 0

    def _reset_window(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._start = time.perf_counter()
        self._samples = self._tokens = self._batches = 0

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seen = 0
        self._reset_window(pl_module.device)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        size = self.batch_size_fn(batch) if self.batch_size_fn is not None else infer_batch_size(batch)
        self._samples += size
        if self.tokens_fn is not None:
            self._tokens += int(self.tokens_fn(batch))
        elif self.seq_len is not None:
            self._tokens += size * self.seq_len
        self._batches += 1
        self._seen += 1
        if self._seen % window_length(trainer, self.log_every_n_steps) == 0:
            self._emit(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._batches:
            self._emit(trainer, pl_module)

    def _emit(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = pl_module.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - self._start
        dtype = torch.float32 if device.type == "mps" else torch.float64
        local = torch.tensor([self._samples, self._tokens, self._batches, elapsed], dtype=dtype, device=device)
        gathered = trainer.strategy.all_gather(local).reshape(-1, 4).cpu()  # collective: every rank is here
        world = gathered.shape[0]
        slowest = max(float(gathered[:, 3].max()), 1e-12)
        samples_per_sec = float(gathered[:, 0].sum()) / slowest
        values = {
            f"{self.prefix}samples_per_sec": samples_per_sec,
            f"{self.prefix}samples_per_sec_per_rank": samples_per_sec / world,
            f"{self.prefix}batches_per_sec": float(gathered[:, 2].max()) / slowest,
        }
        if self.seq_len is not None or self.tokens_fn is not None:
            values[f"{self.prefix}tokens_per_sec"] = float(gathered[:, 1].sum()) / slowest
        self.last_values = values
        self.last_counts = {
            "samples": float(gathered[:, 0].sum()),
            "tokens": float(gathered[:, 1].sum()),
            "batches": float(gathered[:, 2].max()),
            "seconds": slowest,
            "world_size": float(world),
        }
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)
        self._reset_window(device)
