"""SIGKILL fault injection for DurableCheckpoint: kill a 2-process DDP run (gloo, CPU) at random moments
during saves, then resume it, many times.

Each trial forks two ranks from this already-imported process (so a trial costs a second, not an
interpreter start), trains a tiny model saving every step (sync and async trials alternate), kills
both ranks with SIGKILL -- half of the kills at a random instant, half the instant a temporary
checkpoint file appears, i.e. mid-write -- and then checks the directory: every committed checkpoint
must load with ``torch.load(weights_only=True)``. The next trial resumes with ``ckpt_path="latest"``
and must start exactly at the newest committed step. A final run resumes and finishes.

The data is shuffled (Lightning's ``DistributedSampler``) and the model has dropout, so a resume is
exact only if the data position and every RNG are restored: the kills land at random batches, most of
them mid-epoch, and the weights of the newest committed checkpoint after every kill (and of the final
run) are compared bit for bit with an uninterrupted run's weights at the same step.

Between kills, in a random subset of trials (60 % of those with an older good checkpoint left
to fall back to), the newest committed checkpoint is damaged before the restart: random bytes are
flipped inside a tensor's data, inside ``data.pkl``, inside the zip directory or anywhere in the file;
or its data is replaced by a pickled code payload (a ``__reduce__`` that would create a marker file)
under a forged commit marker whose size and CRC32 fit. The restart
must resume from the newest *undamaged* committed checkpoint (the weights it starts from equal the
uninterrupted run's at that step, bit for bit, and never a damaged file's), never run the payload
(refused as disallowed content and left in place), move the damaged checkpoint to ``quarantine/``,
and the run must still reach the same final step with the same final weights.

Usage::

    python benchmarks/sigkill_trials.py --trials 200

Prints a tally and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import struct
import sys
import time
import zipfile
import zlib
from typing import Any

import torch

torch.set_num_threads(1)  # no intra-op pool in the parent: it forks ranks

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lplugins.callbacks import DurableCheckpoint, latest_checkpoint  # noqa: E402
from lplugins.callbacks._record import COMMIT_SUFFIX, QUARANTINE, TMP_PREFIX, Record, order  # noqa: E402
from lplugins.callbacks._storages import open_storage  # noqa: E402

SAVE_EVERY = 1
MAX_IN_FLIGHT = 1
SAMPLES, BATCH = 256, 8
BATCHES_PER_EPOCH = SAMPLES // 2 // BATCH  # per rank: the DistributedSampler splits the data in two


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every run
        self.layer = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.layer(x) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Progress(pl.Callback):
    """Rank 0 appends ``start N DIGEST`` when training starts (the weights it starts from: fresh or resumed)
    and ``step N`` at each step (before the save)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, trainer: pl.Trainer, line: str) -> None:
        if trainer.global_rank == 0:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, (line + "\n").encode())
            os.close(fd)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, f"start {trainer.global_step} {digest(pl_module.state_dict())}")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self._write(trainer, f"step {trainer.global_step}")


