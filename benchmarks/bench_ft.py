"""Live fault tolerance with ``ft_ddp`` (torchft): SIGKILL a random replica group, again and again.

3 replica groups (one CPU process each, gloo) train the same MLP under ``lplugins ft run``'s launcher
(:class:`lplugins._cli.ft_launch.Launcher`, a torchft lighthouse in this process). Every few
seconds a random group is SIGKILLed; the launcher restarts it (forked from its fork server) and it rejoins
with the model and optimizer state of a healthy peer. Measured:

* the survivors never stop: the longest gap between two committed steps of any process, over the
  median gap (the issue's bar: at most 3);
* the time from a kill to the rejoined group's first committed optimizer step (median, max), and its
  parts: kill -> process started, -> its Trainer training, -> first step;
* no disk read on the recovery path: files opened for reading with a checkpoint suffix
  (``.pt .pth .ckpt .safetensors .distcp``) by a restarted process before its first step (an audit hook);
* the final parameters of every group against a replay of the same run in one process: each committed
  step's gradient is the mean over the groups that took part in it (their own batches), then the same
  optimizer step. A group that is down, or recovering, at a step contributes no batch to it: that
  step's global batch is smaller (2 groups' batches instead of 3), nothing is replayed later.

The last line of output is one line of JSON. Run::

    .venv/bin/python benchmarks/bench_ft.py --kills 50       # the issue's count
    .venv/bin/python benchmarks/bench_ft.py --kills 5 --interval 2   # a quick look
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".distcp")


# ------------------------------------------------------------------------------- the replica group
def _batch(seed: int, replica: int, step: int, batch: int, dim: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + replica)
    x = torch.randn(batch, dim, generator=g, dtype=torch.float32)  # float32 whatever the default dtype
    y = torch.sin(x[:, :1]) + 0.1 * torch.randn(batch, 1, generator=g, dtype=torch.float32)
    return x, y


def _model(seed: int, dim: int, hidden: int, layers: int) -> Any:
    import torch

    torch.manual_seed(seed)
    mods: list[Any] = []
    width = dim
    for _ in range(layers):
        mods += [torch.nn.Linear(width, hidden), torch.nn.Tanh()]
        width = hidden
    mods.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*mods)


def worker(args: argparse.Namespace) -> None:
    """One replica group: a Lightning Trainer composed with ``strategy="ft_ddp"``."""
    reads: list[str] = []
    first_step: list[float] = []

    def audit(event: str, hook_args: tuple[Any, ...]) -> None:
        if event == "open" and not first_step and isinstance(hook_args[0], (str, bytes, os.PathLike)):
            path, mode = os.fsdecode(hook_args[0]), hook_args[1]
            if str(path).endswith(SUFFIXES) and (mode is None or ("w" not in str(mode) and "a" not in str(mode))):
                reads.append(path)

    sys.addaudithook(audit)
    started = time.time()
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    import lplugins

    torch.set_num_threads(1)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    out = Path(args.out)
    record = open(out / f"steps_{replica}_{os.getpid()}.jsonl", "a", buffering=1)

    class Ticks(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            while True:
                yield 0

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(args.seed, args.dim, args.hidden, args.layers)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = _batch(args.seed, replica, self.trainer.strategy.ft_step, args.batch, args.dim)
            dtype = next(self.net.parameters()).dtype  # float64 under precision="64-true"
            x, y = x.to(dtype), y.to(dtype)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=args.lr)

        def on_train_start(self) -> None:
            record.write(json.dumps({"event": "training", "t": time.time(), "started": started}) + "\n")

        def on_train_batch_end(self, *_: Any) -> None:
            strategy = self.trainer.strategy
            step, committed, participating, participants = strategy.last_step
            now = time.time()
            if committed and not first_step:
                first_step.append(now)
            entry = {
                "step": step,
                "committed": committed,
                "participating": participating,
                "participants": participants,
                "t": now,
                "retried": strategy.retried_steps,
            }
            if committed and len(first_step) == 1:
                entry["disk_reads_before_first_step"] = len(reads)
                entry["recoveries"] = len(strategy.recoveries)
                first_step.append(now)  # said once
            record.write(json.dumps(entry) + "\n")
            stop = out / "stop_at"
            if stop.exists() and strategy.ft_step >= int(stop.read_text() or 1 << 60):
                self.trainer.should_stop = True

    trainer = pl.Trainer(
        **lplugins.compose(
            strategy={
                "name": "ft_ddp",
                "timeout": 20.0,
                "quorum_timeout": 120.0,
                "reduce_dtype": None if args.reduce_dtype == "same" else args.reduce_dtype,
            },
            accelerator="cpu",
            precision=args.precision,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    )
    module = Module()
    trainer.fit(module, DataLoader(Ticks(), batch_size=None))
    torch.save({k: v.detach().double() for k, v in module.net.state_dict().items()}, out / f"final_{replica}.weights")
    record.write(json.dumps({"event": "done", "ft_step": trainer.strategy.ft_step, "t": time.time()}) + "\n")


# ------------------------------------------------------------------- the cost of reduce_dtype="float64"
def _reduce_cost(rank: int, port: int, numel: int, out: str) -> None:
    """One of 3 gloo processes: the model's gradient all-reduced as float32, then summed in float64, interleaved."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    grad = torch.randn(numel)
    took: dict[str, list[float]] = {"float32": [], "float64": []}
    for _ in range(60):
        for name in took:
            dist.barrier()
            start = time.perf_counter()
            flat = grad.to(getattr(torch, name))  # a copy either way, as ft_ddp's flat buffer
            dist.all_reduce(flat)
            flat /= 3
            grad.copy_(flat) if name == "float32" else flat.to(torch.float32)
            took[name].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({k: round(1000 * statistics.median(v[10:]), 1) for k, v in took.items()}))
    dist.destroy_process_group()


