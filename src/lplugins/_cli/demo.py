"""``lplugins demo``: a short run that exercises every built-in plugin on CPU.

The data are generated (three interleaved spirals, fixed seed): lplugins ships no data set and the
demo must run without network. The model is a small MLP classifier.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import math
import time
from pathlib import Path
from typing import Any

DEFAULT_SCHEDULE = {
    "name": "ramp",
    "start": 64,
    "target": 256,
    "over": 6000,
    "unit": "samples",
    "kind": "stepwise",
    "increment": 64,
}


def add_parser(sub: Any) -> None:
    """Add the ``demo`` subcommand to the ``lplugins`` command's subparsers."""
    p = sub.add_parser(
        "demo",
        help="train a small model with every built-in plugin (2-process DDP on CPU)",
        description=(
            "Train a small MLP on generated data (three interleaved spirals; lplugins ships no data set) with "
            "2-process DDP on CPU by default, using a plugin-registered strategy by name, precision='auto', a "
            "global-batch ramp, durable checkpoints and rank-zero-safe metric logging. Writes CSV logs (and "
            "TensorBoard when installed), checkpoints and a PNG plot to --out, then prints a summary. Run it again "
            "with --resume (and more --epochs) to continue from the latest valid checkpoint."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--devices", type=int, default=2, help="CPU processes (world size)")
    p.add_argument("--strategy", default="ddp_timeout", help="strategy name (see `lplugins list`)")
    p.add_argument("--precision", default="auto", help="precision name; 'auto' picks for the hardware")
    p.add_argument(
        "--schedule",
        default=json.dumps(DEFAULT_SCHEDULE),
        help="accumulation: an int, an epoch dict such as '{0: 4, 2: 2}', a schedule name, or "
        "'{\"name\": ..., **params}'",
    )
    p.add_argument("--epochs", type=int, default=6, help="epochs to train in total")
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps (-1: no limit)")
    p.add_argument("--samples", type=int, default=3072, help="training samples to generate")
    p.add_argument("--batch-size", type=int, default=32, help="micro-batch size per process")
    p.add_argument("--out", default="lplugins-demo", help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from the latest valid checkpoint in --out")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.set_defaults(func=run)


def _parse_schedule(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a schedule name
    if isinstance(value, dict) and "name" not in value:
        value = {int(k): v for k, v in value.items()}
    return value


def spirals(n: int, seed: int, classes: int = 3, noise: float = 0.15) -> tuple[Any, Any]:
    """``n`` points of ``classes`` interleaved spirals in 2-D, with labels (deterministic)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    per = math.ceil(n / classes)
    xs, ys = [], []
    for c in range(classes):
        r = torch.linspace(0.05, 1.0, per)
        t = torch.linspace(c * 4.0, (c + 1) * 4.0, per) + noise * torch.randn(per, generator=g)
        xs.append(torch.stack([r * torch.sin(t), r * torch.cos(t)], dim=1))
        ys.append(torch.full((per,), c, dtype=torch.long))
    x, y = torch.cat(xs)[:n], torch.cat(ys)[:n]
    perm = torch.randperm(len(x), generator=g)
    return x[perm], y[perm]


def _build(args: argparse.Namespace, out: Path) -> tuple[Any, Any, Any, dict[str, Any]]:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    import torchmetrics
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    import lplugins
    from lplugins import _lightning
    from lplugins.accumulation import AccumulationScheduler
    from lplugins.precision._auto import choose_precision, probe_capabilities

    class SpiralClassifier(pl.LightningModule):
        def __init__(self, lr: float = 0.01) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.lr = lr
            self.net = torch.nn.Sequential(
                torch.nn.Linear(2, 64),
                torch.nn.Tanh(),
                torch.nn.Linear(64, 64),
                torch.nn.Tanh(),
                torch.nn.Linear(64, 3),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            x, y = batch
            logits = self(x)
            loss = F.cross_entropy(logits, y)
            self.log("train/loss", loss, prog_bar=True)
            return {"loss": loss, "preds": logits.detach(), "target": y}

        def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            x, y = batch
            logits = self(x)
            self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
            return {"preds": logits, "target": y}

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=self.lr)

    class FactorRecorder(pl.Callback):
        """Logs the accumulation factor at every optimizer step, for the plot (rank 0 only)."""

        def on_train_batch_end(self, trainer: pl.Trainer, *rest: Any) -> None:
            sched = AccumulationScheduler.of(trainer)
            if trainer.is_global_zero and sched.is_boundary:
                for logger in trainer.loggers:
                    logger.log_metrics({"demo/accumulation_factor": float(sched.factor)}, step=trainer.global_step)

    x, y = spirals(args.samples + args.samples // 5, args.seed)
    n_train = args.samples
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=256)

    loggers: list[Any] = [CSVLogger(out, name="logs")]  # a new version per run: a resume never overwrites logs
    try:
        import tensorboard  # noqa: F401
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(out, name="tensorboard"))
    except ImportError:
        pass

    accelerator = "cpu"
    chosen, reason = (args.precision, "given on the command line")
    if args.precision == "auto":
        chosen, reason = choose_precision(accelerator, probe_capabilities(accelerator), lplugins.get_manager())
    kwargs = lplugins.compose(
        strategy=args.strategy,
        accelerator=accelerator,
        devices=args.devices,
        precision=args.precision,
        accumulate_grad_batches=args.schedule_value,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        callbacks=[
            {"name": "durable_checkpoint", "dirpath": str(out / "checkpoints"), "every_n_steps": 20, "keep_last": 2},
            {
                "name": "metrics",
                "metrics": {"acc": torchmetrics.classification.MulticlassAccuracy(num_classes=3)},
                "stages": ("train", "val"),
            },
            FactorRecorder(),
        ],
        logger=loggers,
        default_root_dir=str(out),
        log_every_n_steps=5,
        enable_model_summary=False,
    )
    info = {"precision": chosen, "precision_reason": reason, "loggers": [type(lg).__name__ for lg in loggers]}
    # Lightning's advertisement for its cloud logger is not the demo's business (its own words, exactly)
    unhide = _lightning.hide_lightning_info(_lightning.LITLOGGER_TIP)
    try:
        trainer = pl.Trainer(**kwargs)
    finally:
        unhide()
    return trainer, SpiralClassifier(), (train, val), info


def plot(metrics_csvs: list[Path], png: Path, title: str = "lplugins demo") -> bool:
    """Plot loss, accuracy and accumulation factor from the CSV logs of every run (the first run and
    its resumes) under ``title``; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [row for path in metrics_csvs for row in csv.DictReader(path.open())]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for ax, keys, label in (
        (axes[0], ("train/loss", "val/loss"), "cross-entropy loss"),
        (axes[1], ("train/acc", "val/acc"), "accuracy (synced)"),
        (axes[2], ("demo/accumulation_factor",), "micro-batches / step"),
    ):
        for key in keys:
            pts = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=key, drawstyle="steps-post" if "factor" in key else "default")
        ax.set_ylabel(label)
        ax.legend(loc="best")
    axes[2].set_xlabel("optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad flags with one line naming the flag, before anything is imported or started.

    Raises:
        LPluginsError: a flag's value is not allowed (``lplugins`` prints it as one line, exit status 2).
    """
    from lplugins._errors import LPluginsError
    from lplugins._validate import positive_int

    for flag, minimum in (("devices", 1), ("epochs", 1), ("samples", 2), ("batch_size", 1)):
        value = getattr(args, flag)
        if value < minimum:
            raise LPluginsError(
                f"demo: --{flag.replace('_', '-')} {value} is not allowed; it must be an int >= {minimum}."
            )
    if args.max_steps != -1:
        try:
            positive_int("max_steps", args.max_steps)
        except LPluginsError:
            raise LPluginsError(
                f"demo: --max-steps {args.max_steps} is not allowed; it must be -1 (no limit) or an int >= 1."
            ) from None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise LPluginsError(f"demo: --out {args.out} is a file; give a directory (it is created if missing).")
    try:
        args.schedule_value = _parse_schedule(args.schedule)
    except (ValueError, TypeError) as exc:
        raise LPluginsError(
            f"demo: --schedule {args.schedule!r} is not understood ({exc}); give an int, an epoch dict such as "
            "'{0: 4, 2: 2}', a schedule name, or '{\"name\": ..., **params}'."
        ) from None


def run(args: argparse.Namespace) -> int:
    """Run the demo (all ranks run this function; rank 0 reports).

    Raises:
        LPluginsError: a bad flag (:func:`check_args`) or a composition error, before training starts.
    """
    check_args(args)
    import warnings

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*isinstance.*LeafSpec.*")
    import lightning.pytorch as pl

    from lplugins.callbacks import latest_checkpoint

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(args.seed, verbose=False)
    started = time.perf_counter()
    ckpt_path = None
    if args.resume:
        found = latest_checkpoint(out / "checkpoints")
        if found is None:
            raise SystemExit(f"lplugins demo: --resume given but no valid checkpoint in {out / 'checkpoints'}")
        ckpt_path = "latest"
    trainer, model, (train, val), info = _build(args, out)
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    if not trainer.is_global_zero:
        return 0
    metrics_csv = Path(trainer.loggers[0].log_dir) / "metrics.csv"
    runs = sorted((out / "logs").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    png = out / "demo.png"
    plotted = plot(
        runs, png, f"lplugins demo: {args.strategy} ({type(trainer.strategy).__name__}), precision {info['precision']}"
    )
    val_acc = trainer.callback_metrics.get("val/acc")
    latest = latest_checkpoint(out / "checkpoints")
    lines = [
        "",
        "lplugins demo: done in %.1f s" % (time.perf_counter() - started),
        f"  data:        {args.samples} generated points, 3 interleaved spirals (seed {args.seed}); no download",
        f"  strategy:    {args.strategy} -> {type(trainer.strategy).__name__}, {trainer.world_size} CPU process(es)",
        f"  precision:   {args.precision} -> {info['precision']} ({info['precision_reason']})",
        f"  schedule:    {args.schedule}",
        f"  steps:       {trainer.global_step} optimizer steps, {trainer.current_epoch} epochs",
        f"  val/acc:     {float(val_acc):.3f}" if val_acc is not None else "  val/acc:     (not computed)",
        f"  logs:        {metrics_csv}",
        f"  tensorboard: tensorboard --logdir {out / 'tensorboard'}"
        if "TensorBoardLogger" in info["loggers"]
        else "  tensorboard: not installed (pip install tensorboard, or the demo extra)",
        f"  checkpoints: {out / 'checkpoints'} (latest valid: {Path(latest).name if latest else 'none'})",
        f"  plot:        {png}" if plotted else "  plot:        skipped (pip install matplotlib for a PNG plot)",
        f"  resume with: lplugins demo --resume --out {args.out} --epochs {args.epochs + 2}",
    ]
    print("\n".join(lines), flush=True)
    return 0


__all__ = ["add_parser", "check_args", "plot", "run", "spirals"]
