"""The resume matrix: save with one strategy and world size, resume with another, on CPU (gloo), no offline step.

Cells are ``<strategy>@<world size>``: strategies ``single`` (one process, no strategy), ``ddp``, ``fsdp2`` (a
sharded directory: torch distributed checkpoint), ``z1``, ``z2``, ``z3`` (DeepSpeed ZeRO stages, CPU), world sizes
1, 2, 3 (``single`` only at 1). Every source cell trains 3 optimizer steps of a constant global batch of 12 samples
(micro-batch 2; accumulation 6, 3 or 2 at 1, 2 or 3 ranks), stopped mid-epoch (epoch of 96 samples, shuffled by a
``DistributedSampler``), and writes a ``DurableCheckpoint``. Every target cell then resumes a copy of each source
with ``trainer.fit(ckpt_path="latest")`` alone (nothing run before it) for one more step. A cell passes when:

* the fit resumed (no error) at the saved global step;
* the gathered fp32 weights and Adam moments (``exp_avg``, ``exp_avg_sq``), and the learning rate, right after the
  load are bitwise equal to those at the end of the saving run;
* the first optimizer step after the resume trains exactly the next 12 samples of the epoch's order (none skipped,
  none repeated), across all ranks;
* on another world size, the accumulation factor was re-derived and said once, on rank zero.

A cell that lplugins refuses before training (the message names both layouts and what would work) is ``refused``;
anything else is ``FAIL`` with the reason. The last line of output is one line of JSON.

Run::

    .venv/bin/python benchmarks/resume_matrix.py                          # everything: 16 x 15 cells
    .venv/bin/python benchmarks/resume_matrix.py --sources z2@2,ddp@2 --targets z3@1,fsdp2@3
    .venv/bin/python benchmarks/resume_matrix.py --strategies ddp,z2 --worlds 1,2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("single", "ddp", "fsdp2", "z1", "z2", "z3")
WORLDS = (1, 2, 3)
SAMPLES, MICRO, GLOBAL, SAVE_STEPS, SEED = 96, 2, 12, 3, 7
RESIZED = "lplugins: world size changed from"


def all_cells() -> list[str]:
    return [f"{s}@{w}" for s in STRATEGIES for w in WORLDS if s != "single" or w == 1]


def parse_cells(text: str, strategies: set[str], worlds: set[int]) -> list[str]:
    """``"all"`` or a comma list of ``strategy@world``, filtered by ``strategies`` and ``worlds``."""
    cells = all_cells() if text == "all" else [c.strip() for c in text.split(",") if c.strip()]
    for cell in cells:
        if cell not in all_cells():
            raise SystemExit(f"unknown cell {cell!r}: use strategy@world, one of {', '.join(all_cells())}")
    return [c for c in cells if c.split("@")[0] in strategies and int(c.split("@")[1]) in worlds]


def split(cell: str) -> tuple[str, int]:
    name, world = cell.split("@")
    return name, int(world)


# ---------------------------------------------------------------------------------------------- the ranks' side
def _child(phase: str, world: int, names: list[str], work: str) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import lplugins
    from lplugins.accumulation import AccumulationScheduler, ConstantGlobalSchedule
    from lplugins.callbacks import DurableCheckpoint
    from lplugins.strategies import FSDP2Strategy

    sys.path.insert(0, str(ROOT))
    from tests.models import Regression

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g)
    data = TensorDataset(torch.arange(SAMPLES), x, x.sum(1, keepdim=True))

    class Model(Regression):
        def __init__(self) -> None:
            super().__init__(8, (16,), lr=1e-2, step_lr=2, seed=0)
            self.seen: list[tuple[int, list[int]]] = []

        def train_dataloader(self) -> Any:
            t = self.trainer
            sampler = DistributedSampler(data, num_replicas=t.world_size, rank=t.global_rank, shuffle=True, seed=SEED)
            return DataLoader(data, batch_size=MICRO, sampler=sampler)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            idx, xb, yb = batch
            self.seen.append((self.trainer.global_step, idx.tolist()))
            return super().training_step((xb, yb), batch_idx)

    def full_state(trainer: Any) -> dict[str, Any]:
        """Every parameter's fp32 value and Adam moments, gathered whole (a collective on every rank)."""
        out: dict[str, Any] = {}
        module = trainer.lightning_module
        if isinstance(trainer.strategy, pl.strategies.DeepSpeedStrategy):
            from deepspeed import zero
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            stage3 = getattr(trainer.strategy, "zero_stage_3", False)
            for name, p in module.named_parameters():
                got = [safe_get_full_fp32_param(p)]
                got += [safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")]
                with zero.GatheredParameters([p]) if stage3 else contextlib.nullcontext():
                    got.append(p.data.detach().clone())  # the weights the forward uses
                out[name] = [t.detach().clone().reshape(-1) if t is not None else None for t in got]
            base = trainer.strategy.deepspeed_engine.optimizer.optimizer
            steps = [float(s["step"]) for s in base.state.values() if "step" in s]
        else:
            opt = trainer.optimizers[0]
            for name, p in module.named_parameters():
                state = opt.state.get(p, {})
                got = [p] + [state.get(k) for k in ("exp_avg", "exp_avg_sq")] + [p]
                out[name] = [
                    (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().reshape(-1)
                    if t is not None
                    else None
                    for t in got
                ]
            steps = [float(s["step"]) for s in opt.state.values() if "step" in s]
        out["adam_step"] = sorted(set(steps))
        out["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        out["global_step"] = trainer.global_step
        return out

    class Probe(pl.Callback):
        def __init__(self, tag: str) -> None:
            self.tag, self.t0, self.load_s = tag, 0.0, 0.0

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.load_s = time.perf_counter() - self.t0
            if phase == "resume":
                self.dump(trainer, "start")

        def on_train_end(self, trainer: Any, module: Any) -> None:
            if phase == "save":
                self.dump(trainer, "end")

        def dump(self, trainer: Any, when: str) -> None:
            state = full_state(trainer)
            if trainer.is_global_zero:
                torch.save(state, os.path.join(work, f"{self.tag}.{when}.pt"))

    def strategy(name: str) -> Any:
        if name == "fsdp2":
            return FSDP2Strategy(save_distributed_checkpoint=True)
        return {"single": "auto", "ddp": "ddp_timeout", "z1": "deepspeed_stage_1_cpu",
                "z2": "deepspeed_stage_2_cpu", "z3": "deepspeed_stage_3_cpu"}[name]  # fmt: skip

    def fit(name: str, dirpath: str, steps: int, tag: str) -> tuple[Any, Any, Probe]:
        probe = Probe(tag)
        kwargs = lplugins.compose(
            strategy=strategy(name), accelerator="cpu", devices=world, max_steps=steps, logger=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[DurableCheckpoint(dirpath, keep_last=None),
                       AccumulationScheduler(ConstantGlobalSchedule(GLOBAL), log_changes=True), probe],
        )  # fmt: skip
        trainer = pl.Trainer(**kwargs)
        model = Model()
        trainer.fit(model, ckpt_path="latest")
        return trainer, model, probe

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    for sub in ("save", "r"):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
    report: dict[str, Any] = {}
    if phase == "save":
        for name in names:
            cell = f"{name}@{world}"
            _, model, probe = fit(name, os.path.join(work, "save", cell), SAVE_STEPS, f"save/{cell}")
            report[cell] = {"load_s": probe.load_s, "seen": model.seen}
    else:
        target, sources = names[0], names[1:]
        for source in sources:
            print(f"=== resume {source} -> {target}@{world}", flush=True)
            started = time.perf_counter()
            try:
                _, model, probe = fit(
                    target, os.path.join(work, "resume", f"{target}@{world}", source), SAVE_STEPS + 1, f"r/{source}"
                )
                report[source] = {"load_s": probe.load_s, "seen": model.seen, "error": None}
            except Exception as err:  # every rank reports; the parent tells refusals from failures
                report[source] = {"error": f"{type(err).__name__}: {err}"}
            report[source]["fit_s"] = time.perf_counter() - started
            print(f"=== done {source}", flush=True)
    with open(os.path.join(work, f"{phase}-{'-'.join(names)}-{world}-rank{rank}.json"), "w") as f:
        json.dump(report, f)


# ---------------------------------------------------------------------------------------------- the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(phase: str, world: int, names: list[str], work: str, timeout: float) -> tuple[list[dict[str, Any]], str]:
    """Start ``world`` ranks at once (as torchrun would); every rank's report and the output of all."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, __file__, "--child", phase, "--world", str(world), "--names", ",".join(names)]
    cmd += ["--work", work]
    logs = [tempfile.TemporaryFile("w+") for _ in range(world)]
    procs = [
        subprocess.Popen(cmd, env={**env, "LOCAL_RANK": str(r), "NODE_RANK": "0"}, stdout=log, stderr=log,
                         text=True, start_new_session=True)
        for r, log in enumerate(logs)
    ]  # fmt: skip
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                try:
                    os.killpg(other.pid, 9)
                except ProcessLookupError:
                    pass
                other.wait()
            break
    text = ""
    for log in logs:
        log.seek(0)
        text += log.read()
        log.close()
    reports = []
    for r in range(world):
        path = os.path.join(work, f"{phase}-{'-'.join(names)}-{world}-rank{r}.json")
        reports.append(json.load(open(path)) if os.path.exists(path) else {})
    return reports, text


def _was_saved(work: str, cell: str) -> bool:
    return os.path.exists(os.path.join(work, f"save/{cell}.end.pt"))


def _order(epoch: int = 0) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(SEED + epoch)
    return torch.randperm(SAMPLES, generator=g).tolist()  # DistributedSampler(shuffle=True)'s epoch order


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


REFUSALS = ("ReshardError", "DeepSpeedReshardError", "ScheduleError")


def _judge(source: str, target: str, reports: list[dict[str, Any]], log: str, work: str) -> dict[str, Any]:
    import torch

    mine = [r.get(source) for r in reports]
    if any(m is None for m in mine):
        return {"status": "FAIL", "why": "the launch died or hung (no report)"}
    errors = [m["error"] for m in mine if m["error"]]
    if errors:
        first = errors[0]
        kind = first.split(":")[0]
        refused = kind in REFUSALS and len(errors) == len(mine)
        said = [line for line in log.splitlines() if "lplugins: ckpt_path: skipped" in line]
        why = first[:300] + (f" [{said[0][-300:]}]" if said else "")
        return {"status": "refused" if refused else "FAIL", "why": why}
    saved = torch.load(os.path.join(work, f"save/{source}.end.pt"), weights_only=True)
    path = os.path.join(work, f"r/{source}.start.pt")
    loaded = torch.load(path, weights_only=True) if os.path.exists(path) else None
    problems = []
    if loaded is None:
        problems.append("no state after the load")
    else:
        if loaded["global_step"] != saved["global_step"]:
            problems.append(f"global_step {loaded['global_step']} != saved {saved['global_step']}")
        if loaded["lr"] != saved["lr"]:
            problems.append(f"lr {loaded['lr']} != saved {saved['lr']}")
        if loaded["adam_step"] != saved["adam_step"]:
            problems.append(f"Adam step {loaded['adam_step']} != saved {saved['adam_step']}")
        for name in saved:
            if name in ("lr", "global_step", "adam_step"):
                continue
            now = loaded.get(name, [None] * 4)
            expected = saved[name][:3] + saved[name][:1]  # the forward's weights: the fp32 values
            for what, a, b in zip(("fp32", "exp_avg", "exp_avg_sq", "weights"), expected, now, strict=True):
                if not _same(a, b):
                    problems.append(f"{name} {what} differs")
    # the first optimizer step after the resume: the next GLOBAL samples of the epoch's order, across ranks
    step = SAVE_STEPS
    trained = sorted(i for m in mine for gs, ids in m["seen"] if gs == step for i in ids)
    expected = sorted(_order()[SAVE_STEPS * GLOBAL : (SAVE_STEPS + 1) * GLOBAL])
    if trained != expected:
        problems.append(f"step {step + 1} trained samples {trained}, expected {expected}")
    if split(source)[1] != split(target)[1] and log.count(RESIZED) != 1:
        problems.append(f"the accumulation change was said {log.count(RESIZED)} times (want once, rank zero)")
    load_s = max(m["load_s"] for m in mine)
    return {"status": "pass" if not problems else "FAIL", "why": "; ".join(problems)[:600], "load_s": load_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", default="all", help="cells to save with (strategy@world, comma list, or all)")
    parser.add_argument("--targets", default="all", help="cells to resume in (strategy@world, comma list, or all)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="keep only these strategies")
    parser.add_argument("--worlds", default="1,2,3", help="keep only these world sizes")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--no-save", action="store_true", help="reuse the saved cells in --work (resume only)")
    parser.add_argument("--work", default=None, help="working directory (default: a temporary one, removed)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--names", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.world, args.names.split(","), args.work)
        return
    strategies = {s.strip() for s in args.strategies.split(",")}
    worlds = {int(w) for w in args.worlds.split(",")}
    sources = parse_cells(args.sources, strategies, worlds)
    targets = parse_cells(args.targets, strategies, worlds)
    work = args.work or tempfile.mkdtemp(prefix="resume_matrix_")
    os.makedirs(work, exist_ok=True)
    started = time.perf_counter()
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        saved: list[str] = []
        for world in sorted({split(c)[1] for c in sources}):
            names = [split(c)[0] for c in sources if split(c)[1] == world]
            if args.no_save:
                saved += [
                    f"{n}@{world}" for n in names if os.path.exists(os.path.join(work, f"save/{n}@{world}.end.pt"))
                ]
                continue
            reports, log = _launch("save", world, names, work, args.timeout)
            for name in names:
                if all(name + f"@{world}" in r for r in reports):
                    saved.append(f"{name}@{world}")
                else:
                    print(f"saving {name}@{world} failed:\n{log[-3000:]}", file=sys.stderr)
        for target in targets:
            pairs = [s for s in saved if s != target]
            if not pairs:
                continue
            name, world = split(target)
            for source in pairs:
                dst = os.path.join(work, "resume", target, source)
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(os.path.join(work, "save", source), dst, symlinks=True)
            t0 = time.perf_counter()
            reports, log = _launch("resume", world, [name, *pairs], work, args.timeout)
            print(f"[{target}: {len(pairs)} resumes in {time.perf_counter() - t0:.0f}s]", file=sys.stderr)
            if not all(reports):
                print(f"a rank of the {target} launch died or hung:\n{log[-4000:]}", file=sys.stderr)
            for source in pairs:
                start, end = log.find(f"=== resume {source} -> {target}"), log.find(f"=== done {source}")
                part = log[start : end if end > start else None]
                rows[(source, target)] = _judge(source, target, reports, part, work)
        for source in sources:
            if source not in saved:
                for target in targets:
                    if target != source:
                        rows[(source, target)] = {"status": "FAIL", "why": "the source run did not save"}
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    _print(rows, sources, targets, time.perf_counter() - started)


def _print(rows: dict[tuple[str, str], dict[str, Any]], sources: list[str], targets: list[str], wall: float) -> None:
    mark = {"pass": "ok", "refused": "ref", "FAIL": "FAIL"}
    width = max(len(c) for c in [*sources, *targets, "from \\ to"]) + 1
    print("from \\ to".ljust(width) + "".join(t.rjust(width) for t in targets))
    for s in sources:
        line = s.ljust(width)
        for t in targets:
            line += ("-" if s == t else mark[rows[(s, t)]["status"]] if (s, t) in rows else "?").rjust(width)
        print(line)
    for (s, t), row in sorted(rows.items()):
        if row["status"] != "pass":
            print(f"{s} -> {t}: {row['status']}: {row['why']}")
    counts = {k: sum(1 for r in rows.values() if r["status"] == k) for k in ("pass", "refused", "FAIL")}
    loads = [r["load_s"] for r in rows.values() if "load_s" in r]
    summary = {
        "cells": len(rows),
        "passed": counts["pass"],
        "refused": counts["refused"],
        "failed": counts["FAIL"],
        "max_setup_and_load_s": round(max(loads), 2) if loads else None,
        "wall_s": round(wall, 1),
        "failures": sorted(f"{s}->{t}" for (s, t), r in rows.items() if r["status"] == "FAIL"),
        "refusals": sorted(f"{s}->{t}" for (s, t), r in rows.items() if r["status"] == "refused"),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
