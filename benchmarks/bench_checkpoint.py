"""Benchmark DurableCheckpoint against stock Lightning in the same run (CPU, one process).

Measures, as ratios:

* durable sync save time (default, and with ``crc32=False``) vs stock ``trainer.save_checkpoint`` (what
  ``ModelCheckpoint`` calls) on the
  same model and trainer (goal <= 1.1x);
* durable sync save bandwidth vs the disk's fsync write bandwidth from ``dd ... conv=fsync`` of the
  same number of bytes in the same directory (goal >= 0.9x);
* async mode's training stall per save (the snapshot, plus any wait for its deferred copies before the
  next optimizer step) vs the sync save's stall, in real training (goal <= 0.1x); and the end-to-end
  extra fit time per save of both;
* per-step time on steps without a save vs the same Trainer with stock ``ModelCheckpoint`` (goal <= 1.02x;
  the fastest of ``--reps`` interleaved runs of each);
* resume: loading the newest checkpoint through ``ckpt_path="latest"`` with every byte verified against
  its CRC32 on a second thread (the default; the file memory-mapped, ``torch.load(mmap=True)``) vs stock
  Lightning's ``torch.load(weights_only=True)`` unverified (goal <= 1.1x), vs the same mapped load
  unverified (lazy: it reads almost nothing, so this ratio is the cost of reading every byte once), vs
  ``dd`` reading the same file (goal >= 0.8x bandwidth, page cache warm for both), and ``verify="deep"``
  (checked before loading) for reference; and the whole ``fit(ckpt_path="latest")`` + one step (the
  state copied into the model and optimizer) verified vs unverified;
* a directory checkpoint's per-file CRC32s computed at commit (the checkpoint saved as three files, as a
  sharded strategy writes it) vs writing those files.

Usage::

    python benchmarks/bench_checkpoint.py [--dir DIR] [--mb 120] [--reps 5] [--save-reps 15]

Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._crc import CRC32_IMPLEMENTATION
from lplugins.callbacks._prefault import wait_for_prefaults
from lplugins.callbacks._resume import LatestResolver, load_weights_only
from lplugins.callbacks._safe_io import mapped_load
from lplugins.callbacks._storages import open_storage
from lplugins.callbacks._verify import hash_threads
from lplugins.callbacks._writer import tree_crc32s


def resume_times(trainer: Trainer, dirpath: str, reps: int) -> dict[str, float]:
    """Median seconds of loading the newest checkpoint in ``dirpath``: verified (default), unverified, deep.

    The same file each time, so all three read it from the page cache (as a resume right after the save
    does); the order alternates. "Verified" is the whole ``"latest"`` path (markers, size and archive
    check, the CRC32 thread, the cross-check); "unverified" is only the load it wraps. A mapped load's
    background prefault of the optimizer state (``_prefault``) is waited for after each, untimed: a
    resume loads once, and what that thread costs shows in the whole-resume figure.
    """
    io = trainer.strategy.checkpoint_io
    inner = io.inner  # type: ignore[attr-defined]
    path = open_storage(dirpath).path(open_storage(dirpath).find_committed()[-1].name)
    deep = LatestResolver(trainer, dirpath, deep=True)
    runs: dict[str, Any] = {
        "verified": lambda: io.load_checkpoint("latest"),
        "unverified": lambda: load_weights_only(inner, path),
        "unverified_mapped": lambda: mapped_load(path),
        "deep": lambda: deep.load("latest", lambda p: load_weights_only(inner, p)),
        "dd_read": lambda: dd_read_seconds(path),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    quiet = logging.getLogger("lplugins")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        runs["unverified"]()  # the page cache warm for all
        order = list(runs)
        for rep in range(reps):
            for name in order if rep % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                own = runs[name]()
                times[name].append(own if name == "dd_read" else time.perf_counter() - start)
                del own
                wait_for_prefaults()  # a mapped load's background prefault ends before the next load is timed
    finally:
        quiet.setLevel(level)
    paired = statistics.median(d / v for d, v in zip(times["dd_read"], times["verified"], strict=True))
    return {
        **{k: statistics.median(v) for k, v in times.items()},
        **{f"{k}_min": min(v) for k, v in times.items()},
        "verified_vs_dd_paired": paired,  # each repetition's dd over its own verified load: the machine's drift cancels
    }


def resume_fit_times(width: int, depth: int, dirpath: str, root: str, reps: int) -> dict[str, float]:
    """Median seconds of a whole ``trainer.fit(model, ckpt_path="latest")`` that resumes and runs one step.

    "verified": the newest checkpoint in ``dirpath`` as committed; "unverified": the same bytes under a
    marker without checksums (as ``crc32=False`` writes for a directory checkpoint, the one case a resume
    cannot verify), in a copy of the directory. Trainer construction, setup, restore and the step included.
    """
    storage = open_storage(dirpath)
    record = storage.find_committed()[-1]
    plain = os.path.join(root, "unverified")
    os.makedirs(plain, exist_ok=True)
    shutil.copyfile(storage.path(record.name), os.path.join(plain, record.name))
    record.crc32, record.zip_crc = None, False
    open_storage(plain).commit(record)
    quiet = logging.getLogger("lplugins")
    level = quiet.level
    quiet.setLevel(logging.WARNING)

    def fit(d: str) -> float:
        model = Model(width, depth)
        trainer = trainer_with(
            DurableCheckpoint(d, every_n_steps=10**9, keep_last=None, save_on_train_end=False),
            max_steps=record.global_step + 1,
        )
        start = time.perf_counter()
        trainer.fit(model, data(width, 8), ckpt_path="latest")
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"verified": [], "unverified": []}
    try:
        for rep in range(reps):
            for name in ("verified", "unverified") if rep % 2 == 0 else ("unverified", "verified"):
                times[name].append(fit(dirpath if name == "verified" else plain))
    finally:
        quiet.setLevel(level)
    return {k: statistics.median(v) for k, v in times.items()}


def dir_crc_cost(checkpoint: dict[str, Any], root: str, reps: int) -> tuple[float, float]:
    """(seconds to write ``checkpoint`` as three fsync-ed files, seconds for their CRC32s at commit): medians."""
    moments = checkpoint["optimizer_states"][0]["state"]  # Adam's, split as two ranks' shards
    keys = sorted(moments)
    parts = {
        "model_states.pt": checkpoint["state_dict"],
        "optim_rank0.pt": {k: moments[k] for k in keys[: len(keys) // 2]},
        "optim_rank1.pt": {k: moments[k] for k in keys[len(keys) // 2 :]},
    }
    storage = open_storage(root)
    writes, crcs = [], []
    for rep in range(reps):
        name = f"dirckpt{rep}"
        os.makedirs(os.path.join(root, name))
        start = time.perf_counter()
        for file, obj in parts.items():
            target = os.path.join(root, name, file)
            torch.save(obj, target)
            fd = os.open(target, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        writes.append(time.perf_counter() - start)
        start = time.perf_counter()
        tree_crc32s(storage, name, list(parts))
        crcs.append(time.perf_counter() - start)
        shutil.rmtree(os.path.join(root, name))
    return statistics.median(writes), statistics.median(crcs)


class Model(LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.body(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def trainer_with(cb: Any, max_steps: int) -> Trainer:
    return Trainer(
        accelerator="cpu", max_steps=max_steps, callbacks=[cb], logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip


def data(width: int, n: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, width)), batch_size=2)


def dd_bandwidth(directory: str, nbytes: int) -> float:
    """Bytes per second of ``dd if=/dev/zero bs=1M conv=fsync`` writing ``nbytes`` into ``directory``."""
    target = os.path.join(directory, "dd.bench")
    count = max(1, nbytes // (1 << 20))
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "conv=fsync"],
        check=True, capture_output=True,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    os.unlink(target)
    return count * (1 << 20) / elapsed


def dd_read_seconds(path: str) -> float:
    """Seconds ``dd if=path of=/dev/null bs=8M`` took, as dd reports it."""
    done = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M"], check=True, capture_output=True, text=True)
    # "... bytes (...) copied, 0.0228 s, 5.5 GB/s" (GNU coreutils)
    return float(done.stderr.strip().splitlines()[-1].split(", ")[-2].split()[0])


def resume_figures(resume: dict[str, float], dir_write_s: float, dir_crc_s: float) -> dict[str, float]:
    """The resume and directory-CRC figures (the medians, and the ratio of the fastest runs)."""
    return {
        "resume_unverified_s": round(resume["unverified"], 4),
        "resume_verified_s": round(resume["verified"], 4),
        "resume_verified_vs_unverified_ratio": round(resume["verified"] / resume["unverified"], 3),
        "resume_fastest_verified_vs_unverified_ratio": round(resume["verified_min"] / resume["unverified_min"], 3),
        "resume_unverified_mapped_s": round(resume["unverified_mapped"], 4),
        "resume_verified_vs_unverified_mapped_ratio": round(resume["verified"] / resume["unverified_mapped"], 3),
        "resume_deep_s": round(resume["deep"], 4),
        "resume_deep_vs_unverified_ratio": round(resume["deep"] / resume["unverified"], 3),
        "dd_read_s": round(resume["dd_read"], 4),
        "resume_verified_vs_dd_read_bandwidth_ratio": round(resume["dd_read"] / resume["verified"], 3),
        "resume_verified_vs_dd_read_bandwidth_paired_ratio": round(resume["verified_vs_dd_paired"], 3),
        "dir_write_s": round(dir_write_s, 4),
        "dir_crc_at_commit_s": round(dir_crc_s, 4),
        "dir_crc_vs_write_ratio": round(dir_crc_s / dir_write_s, 3),
    }


def fit_figures(fits: dict[str, float]) -> dict[str, float]:
    """The whole-fit resume figures."""
    return {
        "resume_fit_unverified_s": round(fits["unverified"], 4),
        "resume_fit_verified_s": round(fits["verified"], 4),
        "resume_fit_verified_vs_unverified_ratio": round(fits["verified"] / fits["unverified"], 3),
    }


def print_resume(result: dict[str, Any]) -> None:
    print(
        f"  resume (load of the newest, page cache warm): verified while loading {result['resume_verified_s']:.3f}s"
        f" vs unverified {result['resume_unverified_s']:.3f}s -> {result['resume_verified_vs_unverified_ratio']}x"
        f" (goal <= 1.1; fastest runs {result['resume_fastest_verified_vs_unverified_ratio']}x);"
        f" verify='deep' (before loading) {result['resume_deep_s']:.3f}s"
        f" -> {result['resume_deep_vs_unverified_ratio']}x;"
        f" unverified mapped (lazy) {result['resume_unverified_mapped_s']:.3f}s"
        f" -> {result['resume_verified_vs_unverified_mapped_ratio']}x"
    )
    print(
        f"  verified load bandwidth / dd read bandwidth of the same file (same cache state):"
        f" {result['resume_verified_vs_dd_read_bandwidth_ratio']}x (goal >= 0.8; dd {result['dd_read_s']:.3f}s)"
    )
    if "resume_fit_verified_s" in result:
        print(
            f"  whole resume, fit(ckpt_path='latest') + 1 step: verified {result['resume_fit_verified_s']:.3f}s vs"
            f" unverified {result['resume_fit_unverified_s']:.3f}s"
            f" -> {result['resume_fit_verified_vs_unverified_ratio']}x"
        )
    print(
        f"  directory checkpoint (3 files): CRC32s at commit {result['dir_crc_at_commit_s']:.3f}s vs writing them"
        f" {result['dir_write_s']:.3f}s -> +{result['dir_crc_vs_write_ratio']}x"
    )


def resume_only(root: str, width: int, depth: int, reps: int) -> None:
    """``--resume-only``: one checkpoint, then the resume and directory-CRC figures."""
    durable = DurableCheckpoint(os.path.join(root, "durable"), keep_last=1, save_on_train_end=False)
    trainer = trainer_with(durable, max_steps=1)
    model = Model(width, depth)
    trainer.fit(model, data(width, 8))
    durable.setup(trainer, model, "fit")
    durable._save(trainer, "bench")
    resume = resume_times(trainer, durable.dirpath or "", reps)
    write_s, crc_s = dir_crc_cost(torch.load(durable.committed[-1], weights_only=True), root, max(3, reps // 3))
    durable.teardown(trainer, model, "fit")
    fits = resume_fit_times(width, depth, durable.dirpath or "", root, max(3, reps // 3))
    result: dict[str, Any] = {
        "checkpoint_mb": round(os.path.getsize(durable.committed[-1]) / 1e6, 1),
        "model_width": width,
        "checkpoint_tensors": 8 * depth,
        **resume_figures(resume, write_s, crc_s),
        **fit_figures(fits),
        "hash_threads": hash_threads(),
        "crc32_implementation": CRC32_IMPLEMENTATION,
        "reps": reps,
    }
    print(f"checkpoint {result['checkpoint_mb']} MB, median of {reps} loads:")
    print_resume(result)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--mb", type=float, default=120.0, help="approximate checkpoint size in MB")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the training runs")
    parser.add_argument("--save-reps", type=int, default=15, help="repetitions of the save-time measurements")
    parser.add_argument("--steps", type=int, default=300, help="steps for the per-step overhead run")
    parser.add_argument("--train-steps", type=int, default=100, help="steps of each fit of the async-stall runs")
    parser.add_argument("--save-every", type=int, default=10, help="save interval (steps) of the async-stall runs")
    parser.add_argument(
        "--width",
        type=int,
        default=512,
        help="width of the model's square layers (the checkpoint has 8 tensors per"
        " layer, weight, bias and their Adam state: torch.load's cost per tensor shows against dd with narrow layers)",
    )
    parser.add_argument("--resume-only", action="store_true", help="only the resume and directory-CRC figures")
    args = parser.parse_args()
    torch.manual_seed(0)
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    # parameters + 2 Adam moments, fp32: 12 bytes per parameter
    width = args.width
    depth = max(1, int(args.mb * 1e6 / 12 / (width * width + width)))
    if args.resume_only:
        try:
            resume_only(root, width, depth, args.save_reps)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    try:
        # ---------------------------------------------------------------- save time, same trainer
        durable = DurableCheckpoint(os.path.join(root, "durable"), keep_last=1, save_on_train_end=False)
        trainer = trainer_with(durable, max_steps=1)
        model = Model(width, depth)
        trainer.fit(model, data(width, 8))
        no_crc = DurableCheckpoint(os.path.join(root, "no_crc"), keep_last=1, save_on_train_end=False, crc32=False)
        # both in the state they have during fit (the fit above tore `durable` down: set it up again)
        durable.setup(trainer, model, "fit")
        no_crc.setup(trainer, model, "fit")
        stock_dir = os.path.join(root, "stock")
        os.makedirs(stock_dir)
        stock_times: list[float] = []
        durable_times: list[float] = []
        no_crc_times: list[float] = []
        dd_rates: list[float] = []
        sizes: list[int] = []
        for rep in range(args.save_reps):
            path = os.path.join(stock_dir, f"{rep}.ckpt")
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            stock_times.append(time.perf_counter() - start)
            os.unlink(path)
            # a new global step, so a new checkpoint name
            trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed += 1
            pair = [(durable, durable_times), (no_crc, no_crc_times)]
            for cb, times in pair if rep % 2 == 0 else pair[::-1]:  # alternate the order
                start = time.perf_counter()
                cb._save(trainer, "bench")
                times.append(time.perf_counter() - start)
            sizes.append(os.path.getsize(durable.committed[-1]))
            dd_rates.append(dd_bandwidth(root, sizes[-1]))
        size = statistics.median(sizes)

        # ---------------------------------------------------------------- resume: verified vs not
        resume = resume_times(trainer, durable.dirpath or "", args.save_reps)
        dir_write_s, dir_crc_s = dir_crc_cost(
            torch.load(durable.committed[-1], weights_only=True), root, max(3, args.save_reps // 3)
        )
        durable.teardown(trainer, model, "fit")
        fits = resume_fit_times(width, depth, durable.dirpath or "", root, max(3, args.save_reps // 3))
        no_crc.teardown(trainer, model, "fit")
        stock_s, durable_s, no_crc_s, dd_bps = (
            statistics.median(v) for v in (stock_times, durable_times, no_crc_times, dd_rates)
        )

        # ---------------------------------------------------------------- async stall, in training
        # Three fits of the same model, interleaved --reps times: no saves, sync saves, async saves every
        # --save-every steps. The stall is what the callback records: the time the training thread is
        # blocked by a save (for async saves: taking the snapshot, plus waiting for its deferred copies
        # before the next optimizer step). The end-to-end cost per save is the extra wall time of the
        # whole fit over the fit without saves (fastest run of each), divided by the number of saves.
        def fit_time(cb: DurableCheckpoint | None) -> float:
            torch.manual_seed(0)
            t = Trainer(
                accelerator="cpu", max_steps=args.train_steps, callbacks=[cb] if cb else [], logger=False,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=cb is not None,
            )  # fmt: skip
            start = time.perf_counter()
            t.fit(Model(width, depth), data(width, 2 * args.train_steps))
            return time.perf_counter() - start

        fits: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        stalls: dict[str, list[float]] = {"sync": [], "async": []}
        first_async: list[float] = []
        for rep in range(args.reps):
            fits["none"].append(fit_time(None))
            for mode in ("sync", "async"):
                cb = DurableCheckpoint(
                    os.path.join(root, f"{mode}{rep}"), every_n_steps=args.save_every, keep_last=1,
                    save_on_train_end=False, async_save=mode == "async",
                )  # fmt: skip
                fits[mode].append(fit_time(cb))
                stalls[mode] += cb.save_stalls[1:]  # the first save allocates the CPU buffers
                if mode == "async":
                    first_async.append(cb.save_stalls[0])
        saves = args.train_steps // args.save_every
        sync_stall_s, stall_s = statistics.median(stalls["sync"]), statistics.median(stalls["async"])
        first_stall_s = statistics.median(first_async)
        base = min(fits["none"])
        sync_e2e_s, async_e2e_s = ((min(fits[m]) - base) / saves for m in ("sync", "async"))
        train_step_s = base / args.train_steps

        # ---------------------------------------------------------------- per-step overhead, no saves
        def step_time(cb: Any) -> tuple[float, float]:
            """(seconds per step, seconds per step inside the callback's on_train_batch_end)."""
            hook = cb.on_train_batch_end
            spent = [0.0]

            def timed(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return hook(*a, **k)
                finally:
                    spent[0] += time.perf_counter() - t0

            cb.on_train_batch_end = timed
            small = Model(64, 2)
            t = trainer_with(cb, max_steps=args.steps)
            start = time.perf_counter()
            t.fit(small, data(64, 2 * args.steps))
            return (time.perf_counter() - start) / args.steps, spent[0] / args.steps

        stock_runs, durable_runs = [], []
        for _ in range(args.reps):
            stock_runs.append(step_time(ModelCheckpoint(os.path.join(root, "s"), every_n_train_steps=10**9)))
            durable_runs.append(
                step_time(DurableCheckpoint(os.path.join(root, "d"), every_n_steps=10**9, save_on_train_end=False))
            )
        # the fastest run of each: the least disturbed by other load on the machine
        stock_step, durable_step = min(r[0] for r in stock_runs), min(r[0] for r in durable_runs)
        stock_hook = statistics.median(r[1] for r in stock_runs)
        durable_hook = statistics.median(r[1] for r in durable_runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    durable_bps = size / durable_s
    result = {
        "checkpoint_mb": round(size / 1e6, 1),
        "stock_save_s": round(stock_s, 4),
        "durable_save_s": round(durable_s, 4),
        "durable_vs_stock_save_ratio": round(durable_s / stock_s, 3),
        "dd_fsync_mb_per_s": round(dd_bps / 1e6, 1),
        "durable_mb_per_s": round(durable_bps / 1e6, 1),
        "durable_vs_dd_bandwidth_ratio": round(durable_bps / dd_bps, 3),
        "durable_no_crc_save_s": round(no_crc_s, 4),
        "durable_no_crc_vs_stock_save_ratio": round(no_crc_s / stock_s, 3),
        "durable_no_crc_vs_dd_bandwidth_ratio": round(size / no_crc_s / dd_bps, 3),
        "train_step_ms": round(train_step_s * 1e3, 2),
        "sync_stall_in_training_s": round(sync_stall_s, 4),
        "async_stall_s": round(stall_s, 4),
        "async_stall_vs_sync_save_ratio": round(stall_s / sync_stall_s, 3),
        "async_first_stall_s": round(first_stall_s, 4),
        "sync_end_to_end_per_save_s": round(sync_e2e_s, 4),
        "async_end_to_end_per_save_s": round(async_e2e_s, 4),
        "async_vs_sync_end_to_end_per_save_ratio": round(async_e2e_s / sync_e2e_s, 3) if sync_e2e_s > 0 else None,
        "stock_step_ms": round(stock_step * 1e3, 3),
        "durable_step_ms": round(durable_step * 1e3, 3),
        "durable_vs_stock_step_ratio": round(durable_step / stock_step, 3),
        "stock_hook_us_per_step": round(stock_hook * 1e6, 1),
        "durable_hook_us_per_step": round(durable_hook * 1e6, 1),
        "durable_vs_stock_step_ratio_from_hooks": round((stock_step - stock_hook + durable_hook) / stock_step, 4),
        **resume_figures(resume, dir_write_s, dir_crc_s),
        **fit_figures(fits),
        "hash_threads": hash_threads(),
        "crc32_implementation": CRC32_IMPLEMENTATION,
        "reps": args.reps,
        "save_reps": args.save_reps,
    }
    print(f"checkpoint {result['checkpoint_mb']} MB, median of {args.save_reps} saves, {args.reps} training runs:")
    print(
        f"  save: durable {durable_s:.3f}s vs stock {stock_s:.3f}s"
        f" -> {result['durable_vs_stock_save_ratio']}x (goal <= 1.1)"
    )
    print(
        f"  bandwidth: durable {result['durable_mb_per_s']} MB/s vs dd conv=fsync {result['dd_fsync_mb_per_s']} MB/s"
        f" -> {result['durable_vs_dd_bandwidth_ratio']}x (goal >= 0.9)"
    )
    print(
        f"  crc32=False: {no_crc_s:.3f}s -> {result['durable_no_crc_vs_stock_save_ratio']}x stock,"
        f" {result['durable_no_crc_vs_dd_bandwidth_ratio']}x dd bandwidth"
    )
    print(
        f"  in training ({train_step_s * 1e3:.1f} ms steps, a save every {args.save_every}): async stall {stall_s:.4f}s"
        f" vs sync save {sync_stall_s:.4f}s -> {result['async_stall_vs_sync_save_ratio']}x (goal <= 0.1);"
        f" first async save (allocating buffers) {first_stall_s:.4f}s"
    )
    print(
        f"  end to end, extra fit time per save: sync {sync_e2e_s:.4f}s, async {async_e2e_s:.4f}s"
        f" (the background write competes with training for the CPU cores)"
    )
    print(
        f"  step without save: durable {result['durable_step_ms']} ms vs stock {result['stock_step_ms']} ms"
        f" -> {result['durable_vs_stock_step_ratio']}x (goal <= 1.02); time in on_train_batch_end: durable"
        f" {result['durable_hook_us_per_step']} us vs stock {result['stock_hook_us_per_step']} us per step"
        f" -> {result['durable_vs_stock_step_ratio_from_hooks']}x"
    )
    print_resume(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
