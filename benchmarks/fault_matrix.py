"""The fault-class matrix: what every rank of a 2-3 process job sees when one rank crashes or hangs.

Each trial is one job of ``--ranks`` processes started side by side, as torchrun starts them
(``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set, no Lightning launcher that kills the others), training a
small model with a stock ``lightning.pytorch.Trainer`` (``--strategy``: DDP, FSDP2 or ZeRO-2, gloo,
CPU; the process-group timeout is 30 minutes). At step ``FAULT_STEP`` the last rank (the "faulty"
one) injects one fault:

==============  ==========================================================================
``exception``   ``raise RuntimeError`` in ``training_step``
``sigkill``     ``os.kill(os.getpid(), SIGKILL)``
``gil``         a C loop that never releases the GIL (``sum(range(10**13))``)
``stuck``       ``torch.distributed.recv`` from a rank that never sends
``op``          ``broadcast`` where the other ranks ``all_reduce`` (the same line)
``shape``       ``all_reduce`` of 3 values where the others reduce 8 (the same line)
``barrier``     ``barrier()`` under ``if rank == 0`` (here: only the faulty rank calls it)
``uneven``      the faulty rank's DataLoader has 3 more batches than the others'
``dataloader``  the faulty rank's dataset blocks forever in ``__getitem__``
``preempt``     ``SIGUSR1`` to the faulty rank only (``DurableCheckpoint`` saves, then exits 75)
==============  ==========================================================================

For every rank it records the exit status and the seconds from the fault to the process's end (a
rank still running ``--cap`` seconds after the fault is killed and counted as a hang), and checks
its log for lplugins' message: it must name the faulty rank (``rank N``), the operation, the
sequence number of the collective (``#N``) and the user's call site (``fault_matrix.py:LINE`` of the
fault's line). It counts the stack dumps in the log directory (``<root>/lplugins-stacks/``). A trial
passes when every rank exits non-zero (``preempt``: every rank exits 75 after one save) within
``--bound`` seconds and every rank's message names all four.

Strategies (``--strategy``): ``ddp`` (Lightning's ``DDPStrategy``) runs every class. ``fsdp2``
(lplugins' ``FSDP2Strategy``: ``fully_shard``, an all-gather in each forward and a reduce-scatter in
each backward, issued from Python) and ``zero2`` (``deepspeed_stage_2_cpu``: DeepSpeed ZeRO-2, its
gradient reduction in ``engine.backward``/``step``) run the classes where the strategy changes what
the healthy ranks wait in, or how a rank ends or saves: all but ``op`` and ``shape``, whose
mismatched collective is the user's own call on every rank (the healthy ranks wait in that call,
not in one of the strategy's), so the strategy does not change what is detected and the DDP rows
stand for them (``--classes op`` runs them anyway). Usage::

    python benchmarks/fault_matrix.py [--trials 3] [--classes exception,sigkill,...] [--ranks 2] [--strategy ddp]

Each rank is forked from a warm server that imported torch, Lightning and lplugins once (``lplugins._fork``;
``--fresh``: a new interpreter per rank, as before).

Prints a table (one row per class) and ends with ONE line of JSON (units in the key names).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CLASSES = ("exception", "sigkill", "gil", "stuck", "op", "shape", "barrier", "uneven", "dataloader", "preempt")
#: What a rank's message must name as the operation, per class (a regular expression).
OPERATION = {
    "exception": r"RuntimeError",
    "sigkill": r"ended|killed",
    "gil": r"GIL|does not respond",
    "stuck": r"recv",
    "op": r"broadcast",
    "shape": r"shape",
    "barrier": r"barrier",
    "uneven": r"uneven|batches|ended after",
    "dataloader": r"DataLoader|batch",
    "preempt": r".",
}
#: The strategies (``--strategy``) and the classes each runs by default (see the module's docstring).
STRATEGIES = {
    "ddp": CLASSES,
    "fsdp2": tuple(k for k in CLASSES if k not in ("op", "shape")),
    "zero2": tuple(k for k in CLASSES if k not in ("op", "shape")),
}
#: The step the fault happens at, and the steps of an epoch (each step sleeps STEP_S: a 50 ms step).
FAULT_STEP = 40
STEPS = 80
STEP_S = 0.05


# ----------------------------------------------------------------------------------------------- the job
def _strategy(name: str) -> Any:
    from datetime import timedelta

    timeout = timedelta(minutes=30)
    if name == "fsdp2":
        from lplugins.strategies.fsdp2 import FSDP2Strategy

        return FSDP2Strategy(timeout=timeout)
    if name == "zero2":
        from lplugins._builtins.strategies import _deepspeed_factory

        return _deepspeed_factory("deepspeed_stage_2_cpu")(timeout=timeout)
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(timeout=timeout)


def _job(kind: str, root: Path, strategy: str) -> None:  # one rank (a process of its own)
    import torch
    import torch.distributed as dist
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, Dataset

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    faulty = rank == world - 1

    def mark() -> None:
        tmp = root / f"fault.json.{rank}.tmp"  # renamed into place: the harness never reads it half-written
        tmp.write_text(json.dumps({"t": time.time(), "rank": rank}))
        os.replace(tmp, root / "fault.json")

    class Data(Dataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if kind == "dataloader" and faulty and i == FAULT_STEP * 4:
                mark()
                time.sleep(10**6)  # FAULT dataloader
            x = torch.full((8,), float(i % 7))
            return x, x.sum(0, keepdim=True)

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            time.sleep(STEP_S)
            if batch_idx == FAULT_STEP:
                self._fault()
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_epoch_end(self) -> None:
            if kind == "uneven" and not faulty:
                mark()  # the other ranks' data ends here; the faulty rank has 3 batches more

        def _fault(self) -> None:
            if kind == "op":
                t = torch.ones(8)
                if faulty:
                    mark()
                (dist.broadcast(t, src=0) if faulty else dist.all_reduce(t))  # FAULT op
            elif kind == "shape":
                if faulty:
                    mark()
                dist.all_reduce(torch.ones(3 if faulty else 8))  # FAULT shape
            elif not faulty:
                return
            elif kind == "exception":
                mark()
                raise RuntimeError("injected fault")  # FAULT exception
            elif kind == "sigkill":
                mark()
                os.kill(os.getpid(), signal.SIGKILL)  # FAULT sigkill
            elif kind == "gil":
                mark()
                sum(range(10**13))  # FAULT gil
            elif kind == "stuck":
                mark()
                dist.recv(torch.zeros(1), src=0)  # FAULT stuck
            elif kind == "barrier":
                mark()
                dist.barrier()  # FAULT barrier
            elif kind == "preempt":
                mark()
                os.kill(os.getpid(), signal.SIGUSR1)  # FAULT preempt

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    callbacks = []
    if kind == "preempt":
        from lplugins.callbacks import DurableCheckpoint

        callbacks.append(DurableCheckpoint(dirpath=str(root / "ckpt"), preemption_signals=("SIGUSR1",)))
    n = STEPS + (3 if kind == "uneven" and faulty else 0)
    trainer = Trainer(
        strategy=_strategy(strategy), accelerator="cpu", devices=world,
        max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=kind == "preempt", callbacks=callbacks, use_distributed_sampler=False,
        default_root_dir=str(root),
    )  # fmt: skip
    trainer.fit(Model(), DataLoader(Data(n * 4), batch_size=4))  # FAULT uneven


# ----------------------------------------------------------------------------------------------- a trial
def _fault_line(kind: str) -> str:
    for number, line in enumerate(Path(__file__).read_text().splitlines(), start=1):
        if line.rstrip().endswith(f"# FAULT {kind}"):
            return f"fault_matrix.py:{number}"
    return "fault_matrix.py:?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The fork server every rank is forked from (``None``: ``--fresh``, each rank a new interpreter).
_WARM: Any = None
WARM_MODULES = ("torch", "torch.distributed", "torch.utils.data", "lightning.pytorch", "lplugins", "lplugins.callbacks")


def trial(
    kind: str, ranks: int, cap: float, bound: float, env_extra: dict[str, str], strategy: str = "ddp"
) -> dict[str, Any]:
    """Run one job with fault ``kind`` under ``strategy``; what each rank did, and whether the trial passes."""
    root = Path(tempfile.mkdtemp(prefix=f"fault-{kind}-"))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(ranks)}
    env.update({"NODE_RANK": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_extra})
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".venv" / "torch_extensions"))
    logs = [root / f"rank{r}.log" for r in range(ranks)]
    argv = [__file__, "--job", kind, "--root", str(root), "--strategy", strategy]
    procs: list[Any] = []
    for r in range(ranks):
        rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
        if _WARM is not None:  # forked from the warm server: no import per rank (lplugins._fork)
            procs.append(_WARM.fork(argv, env=rank_env, stdout=logs[r], stderr=logs[r], new_session=True))
            continue
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env=rank_env,
                stdout=open(logs[r], "w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    ended: list[float | None] = [None] * ranks
    start = time.time()
    fault_file = root / "fault.json"
    while any(e is None for e in ended):
        now = time.time()
        for r, p in enumerate(procs):
            if ended[r] is None and p.poll() is not None:
                ended[r] = now
        fault_t = json.loads(fault_file.read_text())["t"] if fault_file.exists() else None
        if now - start > cap + 120 or (fault_t is not None and now - fault_t > cap):
            break
        time.sleep(0.02)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    fault_t = json.loads(fault_file.read_text())["t"] if fault_file.exists() else None
    site = _fault_line(kind)
    stacks = root / "lplugins-stacks"
    dumps = sorted(p.name for p in stacks.glob("rank*.txt") if 'File "' in p.read_text(errors="replace"))
    saves = len(list((root / "ckpt").glob("*"))) if (root / "ckpt").is_dir() else 0
    faulty = ranks - 1
    per_rank = []
    for r in range(ranks):
        text = logs[r].read_text(errors="replace")
        dump = stacks / f"rank{r}.txt"
        dumped = dump.read_text(errors="replace") if dump.is_file() else ""
        said = "\n".join(
            line for line in (text + dumped).splitlines() if "lplugins" in line or line.startswith("  rank ")
        )
        file, line_no = site.split(":")
        named = {
            "rank": f"rank {faulty}" in said,
            "operation": re.search(OPERATION[kind], said) is not None,
            "seq": re.search(r"#\d+", said) is not None,
            # in a message, or (a rank that could not run Python) in its faulthandler stack dump
            "site": site in said
            or f'{file}", line {line_no}' in dumped
            # a SIGKILLed rank cannot say where it was killed: the place it was last seen is named instead
            or (kind == "sigkill" and re.search(r"fault_matrix\.py:\d+", said) is not None),
        }
        code = procs[r].returncode if ended[r] is not None else None
        per_rank.append(
            {
                "rank": r,
                "exit": code,
                "s_after_fault": None if ended[r] is None or fault_t is None else round(ended[r] - fault_t, 2),
                "named": named,
                "excerpt": _excerpt(text),
            }
        )
    if kind == "preempt":
        ok = all(p["exit"] == 75 for p in per_rank) and saves >= 1
    else:
        # a rank that can still speak names all four; one SIGKILLed cannot; one killed by another signal (a C++
        # abort) must have left its stack dump (faulthandler) in the log directory
        ok = all(p["exit"] not in (None, 0) for p in per_rank) and all(
            all(p["named"].values())
            if p["exit"] is not None and p["exit"] > 0
            else p["exit"] == -9 or f"rank{p['rank']}.txt" in dumps
            for p in per_rank
        )
    in_time = all(p["s_after_fault"] is not None and p["s_after_fault"] <= bound for p in per_rank)
    ok = ok and fault_t is not None and in_time
    return {"kind": kind, "pass": ok, "ranks": per_rank, "dumps": dumps, "saves": saves, "root": str(root)}


def _excerpt(text: str) -> str:
    """The first lplugins error line of a log (or its last line): what the rank said."""
    for line in text.splitlines():
        if line.startswith("lplugins [rank") or ("lplugins: " in line and "rank" in line and "watchdog on" not in line):
            return line[:300]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


# ----------------------------------------------------------------------------------------------- report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--classes", help="comma-separated, from: " + ",".join(CLASSES) + " (default: the strategy's)")
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="ddp")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--bound", type=float, default=10.0, help="pass: every rank ends within this many seconds")
    parser.add_argument("--cap", type=float, default=40.0, help="kill a job this many seconds after its fault")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every rank (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep each trial's directory (logs, stack dumps)")
    parser.add_argument("--keep-failed", action="store_true", help="keep the directory of each trial that failed")
    parser.add_argument("--verbose", action="store_true", help="print each trial's per-rank result")
    parser.add_argument(
        "--fresh", action="store_true", help="start each rank as a new interpreter (default: forked warm)"
    )
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        _job(args.job, Path(args.root), args.strategy)
        return
    kinds = [k.strip() for k in (args.classes or ",".join(STRATEGIES[args.strategy])).split(",") if k.strip()]
    unknown = [k for k in kinds if k not in CLASSES]
    if unknown:
        parser.error(f"unknown classes {unknown}; choose from {', '.join(CLASSES)}")
    env_extra = dict(item.split("=", 1) for item in args.env)
    global _WARM
    if not args.fresh:
        from lplugins._fork.client import ForkServer

        _WARM = ForkServer(WARM_MODULES, env={**os.environ, "OMP_NUM_THREADS": "1"})
        _WARM.wait_ready(180)
    rows: dict[str, dict[str, Any]] = {}
    print(f"{'class':<11} {'pass':>6} {'worst s':>8} {'median s':>8} {'exits':<22} {'named r/op/#/site':<18} dumps")
    for kind in kinds:
        results = []
        for _ in range(args.trials):
            result = trial(kind, args.ranks, args.cap, args.bound, env_extra, args.strategy)
            results.append(result)
            if args.verbose:
                print(json.dumps({k: v for k, v in result.items() if k != "root"}), flush=True)
            if args.verbose and not result["pass"] and (args.keep or args.keep_failed):
                print(f"failed trial kept in {result['root']}", flush=True)
            if not (args.keep or (args.keep_failed and not result["pass"])):
                subprocess.run(["rm", "-rf", result["root"]], check=False)
        times = [p["s_after_fault"] for r in results for p in r["ranks"]]
        ended = [t for t in times if t is not None]
        named = [p["named"] for r in results for p in r["ranks"]]
        row = {
            "trials": len(results),
            "passed": sum(r["pass"] for r in results),
            "worst_s": None if None in times or not times else max(ended),
            "median_s": round(statistics.median(ended), 2) if ended else None,
            "hung_rank_trials": sum(p["s_after_fault"] is None for r in results for p in r["ranks"]),
            "exits": sorted({str(p["exit"]) for r in results for p in r["ranks"]}),
            "named_fraction": {k: round(sum(n[k] for n in named) / len(named), 2) for k in named[0]},
            "dumps_per_trial": round(statistics.mean(len(r["dumps"]) for r in results), 2),
            "example": results[0]["ranks"][0]["excerpt"],
        }
        rows[kind] = row
        nf = "/".join(f"{v:.0%}"[:-1] for v in row["named_fraction"].values())
        worst = "hang" if row["worst_s"] is None else f"{row['worst_s']:.1f}"
        median = "-" if row["median_s"] is None else f"{row['median_s']:.1f}"
        print(
            f"{kind:<11} {row['passed']:>3}/{row['trials']:<2} {worst:>8} {median:>8} {','.join(row['exits']):<22}"
            f" {nf:<18} {row['dumps_per_trial']}",
            flush=True,
        )
    total = sum(r["trials"] for r in rows.values())
    passed = sum(r["passed"] for r in rows.values())
    print(
        json.dumps(
            {
                "ranks": args.ranks,
                "strategy": args.strategy,
                "trials_per_class": args.trials,
                "bound_s": args.bound,
                "cap_s": args.cap,
                "pass_fraction": round(passed / total, 3) if total else None,
                "classes": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