def digest(state_dict: dict[str, torch.Tensor]) -> str:
    """A hash of the weights, bit for bit."""
    h = hashlib.sha256()
    for key in sorted(state_dict):
        h.update(key.encode())
        h.update(state_dict[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class Digests(pl.Callback):
    """Rank 0 of the uninterrupted run appends ``step digest`` at the start (step 0) and at each step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "a") as f:
                f.write(f"{trainer.global_step} {digest(pl_module.state_dict())}\n")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "a") as f:
                f.write(f"{trainer.global_step} {digest(pl_module.state_dict())}\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(
    rank: int, port: int, ckdir: str, progress: str, mode: str, max_steps: int, log: str, digests: str | None = None
) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
        GROUP_RANK="0", LOCAL_WORLD_SIZE="2", NODE_RANK="0",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 32, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=BATCH, shuffle=True)
    cb = DurableCheckpoint(
        ckdir, every_n_steps=SAVE_EVERY if digests is None else 10**9, keep_last=2, async_save=mode == "async",
        max_in_flight=MAX_IN_FLIGHT, preemption_signals=(),
    )  # fmt: skip
    callbacks: list[pl.Callback] = [cb, Progress(progress)] + ([Digests(digests)] if digests else [])
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps, callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Model(), data, ckpt_path="latest")


def spawn(
    port: int, ckdir: str, progress: str, mode: str, max_steps: int, log: str, digests: str | None = None
) -> list[int]:
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_main(rank, port, ckdir, progress, mode, max_steps, log, digests)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    return pids


def read_progress(path: str) -> tuple[int | None, int | None, str | None]:
    """(step the run started at, last step reached, digest of the weights it started from)."""
    start = last = None
    start_digest = None
    try:
        with open(path) as f:
            for line in f:
                kind, _, value = line.strip().partition(" ")
                if kind == "start" and value:
                    step, _, found = value.partition(" ")
                    start, start_digest = int(step), found or None
                elif kind == "step" and value:
                    last = int(value)
    except FileNotFoundError:
        pass
    return start, last, start_digest


def ident(record: Record) -> tuple[str, int, float]:
    """One commit, told apart from a later one of the same name (a quarantined checkpoint's name and
    sequence number are free again: the next save at that step takes both)."""
    return record.name, record.seq, record.time


def committed(ckdir: str) -> list[Record]:
    """Every committed checkpoint (readable marker), newest (highest commit sequence number) first."""
    return sorted((r for r, _ in open_storage(ckdir).records() if r is not None), key=order, reverse=True)


def good_records(ckdir: str, planted: dict[tuple[str, int, float], str]) -> list[Record]:
    """The committed checkpoints this script did not damage, newest first."""
    return [r for r in committed(ckdir) if ident(r) not in planted]


def committed_state(ckdir: str, planted: dict[tuple[str, int, float], str]) -> tuple[int, int]:
    """(step of the newest good committed checkpoint, number of good committed checkpoints that fail to load).

    ``planted``: the :func:`ident` of checkpoints damaged on purpose (a payload stays in place).
    """
    storage = open_storage(ckdir)
    bad = 0
    good = good_records(ckdir, planted)
    for record in good:
        try:
            ckpt = torch.load(storage.path(record.name), weights_only=True, map_location="cpu")
            assert ckpt["global_step"] == record.global_step
        except Exception:
            # visible (marker present) but not loadable: what must never happen
            bad += 1
    newest = good[0].global_step if good else 0
    if good and newest != max(r.global_step for r in good):
        bad += 1
    latest = latest_checkpoint(ckdir)  # structural checks only: a planted payload looks fine to it
    planted_names = {name for name, _, _ in planted}
    if latest is not None and os.path.basename(latest) not in planted_names:
        newest_latest = torch.load(latest, weights_only=True, map_location="cpu")["global_step"]
        if newest_latest != newest:
            bad += 1
    return newest, bad


def newest_digest(ckdir: str, planted: dict[tuple[str, int, float], str]) -> tuple[int, str] | None:
    """(step, weights digest) of the newest good committed checkpoint."""
    good = good_records(ckdir, planted)
    if not good:
        return None
    ckpt = torch.load(open_storage(ckdir).path(good[0].name), weights_only=True, map_location="cpu")
    return int(ckpt["global_step"]), digest(ckpt["state_dict"])


# ------------------------------------------------------------------------------------------ damage
DAMAGE_KINDS = ("tensor", "data.pkl", "zip directory", "anywhere")


class Payload:
    """Pickles as a call of ``os.system`` that creates ``marker``: what a malicious checkpoint carries."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def regions(path: str) -> dict[str, list[tuple[int, int]]]:
    """(offset, length) byte ranges of each damage kind in a ``torch.save`` zip file."""
    with open(path, "rb") as f:
        raw = f.read()
    with zipfile.ZipFile(path) as zf:
        infos, start_dir = zf.infolist(), zf.start_dir

    def data_of(info: zipfile.ZipInfo) -> tuple[int, int]:
        fields = struct.unpack("<IHHHHHIIIHH", raw[info.header_offset : info.header_offset + 30])
        return info.header_offset + 30 + fields[9] + fields[10], info.compress_size

    tensors = [data_of(i) for i in infos if i.filename.rsplit("/", 2)[-2:-1] == ["data"] and i.compress_size]
    pickles = [data_of(i) for i in infos if i.filename.endswith("/data.pkl")]
    return {
        "tensor": tensors,
        "data.pkl": pickles,
        "zip directory": [(start_dir, len(raw) - start_dir)],
        "anywhere": [(0, len(raw))],
    }


def flip_bytes(path: str, rng: random.Random) -> tuple[str, int]:
    """Flip random bits of 1-4 random bytes (1-16 anywhere) in one random region of ``path``: (kind, bytes)."""
    kind = rng.choice(DAMAGE_KINDS)
    start, length = rng.choice(regions(path)[kind])
    count = min(length, rng.randint(1, 16 if kind == "anywhere" else 4))
    with open(path, "r+b") as f:
        for at in rng.sample(range(start, start + length), count):
            f.seek(at)
            old = f.read(1)[0]
            f.seek(at)
            f.write(bytes([old ^ rng.randint(1, 255)]))
        f.flush()
        os.fsync(f.fileno())
    return kind, count


def plant_payload(ckdir: str, record: Record, marker: str, scratch: str) -> None:
    """Replace ``record``'s data by the same checkpoint plus a code payload; forge its marker's size and CRC32."""
    storage = open_storage(ckdir)
    path = storage.path(record.name)
    ckpt = torch.load(path, weights_only=True, map_location="cpu")
    ckpt["hyper_parameters"] = {"lr": Payload(marker)}
    torch.save(ckpt, scratch)
    os.replace(scratch, path)
    with open(path, "rb") as f:
        raw = f.read()
    record.size, record.crc32 = len(raw), zlib.crc32(raw)
    with open(scratch, "wb") as f:
        f.write(record.to_json())
    os.replace(scratch, path + COMMIT_SUFFIX)


def file_sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def weights_of(path: str) -> str | None:
    """The weights digest of a (maybe damaged) checkpoint file, or None when it does not load."""
    try:
        return digest(torch.load(path, weights_only=True, map_location="cpu")["state_dict"])
    except Exception:
        return None


def quarantined(ckdir: str, name: str, sha: str) -> bool:
    """Whether ``quarantine/`` holds checkpoint ``name`` with exactly these bytes."""
    root = os.path.join(ckdir, QUARANTINE)
    for folder in os.listdir(root) if os.path.isdir(root) else []:
        candidate = os.path.join(root, folder, name)
        if (folder == name or folder.startswith(name + ".")) and os.path.isfile(candidate):
            if file_sha(candidate) == sha:
                return True
    return False


def last_error(log: str, since: int) -> str:
    """``": <the last exception line>"`` the ranks wrote to ``log`` after offset ``since``, or ``""``."""
    with open(log, "rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    found = [line for line in lines if line and not line[0].isspace() and ("Error" in line or "Exception" in line)]
    return f": {found[-1]}" if found else ""


def reference_run(workdir: str, log: str, last: int, tally: dict[str, int]) -> dict[int, str] | None:
    """Run without kills to step ``last``: the weights digest at its start (step 0) and after each step."""
    digests = os.path.join(workdir, "reference.digests")
    ref_dir = os.path.join(workdir, "reference_ckpts")
    shutil.rmtree(ref_dir, ignore_errors=True)
    if os.path.exists(digests):
        os.unlink(digests)
    pids = spawn(free_port(), ref_dir, os.path.join(workdir, "progress.reference"), "sync", last, log, digests)
    if any(os.waitpid(pid, 0)[1] for pid in pids):
        tally["resume_failures"] += 1
        print(f"the uninterrupted reference run failed (see {log})", file=sys.stderr)
        return None
    with open(digests) as f:
        return {int(step): found for step, found in (line.split() for line in f)}


def wait_for(pred: object, timeout: float, pids: list[int]) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        for pid in pids:
            done, _status = os.waitpid(pid, os.WNOHANG)
            if done:
                return False
        time.sleep(0.002)
    return False


def kill_all(pids: list[int]) -> list[int]:
    statuses = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            statuses.append(os.waitpid(pid, 0)[1])
        except ChildProcessError:
            statuses.append(-1)
    return statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--workdir", default="sigkill_work")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--damage-rate",
        type=float,
        default=0.6,
        help="share of restarts (with two good checkpoints to choose from) preceded by damage to the newest one",
    )
    parser.add_argument(
        "--payload-share", type=float, default=0.2, help="share of those damages that plant a code payload"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    damage_rng = random.Random(args.seed + 1)
    os.makedirs(args.workdir, exist_ok=True)
    ckdir = os.path.join(args.workdir, "ckpts")
    # a rerun in the same workdir starts from no checkpoint and no progress, as trial 0 expects
    shutil.rmtree(ckdir, ignore_errors=True)
    for name in os.listdir(args.workdir):
        if name.startswith("progress."):
            os.unlink(os.path.join(args.workdir, name))
    marker = os.path.abspath(os.path.join(args.workdir, "PAYLOAD_RAN"))  # what a payload would create
    if os.path.exists(marker):
        os.unlink(marker)
    scratch = os.path.join(args.workdir, "scratch.tmp")
    log = os.path.join(args.workdir, "ranks.log")
    tally = {
        "kills": 0, "kills_during_save": 0, "resumes_ok": 0, "resume_failures": 0, "partial_visible": 0,
        "max_steps_lost_sync": 0, "max_steps_lost_async": 0, "steps_lost_total": 0, "mid_epoch_resumes": 0,
        "weights_checked": 0, "weights_equal": 0, "weights_differ": 0,
        "flips": 0, "flipped_bytes": 0, "flips_silent": 0, "payloads": 0, "damaged_restarts": 0, "resumed_good": 0,
        "fresh_starts_after_damage": 0, "damaged_loaded": 0, "payloads_run": 0, "payloads_refused": 0,
        "quarantined": 0, "resume_weights_checked": 0, "resume_weights_equal": 0, "final_step_ok": 0,
    }  # fmt: skip
    flips_by_kind = dict.fromkeys(DAMAGE_KINDS, 0)
    checks: list[tuple[int, str]] = []  # (step, weights digest) of the newest checkpoint after each kill
    # (trial, expected start, start, digest of the weights started from, damage done before the restart)
    resumes: list[tuple[int, int, int, str | None, dict[str, Any] | None]] = []
    planted: dict[tuple[str, int, float], str] = {}  # ident() of damaged checkpoints in the directory -> kind
    damage: dict[str, Any] | None = None  # what was done to the directory before this trial's restart

    def after_restart(trial: int, log_at: int) -> None:
        """With the ranks gone: no payload ran; a damaged checkpoint was quarantined, a payload refused."""
        if os.path.exists(marker):
            tally["payloads_run"] += 1
            print(f"trial {trial}: a payload ran: {marker} exists", file=sys.stderr)
            os.unlink(marker)
        if damage is None:
            return
        still = any(ident(r) == damage["ident"] for r in committed(ckdir))
        if damage["kind"] == "flip":
            if quarantined(ckdir, damage["name"], damage["sha"]) and not still:
                tally["quarantined"] += 1
            else:
                print(f"trial {trial}: damaged {damage['name']} not quarantined (committed: {still})", file=sys.stderr)
        else:
            with open(log, "rb") as f:
                f.seek(log_at)
                text = f.read().decode(errors="replace")
            if f"{damage['name']} (disallowed content" in text:
                tally["payloads_refused"] += 1
            else:
                print(f"trial {trial}: payload in {damage['name']} not reported as disallowed", file=sys.stderr)
        for gone in set(planted) - {ident(r) for r in committed(ckdir)}:
            del planted[gone]  # quarantined, or (a payload left in place) removed by retention

    expected_start = 0
    started = time.monotonic()
    for trial in range(args.trials + 1):
        final = trial == args.trials
        mode = "sync" if trial % 2 == 0 else "async"
        progress = os.path.join(args.workdir, f"progress.{trial}")
        log_at = os.path.getsize(log) if os.path.exists(log) else 0
        pids = spawn(free_port(), ckdir, progress, mode, expected_start + 3 if final else 10**6, log)

        def started_ok() -> bool:
            return read_progress(progress)[1] is not None  # noqa: B023

        if not wait_for(started_ok, 120, pids):
            kill_all(pids)
            tally["resume_failures"] += 1
            print(
                f"trial {trial}: the run did not start or resume (see {log}){last_error(log, log_at)}", file=sys.stderr
            )
            break
        start, _, start_digest = read_progress(progress)
        if start == expected_start:
            if trial > 0:
                tally["resumes_ok"] += 1
        else:
            tally["resume_failures"] += 1
            print(f"trial {trial}: resumed at {start}, expected {expected_start}", file=sys.stderr)
        resumes.append((trial, expected_start, start if start is not None else -1, start_digest, damage))
        if (
            damage is not None
            and damage["digest"] not in (None, damage["original"])
            and start_digest == damage["digest"]
        ):
            tally["damaged_loaded"] += 1
            damage["loaded"] = True
            print(f"trial {trial}: resumed the weights of damaged {damage['name']}", file=sys.stderr)
        if final:
            statuses = [os.waitpid(pid, 0)[1] for pid in pids]
            if any(statuses):
                tally["resume_failures"] += 1
            elif (found := newest_digest(ckdir, planted)) is not None:
                checks.append(found)
                tally["final_step_ok"] = int(found[0] == expected_start + 3)
            after_restart(trial, log_at)
            break
        if trial % 2 == 0:
            time.sleep(rng.uniform(0.0, 0.5))
        else:
            wait_for(lambda: any(n.startswith(TMP_PREFIX) for n in os.listdir(ckdir)), 5, pids)
            time.sleep(rng.uniform(0.0, 0.002))
        during = any(n.startswith(TMP_PREFIX) for n in os.listdir(ckdir))
        statuses = kill_all(pids)
        if not all(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL for s in statuses):
            tally["resume_failures"] += 1
            print(f"trial {trial}: a rank exited on its own before the kill: {statuses}", file=sys.stderr)
        tally["kills"] += 1
        tally["kills_during_save"] += int(during)
        after_restart(trial, log_at)
        _, reached, _ = read_progress(progress)
        newest, bad = committed_state(ckdir, planted)
        tally["partial_visible"] += bad
        lost = (reached or 0) - newest
        key = f"max_steps_lost_{mode}"
        tally[key] = max(tally[key], lost)
        tally["steps_lost_total"] += max(lost, 0)
        tally["mid_epoch_resumes"] += int(newest % BATCHES_PER_EPOCH != 0)
        if (found := newest_digest(ckdir, planted)) is not None:
            checks.append(found)
        expected_start = newest
        # damage the newest good committed checkpoint before the next restart, in a random subset of trials
        # where an older good one is left to fall back to (none left means a fresh start: a unit test's case)
        damage = None
        good = good_records(ckdir, planted)
        if len(good) >= 2 and damage_rng.random() < args.damage_rate:
            target = good[0]
            path = open_storage(ckdir).path(target.name)
            original = weights_of(path)
            if damage_rng.random() < args.payload_share:
                plant_payload(ckdir, target, marker, scratch)
                kind, where, damaged_digest = "payload", "payload", None
                tally["payloads"] += 1
            else:
                where, count = flip_bytes(path, damage_rng)
                kind, damaged_digest = "flip", weights_of(path)
                tally["flips"] += 1
                tally["flipped_bytes"] += count
                # torch.load(weights_only=True) takes the damaged file and gives other weights: only the CRC sees it
                tally["flips_silent"] += int(damaged_digest not in (None, original))
                flips_by_kind[where] += 1
            planted[ident(target)] = kind
            damage = {
                "kind": kind, "where": where, "name": target.name, "ident": ident(target), "sha": file_sha(path),
                "original": original, "digest": damaged_digest, "loaded": False,
            }  # fmt: skip
            expected_start = good[1].global_step  # the newest undamaged one
    reference = None
    if checks or resumes:
        last = max([step for step, _ in checks] + [r[2] for r in resumes])
        reference = reference_run(args.workdir, log, max(last, 1), tally)
    if reference is not None:
        for step, got in checks:
            tally["weights_checked"] += 1
            if reference.get(step) == got:
                tally["weights_equal"] += 1
            else:
                tally["weights_differ"] += 1
                print(f"step {step}: the weights differ from the uninterrupted run's", file=sys.stderr)
        for trial, expected, start, got_digest, done in resumes:
            tally["resume_weights_checked"] += 1
            equal = got_digest is not None and reference.get(start) == got_digest
            tally["resume_weights_equal"] += int(equal)
            if not equal:
                tally["weights_differ"] += 1
                print(
                    f"trial {trial}: resumed at step {start} with weights unlike the uninterrupted run's",
                    file=sys.stderr,
                )
            if done is None:
                continue
            tally["damaged_restarts"] += 1
            tally["fresh_starts_after_damage"] += int(start == 0)
            if equal and start == expected:
                tally["resumed_good"] += 1
            elif not equal and not done["loaded"]:
                tally["damaged_loaded"] += 1
    result: dict[str, Any] = dict(tally)
    result.update(
        flips_by_kind=flips_by_kind, save_interval_steps=SAVE_EVERY, max_in_flight=MAX_IN_FLIGHT,
        seconds=round(time.monotonic() - started, 1),
    )  # fmt: skip
    print(
        f"{tally['kills']} SIGKILLs ({tally['kills_during_save']} with a save being written), "
        f"{tally['resumes_ok']} resumes at the newest good committed step, {tally['resume_failures']} failures, "
        f"{tally['partial_visible']} partial checkpoints visible, steps lost max sync {tally['max_steps_lost_sync']} "
        f"/ async {tally['max_steps_lost_async']} (save every {SAVE_EVERY} step); {tally['mid_epoch_resumes']}"
        f" resumes mid-epoch; weights equal bit for bit to the uninterrupted run's at {tally['weights_equal']} of"
        f" {tally['weights_checked']} checkpoints and {tally['resume_weights_equal']} of"
        f" {tally['resume_weights_checked']} starts ({tally['weights_differ']} differ); newest checkpoint damaged"
        f" before {tally['damaged_restarts']} restarts ({tally['flips']} with {tally['flipped_bytes']} flipped bytes"
        f" {flips_by_kind}, {tally['flips_silent']} of them loading silently with other weights,"
        f" {tally['payloads']} code payloads): {tally['resumed_good']} resumed from the newest good"
        f" checkpoint, {tally['damaged_loaded']} loaded damaged bytes, {tally['quarantined']} of {tally['flips']}"
        f" damaged quarantined, {tally['payloads_refused']} of {tally['payloads']} payloads refused,"
        f" {tally['payloads_run']} run; final step reached with equal weights: {bool(tally['final_step_ok'])}"
    )
    print(json.dumps(result))
    ok = (
        tally["resume_failures"] == 0 and tally["partial_visible"] == 0 and tally["weights_differ"] == 0
        and tally["damaged_loaded"] == 0 and tally["payloads_run"] == 0 and tally["final_step_ok"] == 1
        and tally["resumed_good"] == tally["damaged_restarts"] == tally["flips"] + tally["payloads"]
        and tally["quarantined"] == tally["flips"] and tally["payloads_refused"] == tally["payloads"]
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
