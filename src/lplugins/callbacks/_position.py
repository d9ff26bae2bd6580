"""The data position: which samples, in which order, are left in the epoch a checkpoint was taken in.

After a mid-epoch restore Lightning continues counting batches where the checkpoint left off (batch
``N`` of the epoch) but iterates a *fresh* dataloader iterator, which starts at the epoch's first batch
and, for a shuffling sampler that draws its seed from the global RNG, in a different order (the RNG was
restored to the state of the save, not of the epoch start). Only loaders with
``state_dict``/``load_state_dict`` (Lightning saves and restores those itself) continue where they were.

:class:`DataPosition` makes every map-style ``DataLoader`` continue where it was:

* At fit start, the strategy's public ``process_dataloader`` is wrapped for the run, so each training
  ``DataLoader`` gets its index sampler (``batch_sampler``, or ``sampler`` without batching) wrapped in
  a :class:`PositionedSampler` *before* Lightning creates its first iterator.
* When an epoch's index stream starts, the wrapper sets the sampler's epoch (``set_epoch``, as Lightning
  does) and records the random state the sampler is about to draw from: the global torch, Python and
  NumPy generators and the sampler's own ``generator``. Per epoch, not per step; nothing O(dataset).
* A save records, per rank: the epoch, how many batches of it were trained, and each loader's record.
* A mid-epoch resume replays the stream: the recorded state is put back, the sampler draws its order as
  it did, the ``N`` trained batches are skipped as indices (no sample is loaded), and the generators are
  put back as they were, so the replay draws nothing from the resumed run's random stream. At train
  start the generators are set to the state of the save once more (creating the iterator drew from them).

Stateful loaders are left to Lightning; an ``IterableDataset`` (or any other iterable) without state
cannot be positioned, and the resume says so.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from lplugins import _lightning
from lplugins._log import announce
from lplugins.callbacks import _position_stock, _rng

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["DataPosition", "PositionedSampler"]

#: The version of the per-rank position state (a new field or meaning: bump it, keep reading the old ones).
#: 2 added each sampler record's ``batch_size`` and ``replicas`` (a resume on another world size converts with them).
POSITION_VERSION = 2
READABLE_VERSIONS = (1, 2)

_HOW_TO = (
    "to resume it exactly, use a map-style dataset (with Lightning's samplers or your own), or a loader with"
    " state_dict()/load_state_dict() that saves its position (e.g. torchdata's StatefulDataLoader, with an"
    " IterableDataset that has state_dict()/load_state_dict() itself)"
)


def _is_stateful(loader: Any) -> bool:
    """Whether Lightning saves and restores ``loader`` itself (its ``_Stateful`` check, by duck typing)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _why_not(loader: Any) -> str | None:
    """Why the position of ``loader`` cannot be restored, or ``None`` when it can (or it restores itself)."""
    if _is_stateful(loader):
        return None
    if not isinstance(loader, DataLoader):
        return f"the train dataloader is a {type(loader).__name__}, not a torch DataLoader, and has no state"
    if isinstance(loader.dataset, IterableDataset):
        return f"the train dataloader's dataset is an IterableDataset ({type(loader.dataset).__name__}) without state"
    return None


def _index_attr(loader: DataLoader[Any]) -> str:
    """The attribute holding what the loader iterates for indices: ``batch_sampler`` when it batches."""
    return "batch_sampler" if loader.batch_sampler is not None else "sampler"


def _samplers(index_sampler: Any) -> list[Any]:
    """The index sampler and the sampler it batches (where ``set_epoch`` and ``generator`` live)."""
    inner = getattr(index_sampler, "sampler", None)
    return [index_sampler] + ([inner] if inner is not None and inner is not index_sampler else [])


def _generators(index_sampler: Any) -> list[torch.Generator]:
    return [g for s in _samplers(index_sampler) if isinstance(g := getattr(s, "generator", None), torch.Generator)]


def _flatten(iterables: Any) -> list[Any]:
    """The loaders of ``trainer.train_dataloader`` in Lightning's order (a loader, or a list/tuple/dict of them)."""
    if iterables is None:
        return []
    from lightning.pytorch.utilities import CombinedLoader

    return list(CombinedLoader(iterables).flattened)