def measure_reduce_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Median ms of the all-reduce of the benchmark model's gradient, as is and summed in float64."""
    import torch.multiprocessing as mp

    numel = sum(p.numel() for p in _model(args.seed, args.dim, args.hidden, args.layers).parameters())
    out = Path(tempfile.mkdtemp(prefix="bench_ft_reduce_")) / "cost.json"
    port = random.Random().randrange(20000, 60000)
    mp.spawn(_reduce_cost, args=(port, numel, str(out)), nprocs=3)
    return {"numel": numel, "allreduce_median_ms": json.loads(out.read_text())}


# ------------------------------------------------------------------------------------ the driver
def _records(out: Path) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("steps_*.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a killed process
                continue
        found[path.stem] = rows
    return found


def _committed_since(out: Path, pid: int, since: float) -> float | None:
    for name, rows in _records(out).items():
        if name.endswith(f"_{pid}"):
            for row in rows:
                if row.get("committed") and row["t"] >= since:
                    return float(row["t"])
    return None


def _gap_causes(spans: list[tuple[float, float]], kills: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each gap between two committed steps of a process, by what happened in it: a kill, a rejoin, neither."""
    causes: dict[str, list[float]] = {"kill": [], "rejoin": [], "other": []}
    for start, end in spans:
        if any(start < kill["t"] <= end for kill in kills):
            causes["kill"].append(end - start)
        elif any(start < kill.get("rejoined", 0.0) <= end + 0.05 for kill in kills):
            causes["rejoin"].append(end - start)
        else:
            causes["other"].append(end - start)
    return causes


def _replay(args: argparse.Namespace, participants: dict[int, set[int]], counts: dict[int, int]) -> Any:
    import torch

    torch.set_num_threads(1)
    net = _model(args.seed, args.dim, args.hidden, args.layers)
    if args.precision.startswith("64"):
        net = net.double()
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    summed = torch.float64 if args.reduce_dtype == "float64" else next(net.parameters()).dtype
    for step in sorted(participants):
        groups = sorted(participants[step])
        optimizer.zero_grad()
        grads = [torch.zeros_like(p, dtype=summed) for p in net.parameters()]
        for replica in groups:
            x, y = _batch(args.seed, replica, step, args.batch, args.dim)
            if args.precision.startswith("64"):
                x, y = x.double(), y.double()
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            for acc, p in zip(grads, net.parameters(), strict=True):
                acc += p.grad
        for acc, p in zip(grads, net.parameters(), strict=True):
            p.grad = (acc / counts[step]).to(p.dtype)
        optimizer.step()
    return {k: v.detach().double() for k, v in net.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds after a rejoin before the next kill")
    parser.add_argument("--after", type=int, default=20, help="steps to run after the last rejoin")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=100)
    parser.add_argument("--quorum-tick-ms", type=int, default=10)
    parser.add_argument(
        "--reduce-dtype",
        default="same",
        help="ft_ddp's reduce_dtype: 'same' (the gradients' own) or 'float64' (a sum that does not depend on order)",
    )
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reduce-cost", action="store_true", help="only time the all-reduce, float32 vs float64 sums (3 processes)"
    )
    args = parser.parse_args()
    if args.reduce_cost:
        print(json.dumps(measure_reduce_cost(args)))
        return
    if args.worker:
        worker(args)
        return

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse runs in this process
    from lplugins._cli.ft_launch import Launcher

    out = Path(tempfile.mkdtemp(prefix="bench_ft_"))
    forwarded = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("dim", "hidden", "layers", "batch", "lr", "precision", "seed", "reduce_dtype")
    ]
    launcher = Launcher(
        [sys.executable, os.path.abspath(__file__), "--worker", f"--out={out}", *forwarded],
        args.replicas,
        min_replicas=max(1, args.replicas // 2 + 1),
        max_restarts=args.kills + 5,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        env={"RUST_LOG": "warn", "OMP_NUM_THREADS": "1"},
        log_dir=out / "logs",
    )
    rng = random.Random(args.seed)
    kills: list[dict[str, Any]] = []
    t0 = time.time()
    launcher.start()
    try:
        # wait until every group has committed a step
        while len({n.split("_")[1] for n, rows in _records(out).items() if any(r.get("committed") for r in rows)}) < (
            args.replicas
        ):
            if launcher.poll() or time.time() - t0 > 300:
                raise RuntimeError(f"the groups did not all start; logs in {out / 'logs'}")
            time.sleep(0.1)
        next_kill = time.time() + args.interval
        while len(kills) < args.kills:
            launcher.poll()
            if kills and "rejoined" not in kills[-1]:
                last = kills[-1]
                new_pid = launcher.pid(last["replica"])
                seen = _committed_since(out, new_pid, last["t"]) if new_pid and new_pid != last["pid"] else None
                if seen is not None:
                    last["rejoined"], last["new_pid"] = seen, new_pid
                    next_kill = time.time() + args.interval
                elif time.time() - last["t"] > 120:
                    raise RuntimeError(f"replica {last['replica']} did not rejoin in 120 s; logs in {out / 'logs'}")
            elif time.time() >= next_kill:
                replica = rng.randrange(args.replicas)
                pid = launcher.pid(replica)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    kills.append({"replica": replica, "pid": pid, "t": time.time()})
            time.sleep(0.02)
        while "rejoined" not in kills[-1] if kills else False:
            launcher.poll()
            new_pid = launcher.pid(kills[-1]["replica"])
            seen = _committed_since(out, new_pid, kills[-1]["t"]) if new_pid else None
            if seen is not None:
                kills[-1]["rejoined"], kills[-1]["new_pid"] = seen, new_pid
            time.sleep(0.05)
        top = max((r["step"] for rows in _records(out).values() for r in rows if r.get("committed")), default=0)
        (out / "stop_at").write_text(str(top + args.after))
        status = launcher.wait()
    finally:
        launcher.stop()
        (out / "kills.json").write_text(json.dumps(kills))
    wall = time.time() - t0
    records = _records(out)

    # survivors: gaps between consecutive committed steps of each process
    gaps: list[float] = []
    spans: list[tuple[float, float]] = []
    for rows in records.values():
        times = [r["t"] for r in rows if r.get("committed")]
        spans += list(itertools.pairwise(times[1:]))  # the first step is start-up
    gaps = [b - a for a, b in spans]
    median_gap = statistics.median(gaps)
    causes = _gap_causes(spans, kills)
    # the rejoins
    starts = {e.pid: e.time for e in launcher.events if e.kind == "start"}
    rejoin, to_start, to_training, to_first = [], [], [], []
    disk_reads, recoveries = 0, 0
    for kill in kills:
        rows = records.get(f"steps_{kill['replica']}_{kill['new_pid']}", [])
        training = next((r["t"] for r in rows if r.get("event") == "training"), None)
        first = next((r for r in rows if r.get("committed")), None)
        rejoin.append(kill["rejoined"] - kill["t"])
        to_start.append(starts.get(kill["new_pid"], kill["t"]) - kill["t"])
        if training is not None:
            to_training.append(training - starts.get(kill["new_pid"], kill["t"]))
            to_first.append(kill["rejoined"] - training)
        if first is not None:
            disk_reads += int(first.get("disk_reads_before_first_step", 0))
            recoveries += int(first.get("recoveries", 0) > 0)
    # the replay: which groups' batches each committed step summed, and over how many groups it averaged
    # (torchft divides by the groups in the quorum at the newest step: a group recovering in the step
    # adds zeros but is counted, e.g. at step 0 under init_sync)
    participants: dict[int, set[int]] = {}
    counts: dict[int, int] = {}
    recorded: dict[int, set[int]] = {}
    for name, rows in records.items():
        replica = int(name.split("_")[1])
        for r in rows:
            if r.get("committed"):
                counts[r["step"]] = r["participants"]
                recorded.setdefault(r["step"], set()).add(replica)
                if r.get("participating"):
                    participants.setdefault(r["step"], set()).add(replica)
    # a group killed after its gradients went into a step's mean, before it wrote its record: the others
    # counted it; it is a group with no record of the step, when exactly that many have none
    inferred, ambiguous = 0, 0
    for step, count in counts.items():
        have = participants.setdefault(step, set())
        silent = set(range(args.replicas)) - recorded[step]
        short = count - len(recorded[step])
        if short > 0:
            if len(silent) == short:
                have |= silent
                inferred += 1
            else:
                ambiguous += 1
    reference = _replay(args, participants, counts)
    import torch

    diffs = []
    finals = sorted(out.glob("final_*.weights"))
    for path in finals:
        final = torch.load(path, weights_only=True)
        diffs.append(max(float((final[k] - reference[k]).abs().max()) for k in reference))
    sizes = list(counts.values())
    result = {
        "replicas": args.replicas,
        "kills": len(kills),
        "launcher_status": status,
        "committed_steps": len(participants),
        "steps_with_all_groups": sum(s == args.replicas for s in sizes),
        "steps_with_fewer_groups": sum(s < args.replicas for s in sizes),
        "median_step_gap_ms": round(1000 * median_gap, 1),
        "max_step_gap_ms": round(1000 * max(gaps), 1),
        "max_gap_over_median": round(max(gaps) / median_gap, 2),
        **{f"max_gap_at_{cause}_ms": round(1000 * max(found, default=0.0), 1) for cause, found in causes.items()},
        "gaps_over_3x_median": sum(gap > 3 * median_gap for gap in gaps),
        "rejoin_median_s": round(statistics.median(rejoin), 3) if rejoin else None,
        "rejoin_max_s": round(max(rejoin), 3) if rejoin else None,
        "kill_to_process_start_median_s": round(statistics.median(to_start), 3) if to_start else None,
        "process_start_to_training_median_s": round(statistics.median(to_training), 3) if to_training else None,
        "training_to_first_step_median_s": round(statistics.median(to_first), 3) if to_first else None,
        "steps_committed_on_a_retry": sum(
            max((r.get("retried", 0) for r in rows), default=0) for rows in records.values()
        ),
        "rejoins_with_state_from_peer": recoveries,
        "disk_reads_on_recovery_path": disk_reads,
        "steps_with_a_killed_groups_batch_inferred": inferred,
        "steps_ambiguous": ambiguous,
        "final_groups_compared": len(finals),
        "max_abs_diff_vs_replay": max(diffs) if diffs else None,
        "precision": args.precision,
        "reduce_dtype": args.reduce_dtype,
        "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
        "wall_s": round(wall, 1),
        "out": str(out),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
