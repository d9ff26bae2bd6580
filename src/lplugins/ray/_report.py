"""``RayCheckpointReport``: every checkpoint a ``DurableCheckpoint`` commits is reported to Ray Train.

Only committed checkpoints are reported (rank 0 reads the commit markers; nothing uncommitted is
ever visible there), each once, in commit order, with its step, epoch, monitored metric and the
trainer's logged metrics. ``ray.train.report`` is a barrier that every worker must call the same
number of times: rank 0 broadcasts what is new and every rank reports it, rank 0 with the
checkpoint, the others with ``None`` (Ray registers a checkpoint when any worker reports one).

What is reported (see ``docs/ray.md``):

* **pointer** -- when the checkpoint directory is shared (under Ray's storage path, or a URL such as
  ``s3://``): a small directory holding ``lplugins_checkpoint.json`` (the directory, the name and the
  commit marker). Ray copies those few bytes to its storage; the data is not copied a second time.
* **copy** -- when the checkpoint directory is local to the worker's node: the checkpoint and its
  commit marker (hard-linked into a staging directory where the filesystem allows, else copied), which
  Ray copies to its storage path: the one copy that lets another node resume.

After a restart, :func:`restore` (called by :func:`lplugins.ray.compose`, before the Trainer is built)
puts a copied checkpoint that Ray restored back into the local directory, committed, so that
``fit(ckpt_path="latest")`` resumes from it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from lplugins._log import announce
from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._record import COMMIT_SUFFIX, TMP_PREFIX, Record
from lplugins.callbacks._storage import canonical_dirpath, is_remote
from lplugins.callbacks._storages import open_storage

__all__ = ["POINTER_FILE", "RayCheckpointReport", "read_pointer", "restore"]

#: The file in every checkpoint lplugins reports to Ray: what it is and where its data is.
POINTER_FILE = "lplugins_checkpoint.json"

#: The Ray experiment directory of this worker's run (set by ``lplugins.ray.run`` in each worker).
EXPERIMENT_DIR: str | None = None


class RayCheckpointReport(Checkpoint):
    """Report every committed ``DurableCheckpoint`` checkpoint to Ray Train (``ray.train.report``).

    A ``Checkpoint`` callback, so Lightning runs it after the ``DurableCheckpoint`` (checkpoint
    callbacks run last, in order): a save made in a hook is committed, or queued, when this one looks.

    Args:
        storage: Ray's experiment directory; a checkpoint directory under it is shared and reported by
            pointer. Default: the one ``lplugins.ray.run`` set in this worker.
    """

    def __init__(self, storage: str | None = None) -> None:
        self.storage = storage
        self._durable: list[DurableCheckpoint] = []
        self._counted = 0  # saves whose commit was accounted for (the same on every rank)
        self._saves0 = 0  # saves before this fit
        self._seq: list[int] = []  # rank 0: the highest commit seq seen, per DurableCheckpoint
        self._seq0: list[int] = []  # rank 0: the highest commit seq when this fit started
        self._catch_up = False  # after a restart: report the commits Ray has not got, at the first step
        self.reported: list[dict[str, Any]] = []  # what this rank reported (the metrics), in order

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._durable = [cb for cb in trainer.callbacks if isinstance(cb, DurableCheckpoint)]  # type: ignore[attr-defined]
        self._counted = self._saves0 = self._saves()
        # at the first step, commits in the directory that Ray has not registered are reported (after a
        # restart: a report made just before a worker died may not have reached Ray)
        self._catch_up = bool(self._durable)
        if trainer.is_global_zero:
            self._seq0 = [_max_seq(_dirpath(trainer, cb)) for cb in self._durable]
            registered = _registered_seqs()
            self._seq = [registered.get(i, 0) for i in range(len(self._durable))]
        if not self._durable:
            announce(
                "lplugins: running under Ray Train without a durable_checkpoint: nothing is reported to Ray, and a "
                "restart after a worker failure starts from scratch. Add callbacks=['durable_checkpoint']."
            )
            return
        for cb in self._durable:
            where = _dirpath(trainer, cb)
            announce(
                "lplugins: every checkpoint DurableCheckpoint(%s) commits is reported to Ray Train (%s)",
                where,
                "by pointer: the directory is shared storage"
                if self._shared(where)
                else "copied to Ray's storage path: the directory is not under it",
            )

    def _saves(self) -> int:
        return sum(len(cb.save_stalls) for cb in self._durable)

    def _shared(self, dirpath: str) -> bool:
        storage = self.storage or EXPERIMENT_DIR
        if is_remote(dirpath):
            return True
        if storage is None or is_remote(storage):
            return False
        path, root = os.path.realpath(dirpath), os.path.realpath(storage)
        return path == root or path.startswith(root.rstrip(os.sep) + os.sep)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._report(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._report(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._report(trainer)  # after DurableCheckpoint.on_train_end: its last save is committed

    def _report(self, trainer: Trainer) -> None:
        """Report the commits made since the last report (every rank together, only while saves are pending)."""
        if self._saves() == self._counted and not self._catch_up:
            return  # every save is accounted for: nothing new (every rank knows the same)
        self._catch_up = False
        new: list[tuple[int, str, dict[str, Any]]] = []
        commits = 0
        if trainer.is_global_zero:
            for i, cb in enumerate(self._durable):
                dirpath = _dirpath(trainer, cb)
                for record in open_storage(dirpath).find_committed():
                    if record.seq > self._seq[i]:
                        new.append((i, dirpath, json.loads(record.to_json())))
                        self._seq[i] = record.seq
                commits += max(0, self._seq[i] - self._seq0[i])  # seq counts commits, even ones deleted since
        from lplugins.callbacks._collective import broadcast

        new, commits = broadcast(trainer, (new, commits))
        self._counted = min(self._saves(), self._saves0 + commits)
        for index, dirpath, marker in new:
            self._report_one(trainer, index, dirpath, marker)

    def _report_one(self, trainer: Trainer, index: int, dirpath: str, marker: dict[str, Any]) -> None:
        import ray.train

        record = Record.from_json(json.dumps(marker).encode())
        metrics = _metrics(trainer)
        metrics.update(step=record.global_step, epoch=record.epoch, lplugins_checkpoint=record.name)
        if record.monitor is not None and record.metric is not None:
            metrics[record.monitor] = record.metric
        self.reported.append(metrics)
        dir_name = f"lplugins-{index}-{record.seq:06d}-{record.name}"
        if not trainer.is_global_zero:
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=dir_name)
            return
        mode = "pointer" if self._shared(dirpath) else "copy"
        stage = tempfile.mkdtemp(prefix="lplugins-ray-report-")
        try:
            pointer = {"mode": mode, "dirpath": dirpath, "name": record.name, "marker": marker}
            with open(os.path.join(stage, POINTER_FILE), "w", encoding="utf-8") as f:
                json.dump(pointer, f, sort_keys=True)
            if mode == "copy":
                _stage_copy(dirpath, record, stage)
            checkpoint = ray.train.Checkpoint.from_directory(stage)
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=dir_name)
            if mode == "copy":
                _wait_registered()
        finally:
            shutil.rmtree(stage, ignore_errors=True)  # Ray's SYNC upload is done when report returns


def _wait_registered() -> None:
    """Wait until Ray's controller has registered the reports made so far.

    Ray Train collects a report from the workers asynchronously: one made just before the worker dies
    can be lost. A copied checkpoint exists nowhere else a new machine could get it from, so training
    goes on only once Ray has it (a pointer needs no wait: the shared directory has the checkpoint).
    """
    import ray.train

    wait = getattr(ray.train, "get_all_reported_checkpoints", None)
    if wait is None:  # Ray Train v1: no way to wait
        return
    wait(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def _dirpath(trainer: Trainer, cb: DurableCheckpoint) -> str:
    return str(cb.dirpath or os.path.join(trainer.default_root_dir, "checkpoints"))


_REPORTED_NAME = re.compile(r"^lplugins-(\d+)-(\d+)-")


def _registered_seqs() -> dict[int, int]:
    """Per DurableCheckpoint (by position), the highest commit seq among the checkpoints Ray has registered
    for this run (its checkpoint manager survives worker-group restarts); from the checkpoint directory names
    this callback gives Ray (``lplugins-<index>-<seq>-<name>``)."""
    import ray.train

    listing = getattr(ray.train, "get_all_reported_checkpoints", None)
    if listing is not None:
        paths = [
            str(c.checkpoint.path) for c in listing(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        ]
    else:  # Ray Train v1: the newest only
        restored = ray.train.get_checkpoint()
        paths = [str(restored.path)] if restored is not None else []
    seqs: dict[int, int] = {}
    for path in paths:
        match = _REPORTED_NAME.match(path.rstrip("/").rsplit("/", 1)[-1])
        if match:
            index, seq = int(match.group(1)), int(match.group(2))
            seqs[index] = max(seq, seqs.get(index, 0))
    return seqs


def _max_seq(dirpath: str) -> int:
    try:
        return max((r.seq for r in open_storage(dirpath).find_committed()), default=0)
    except FileNotFoundError:
        return 0


def _metrics(trainer: Trainer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in trainer.callback_metrics.items():
        number: Any = value
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            number = value.item()
        if isinstance(number, (int, float)):
            out[key] = number
    return out


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _stage_copy(dirpath: str, record: Record, stage: str) -> None:
    """The checkpoint and its marker in ``stage`` (hard links where possible: no local copy of the data)."""
    src = os.path.join(dirpath, record.name)
    if os.path.isdir(src):
        shutil.copytree(src, os.path.join(stage, record.name), copy_function=_link_or_copy)
    else:
        _link_or_copy(src, os.path.join(stage, record.name))
    shutil.copy2(src + COMMIT_SUFFIX, os.path.join(stage, record.name + COMMIT_SUFFIX))


def read_pointer(directory: str) -> dict[str, Any] | None:
    """The ``lplugins_checkpoint.json`` of a checkpoint directory lplugins reported (``None``: not one)."""
    path = os.path.join(directory, POINTER_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def restore(dirpaths: list[str]) -> str | None:
    """Put the checkpoint Ray restored into its directory, committed, unless it is there already.

    Called on every worker before the Trainer is built; the first local rank of each node writes (the
    directory of a copied checkpoint is local to a node), then all ranks wait for each other.
    Returns the path ``"latest"`` will find, or ``None`` when Ray restored nothing lplugins reported.
    """
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        pointer = read_pointer(directory)
        if pointer is None:
            return None
        dirpath, name = pointer["dirpath"], pointer["name"]
        path = os.path.join(dirpath, name) if not is_remote(dirpath) else f"{dirpath.rstrip('/')}/{name}"
        wanted = {canonical_dirpath(d) for d in dirpaths}
        if canonical_dirpath(dirpath) not in wanted:
            announce(
                "lplugins: Ray restored checkpoint %s of %s, a directory no DurableCheckpoint here uses: not resumed",
                name, dirpath,
            )  # fmt: skip
            return None
        if pointer["mode"] == "copy" and ray.train.get_context().get_local_rank() == 0:
            _put_back(directory, dirpath, name)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    announce("lplugins: Ray restored checkpoint %s; ckpt_path='latest' resumes from it or a newer commit", path)
    return path


def _put_back(directory: str, dirpath: str, name: str) -> None:
    """Copy ``name`` (data, then the marker last) from Ray's restored ``directory`` into ``dirpath``."""
    marker = os.path.join(dirpath, name + COMMIT_SUFFIX)
    if os.path.exists(marker):
        return  # committed there already
    os.makedirs(dirpath, exist_ok=True)
    src, tmp = os.path.join(directory, name), os.path.join(dirpath, TMP_PREFIX + name)
    if os.path.isdir(src):
        shutil.copytree(src, tmp)
    else:
        shutil.copy2(src, tmp)
    os.replace(tmp, os.path.join(dirpath, name))
    tmp_marker = os.path.join(dirpath, TMP_PREFIX + name + COMMIT_SUFFIX)
    shutil.copy2(os.path.join(directory, name + COMMIT_SUFFIX), tmp_marker)
    os.replace(tmp_marker, marker)