class PositionedSampler:
    """Wraps a DataLoader's index sampler: records where each epoch's order comes from, replays it on resume.

    Attributes other than its own are the wrapped sampler's (``sampler``, ``batch_size``, ``set_epoch``...),
    and so is its length. Without a :class:`DataPosition` (after fit) it iterates the wrapped one unchanged.
    """

    def __init__(self, inner: Any, position: DataPosition) -> None:
        self.inner = inner
        self._position: weakref.ReferenceType[DataPosition] | None = weakref.ref(position)
        #: The record of the current epoch's stream: epoch, RNG state, sampler generator states.
        self.record: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy/unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __iter__(self) -> Iterator[Any]:
        # A generator: this body runs when the first index is asked for, the moment the wrapped
        # sampler's own ``__iter__`` (a generator too, for torch's samplers) would start drawing.
        position = self._position() if self._position is not None else None
        if position is None:
            yield from self.inner
            return
        epoch = position.epoch()
        for sampler in _samplers(self.inner):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        replay = position.replay_for(self, epoch)
        if replay is None:
            self.record = {
                "epoch": epoch,
                "rng": _rng.capture(),
                "generators": [g.get_state() for g in _generators(self.inner)],
            }
            yield from self.inner
            return
        record, skip = replay
        self.record = record
        yield from _replayed(self.inner, record, skip)


def _replayed(inner: Any, record: dict[str, Any], skip: int) -> Iterator[Any]:
    """``inner``'s stream as it was drawn from ``record``'s state, less its first ``skip`` items; RNG-neutral."""
    now = _rng.capture()
    try:
        if record["rng"] is not None:  # None: an order fixed by the epoch (a checkpoint lplugins did not write)
            _rng.restore(record["rng"])
        for generator, state in zip(_generators(inner), record["generators"], strict=False):
            generator.set_state(state)
        stream = iter(inner)
        for _ in range(skip):  # indices only: no sample is loaded
            next(stream)
    finally:
        _rng.restore(now)
    yield from stream


class DataPosition:
    """The data position of one :class:`~lplugins.callbacks.DurableCheckpoint`: recorded, saved, replayed.

    The callback calls :meth:`attach` at fit start, :meth:`state` in each save (this rank's part),
    :meth:`load` from its ``load_state_dict``, :meth:`on_train_start`, and :meth:`detach` at fit end.
    """

    def __init__(self) -> None:
        self._fit: Trainer | None = None
        self._undo: list[Callable[[], None]] = []
        self._wrapped: list[tuple[DataLoader[Any], str, Any]] = []
        #: This rank's position loaded from a checkpoint and the RNG state of that save, until train start.
        self._loaded: dict[str, Any] | None = None
        self._loaded_rng: dict[str, Any] | None = None
        self._why_loaded_unusable: str | None = None
        #: The position being replayed (epoch, batches to skip, per-loader records), for this fit.
        self._resuming: dict[str, Any] | None = None
        #: Whether this fit's plan was looked for in Lightning's counters (a checkpoint without a position).
        self._counted = False

    # ---------------------------------------------------------------- fit lifetime
    def attach(self, trainer: Trainer) -> None:
        """Wrap the index sampler of every training DataLoader this fit builds (call at fit start)."""
        self.detach()
        self._fit = trainer
        self._resuming = None
        self._counted = False
        self._undo.append(_lightning.wrap_process_dataloader(trainer.strategy, self._process))

    def detach(self) -> None:
        """Undo :meth:`attach`: the strategy and the user's DataLoaders as they were."""
        while self._undo:
            self._undo.pop()()
        while self._wrapped:
            loader, attr, inner = self._wrapped.pop()
            wrapper = getattr(loader, attr, None)
            if isinstance(wrapper, PositionedSampler):
                wrapper._position = None
                object.__setattr__(loader, attr, inner)  # DataLoader refuses a plain setattr after init
        self._fit = None

    def _process(self, loader: Any) -> Any:
        trainer = self._fit
        if trainer is None or not trainer.training or not isinstance(loader, DataLoader) or _why_not(loader):
            return loader
        if _is_stateful(loader):
            return loader
        attr = _index_attr(loader)
        current = getattr(loader, attr)
        if isinstance(current, PositionedSampler):
            current._position = weakref.ref(self)
            return loader
        object.__setattr__(loader, attr, PositionedSampler(current, self))  # before its first iterator
        self._wrapped.append((loader, attr, current))
        return loader

    def epoch(self) -> int:
        """The sampler epoch of the epoch being trained (the one whose stream starts).

        Lightning's epoch count, corrected after a resume from a save at train end: when ``max_steps``
        stops a run mid-epoch, Lightning counts that epoch as done in the checkpoint and the resumed run
        numbers the same epoch one higher; the samplers keep the numbers of the uninterrupted run.
        """
        if self._fit is None:
            return 0
        plan = self._plan()
        return int(self._fit.current_epoch) + (plan["offset"] if plan is not None else 0)

    # ---------------------------------------------------------------- save
    def state(self, trainer: Trainer) -> dict[str, Any]:
        """This rank's position: the epoch, batches trained in it, each training loader's record."""
        loaders = []
        total = trainer.num_training_batches
        for loader in _flatten(trainer.train_dataloader):
            wrapper = _wrapper_of(loader)
            if wrapper is not None and wrapper.record is not None:
                loaders.append({"kind": "sampler", **wrapper.record, **_geometry(loader, wrapper)})
            elif _is_stateful(loader):
                loaders.append({"kind": "stateful"})
            else:
                loaders.append({"kind": "none", "why": _why_not(loader) or "its epoch has not started"})
        return {
            "version": POSITION_VERSION,
            "epoch": int(trainer.current_epoch),
            "batch": _lightning.batches_trained_in_epoch(trainer),
            "batches": None if total == float("inf") else int(total),
            "loaders": loaders,
        }

    # ---------------------------------------------------------------- resume
    def load(self, positions: Any, rng_states: Any) -> None:
        """Keep this rank's saved position and RNG state for the resume (from ``load_state_dict``)."""
        self._loaded = self._loaded_rng = self._why_loaded_unusable = None
        rank, world = _rng.rank_and_world()
        if not isinstance(positions, list) or not positions:
            return
        resized = len(positions) != world
        # on another world size: rank zero's position (every rank trained the same number of batches)
        mine = positions[0] if resized else positions[rank]
        if not isinstance(mine, dict) or mine.get("version") not in READABLE_VERSIONS:
            version = mine.get("version") if isinstance(mine, dict) else None
            self._why_loaded_unusable = f"the checkpoint's data position has an unknown format (version {version!r})"
            return
        self._loaded = {**mine, "saved_world": len(positions)} if resized else mine
        if not resized and isinstance(rng_states, list) and len(rng_states) == world:
            self._loaded_rng = rng_states[rank]

    def replay_for(self, wrapper: PositionedSampler, epoch: int) -> tuple[dict[str, Any], int] | None:
        """The record to replay and the batches to skip when ``wrapper``'s stream starts, or ``None``."""
        plan = self._plan()
        if plan is None or self._fit is None:
            return None
        for index, loader in enumerate(_flatten(self._fit.train_dataloader)):
            if _wrapper_of(loader) is wrapper:
                record = plan["loaders"][index] if index < len(plan["loaders"]) else None
                if not isinstance(record, dict) or record.get("kind") != "sampler" or plan["replayed"][index]:
                    return None
                if record["epoch"] != epoch:
                    return None  # another epoch: a fresh stream
                if not 0 < plan["batch"] < len(wrapper.inner):
                    return None  # nothing trained yet, or all of it: a fresh stream
                plan["replayed"][index] = True  # once: a later stream of the same epoch (cycling) is new
                return {k: record[k] for k in ("epoch", "rng", "generators")}, plan["batch"]
        return None

    def _plan(self) -> dict[str, Any] | None:
        """The loaded position as a replay plan (made once, when the first stream of the fit starts)."""
        if self._resuming is None and self._loaded is None and not self._counted:
            self._counted = True
            self._loaded = self._from_counters()
        if self._resuming is None and self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            total, batch = loaded["batches"], loaded["batch"]
            mid_epoch = 0 < batch and (total is None or batch < total)  # Lightning continues that epoch
            samplers = [r for r in loaded["loaders"] if isinstance(r, dict) and r.get("kind") == "sampler"]
            # the sampler epoch of the uninterrupted run minus Lightning's count of the resumed one
            label = int(self._fit.current_epoch) if self._fit is not None else int(loaded["epoch"])
            offset = int(samplers[0]["epoch"]) - label if samplers and mid_epoch else 0
            resize = None
            if "saved_world" in loaded and mid_epoch:
                # another world size: the epoch in progress continues where the whole job was, or restarts
                converted, how = self._converted(loaded)
                resize = {"shift": converted - batch, "from": batch, "to": converted, "how": how}
                batch = loaded["batch"] = converted
                mid_epoch = converted > 0
            done = [not mid_epoch] * len(loaded["loaders"])  # an epoch boundary: fresh streams from here
            self._resuming = {
                **loaded, "replayed": done, "offset": offset, "mid_epoch": mid_epoch, "resize": resize,
            }  # fmt: skip
        return self._resuming

    def _from_counters(self) -> dict[str, Any] | None:
        """The position of a checkpoint that holds none (a stock ``ModelCheckpoint`` file), from Lightning's loop
        counters, when this fit resumes one mid-epoch (:mod:`lplugins.callbacks._position_stock`); else ``None``."""
        trainer = self._fit
        if trainer is None or trainer.ckpt_path is None or self._why_loaded_unusable is not None:
            return None
        (batch, run), total = _lightning.batches_resumed_in_epoch(trainer), trainer.num_training_batches
        if batch <= 0:
            return None
        epoch = int(trainer.current_epoch)
        other = _position_stock.why_other_geometry(run - batch, epoch, total)
        loaders = []
        for loader in _flatten(trainer.train_dataloader):
            wrapper = _wrapper_of(loader)
            if wrapper is None:
                loaders.append({"kind": "stateful" if _is_stateful(loader) else "none", "why": _why_not(loader)})
            elif other is not None:
                loaders.append({"kind": "none", "why": other})
            else:
                loaders.append(_position_stock.record(wrapper.inner, epoch))
        return {
            "version": POSITION_VERSION, "epoch": epoch, "batch": batch, "loaders": loaders, "counted": True,
            "batches": None if total == float("inf") else int(total),
        }  # fmt: skip

    def _converted(self, loaded: dict[str, Any]) -> tuple[int, str]:
        """The batch of the epoch in progress to continue from on this world size, and how it was found.

        With a ``DistributedSampler`` (before and now) the ranks take the epoch's indices in turns, so the
        samples trained are the first ``batch x batch_size x saved world size`` of the epoch's order,
        whatever the world size; when that divides by ``batch_size x world size`` now, each rank continues
        at the quotient. Otherwise the epoch in progress restarts from its first batch (0).
        """
        assert self._fit is not None
        world, saved_world, batch = self._fit.world_size, int(loaded["saved_world"]), int(loaded["batch"])
        loaders = _flatten(self._fit.train_dataloader)
        records = loaded["loaders"]
        if records and all(isinstance(r, dict) and r.get("kind") == "stateful" for r in records):
            return batch, "the train dataloader restores its own position (its state_dict)"
        targets = set()
        for index, loader in enumerate(loaders):
            record = records[index] if index < len(records) else None
            wrapper = _wrapper_of(loader)
            now = _geometry(loader, wrapper) if wrapper is not None else {}
            if not isinstance(record, dict) or record.get("kind") != "sampler" or "batch_size" not in record:
                return 0, "the checkpoint does not say how the samples were split among its ranks"
            if not record.get("replicas") or not now.get("replicas"):
                return 0, "the train dataloader's sampler is not a DistributedSampler (before and now)"
            if not record.get("batch_size") or not now.get("batch_size"):
                return 0, "the train dataloader has no fixed batch_size"
            consumed = batch * int(record["batch_size"]) * saved_world
            per_batch = int(now["batch_size"]) * world
            if consumed % per_batch:
                return 0, (
                    f"the {consumed} samples of it trained ({batch} batches x {record['batch_size']} x {saved_world}"
                    f" ranks) are not a whole number of batches of {now['batch_size']} x {world} ranks"
                )
            targets.add(consumed // per_batch)
            if wrapper is not None and consumed // per_batch >= len(wrapper.inner):
                return 0, "this world size has fewer batches in the epoch than were trained"
        if len(targets) != 1:
            return 0, "its train dataloaders would continue at different batches"
        target = targets.pop()
        return target, (
            f"{batch * int(records[0]['batch_size']) * saved_world} samples of it were trained by {saved_world}"
            f" rank(s): each of the {world} continues after {target} batches, same order (DistributedSampler)"
        )

    def on_train_start(self, trainer: Trainer) -> None:
        """After a mid-epoch restore: set the generators to the save's state again, and say what was restored."""
        plan = self._plan()
        rng, self._loaded_rng = self._loaded_rng, None
        why_unusable, self._why_loaded_unusable = self._why_loaded_unusable, None
        total = trainer.num_training_batches
        if plan is not None and plan["offset"] and plan["mid_epoch"]:
            # saved when max_steps stopped the run mid-epoch: Lightning counted that epoch as done; the epoch
            # count is put back to the uninterrupted run's (the samplers already follow it)
            _lightning.shift_epochs(trainer, plan["offset"])
            plan["offset"] = 0
        if plan is None:
            if why_unusable:
                announce("lplugins: DurableCheckpoint cannot restore the data position: %s.", why_unusable)
            return
        resize = plan.get("resize")
        if resize is not None and not resize.get("applied"):
            resize["applied"] = True
            _lightning.shift_batches_trained_in_epoch(trainer, resize["shift"])
            epoch = trainer.current_epoch + plan["offset"]
            if resize["to"]:
                announce(
                    "lplugins: DurableCheckpoint: the checkpoint was taken after batch %d of epoch %d on %d rank(s):"
                    " %s.", resize["from"], epoch, plan["saved_world"], resize["how"],
                )  # fmt: skip
            else:
                announce(
                    "lplugins: DurableCheckpoint: the checkpoint was taken after batch %d of epoch %d on %d rank(s),"
                    " and %s: epoch %d restarts from its first batch on %d rank(s) (its samples trained before the"
                    " checkpoint are trained again; global_step, epoch and LR schedulers continue).",
                    resize["from"], epoch, plan["saved_world"], resize["how"], epoch, trainer.world_size,
                )  # fmt: skip
        if not plan["mid_epoch"]:
            return  # an epoch boundary: Lightning's fresh iterator is the right one
        if rng is not None:
            _rng.restore(rng)  # creating the iterator drew from the generators restored at load time
        batch = plan["batch"]
        of = "" if total == float("inf") else f" of {int(total)}"
        where = f"resuming mid-epoch {trainer.current_epoch + plan['offset']} at batch {batch}{of}"
        who = "DurableCheckpoint: "
        if plan.get("counted"):  # one line instead of Lightning's "not resumable" warning, which it replaces
            who = ""
            where = f"{where} from {trainer.ckpt_path} (a checkpoint without lplugins' data position)"
            self._undo.append(_lightning.hide_lightning_warning(_lightning.NOT_RESUMABLE_WARNING))
        loaders = _flatten(trainer.train_dataloader)
        problems = []
        for index, loader in enumerate(loaders):
            record = plan["loaders"][index] if index < len(plan["loaders"]) else None
            kind = record.get("kind") if isinstance(record, dict) else None
            if _is_stateful(loader):
                continue
            why = _why_not(loader)
            if why is None and kind != "sampler":
                why = (record or {}).get("why") or "the checkpoint holds no position for it"
            elif why is None and _wrapper_of(loader) is None:
                why = "it was built before this fit and not positioned"
            elif why is None and len(loader) <= batch:
                why = f"it has {len(loader)} batches, fewer than the {batch} trained (it cycled)"
            if why is not None:
                problems.append(f"loader {index}: {why}" if len(loaders) > 1 else why)
        if problems:
            fix = _HOW_TO[0].upper() + _HOW_TO[1:]
            if plan.get("counted"):
                fix = "Save with lplugins' DurableCheckpoint to resume exactly whatever the sampler"
            announce(
                "lplugins: %s%s, but the data order is NOT restored: %s; the epoch's remaining batches come from a"
                " fresh iterator (its first samples are trained again, its last ones not). %s.",
                who, where, "; ".join(problems), fix,
            )  # fmt: skip
        elif all(_is_stateful(loader) for loader in loaders):
            unsized = [i for i, loader in enumerate(loaders) if not callable(getattr(loader, "__len__", None))]
            ahead = (
                " Without a len(), Lightning fetched one batch ahead before it saved the loader's state: unless"
                " its state_dict() accounts for that, one batch is skipped; give the loader a __len__."
                if unsized
                else ""
            )
            announce("lplugins: %s%s; the train dataloader restores its own position.%s", who, where, ahead)
        else:
            fixed = "; the sampler's order is fixed by its seed and the epoch" if plan.get("counted") else ""
            announce(
                "lplugins: %s%s, same order (the %d trained batches are skipped as indices%s).",
                who, where, batch, fixed,
            )  # fmt: skip
            # Lightning's "your dataloader is not resumable" would now be wrong: kept off until the fit ends
            if not plan.get("counted"):
                self._undo.append(_lightning.hide_lightning_warning(_lightning.NOT_RESUMABLE_WARNING))


def _geometry(loader: Any, wrapper: PositionedSampler | None) -> dict[str, Any]:
    """How ``loader`` splits the epoch: its ``batch_size`` and its ``DistributedSampler``'s ``num_replicas``."""
    from torch.utils.data import DistributedSampler

    samplers = _samplers(wrapper.inner) if wrapper is not None else []
    replicas = next((int(s.num_replicas) for s in samplers if isinstance(s, DistributedSampler)), None)
    batch_size = getattr(loader, "batch_size", None)
    return {"batch_size": batch_size if isinstance(batch_size, int) else None, "replicas": replicas}


def _wrapper_of(loader: Any) -> PositionedSampler | None:
    if not isinstance(loader, DataLoader):
        return None
    for attr in ("batch_sampler", "sampler"):
        if isinstance(found := getattr(loader, attr, None), PositionedSampler):
            return found
    return None
