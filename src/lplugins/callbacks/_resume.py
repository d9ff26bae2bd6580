"""Resuming: every load, by :class:`LatestResolver`, for both ways Lightning loads a checkpoint.

Lightning loads through the strategy's ``CheckpointIO`` (wrapped in :class:`SafeResumeIO`), except
for strategies with their own ``load_checkpoint`` (DeepSpeed, FSDP2), which is wrapped on the
instance. Both go through the same loop (:meth:`LatestResolver.load`): a committed checkpoint's bytes
are verified against its marker's CRC32s while it loads (:mod:`~lplugins.callbacks._verify`) and the
loaded step and epoch against the marker; ``"latest"`` tries the committed checkpoints newest first and
skips any that is damaged, unreadable, disallowed or inconsistent, the ranks agreeing on each one
(``gather_failures``), damaged ones moved to the quarantine; an explicit path that fails is an error.
``trainer.ckpt_path`` reports what was loaded, and rank zero says what was skipped, why, and what was
resumed (Lightning's "Restoring states from the checkpoint path at latest" is kept off the log: it
would name a path that does not exist).

Lightning's own words are understood too (:func:`understand_ckpt_path`): ``ckpt_path="last"`` on a
Trainer with a ``DurableCheckpoint`` means ``"latest"``, and ``"latest"`` on one without is a clear error.
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lplugins import _lightning
from lplugins._log import announce
from lplugins.callbacks import _safe_io
from lplugins.callbacks._collective import agree_on_path, gather_failures
from lplugins.callbacks._errors import (
    CheckpointResumeError,
    DamagedCheckpointError,
    InconsistentCheckpointError,
)
from lplugins.callbacks._latest import LAST, LATEST, latest_checkpoint
from lplugins.callbacks._portable import portable_path
from lplugins.callbacks._record import COMMIT_SUFFIX, Record, order
from lplugins.callbacks._refusals import (
    DAMAGED,
    DISALLOWED,
    INCONSISTENT,
    UNREADABLE,
    failure_kind,
    refused_error,
    unsafe_error,
)
from lplugins.callbacks._reshard import check_resume, describe_resume, needs_full_checkpoint
from lplugins.callbacks._safe_io import SafeResumeIO, load_weights_only, warn_not_weights_only
from lplugins.callbacks._storage import Storage
from lplugins.callbacks._storages import open_storage
from lplugins.callbacks._verify import Overlapped, bytes_problem, can_verify

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "LAST",
    "LATEST",
    "LatestResolver",
    "NoCheckpoint",
    "SafeResumeIO",
    "latest_checkpoint",
    "load_weights_only",
    "understand_ckpt_path",
    "warn_not_weights_only",
]


class NoCheckpoint(dict[str, Any]):
    """What ``ckpt_path="latest"`` loads when there is nothing to resume: a falsy dict Lightning skips."""

    def __bool__(self) -> bool:
        return False

    @classmethod
    def new(cls) -> NoCheckpoint:
        """An empty checkpoint that carries the Lightning version (Lightning reads it)."""
        import lightning

        return cls({"pytorch-lightning_version": lightning.__version__})


class LatestResolver:
    """Loads for one trainer: ``"latest"`` with fallback, every byte verified; installs itself in front of both
    load paths.

    Args:
        trainer: The trainer whose loads go through it.
        dirpath: The checkpoint directory ``"latest"`` refers to.
        deep: Verify every byte *before* loading (default: while loading, on a second thread).
        forget: Called on rank zero with the name of each checkpoint moved to the quarantine at load
            (the callback's ledger drops it).
    """

    def __init__(
        self, trainer: Trainer, dirpath: str, deep: bool = False, forget: Callable[[str], None] | None = None
    ) -> None:
        self.trainer = trainer
        self.dirpath = dirpath
        self.deep = deep
        self._unpickles = False  # the load in progress runs with weights_only=False
        self.forget = forget
        #: What the last ``"latest"`` resolved to.
        self.resolved: str | None = None
        #: The file loaded in place of the checkpoint resolved (its conversion to one full checkpoint), if any.
        self.converted: str | None = None
        self._io: SafeResumeIO | None = None
        self._unhide: Callable[[], None] | None = None
        self._in_place = False
        self._loading = False  # inside a load: a nested one (a strategy calling its CheckpointIO) passes through
        #: The load in progress is of a committed local file whose every byte is checked against its CRC32
        #: (before or while it loads): :class:`SafeResumeIO` may memory-map it (``_safe_io.mapped_load``).
        self.mapping = False

    # ------------------------------------------------------------------------------------------ loading
    def load(self, path: Any, attempt: Callable[[str], Any], *, in_place: bool = False) -> Any:
        """Load ``path`` with ``attempt`` (a collective): ``"latest"`` falls back, an explicit path raises.

        Args:
            path: ``"latest"`` or a checkpoint path.
            attempt: Loads one path and returns what Lightning expects (the checkpoint dict).
            in_place: The load changes the model in place (a strategy's own ``load_checkpoint``): when
                every candidate fails, this raises instead of starting fresh.

        Raises:
            DamagedCheckpointError: an explicit path's bytes do not match its commit marker.
            InconsistentCheckpointError: an explicit path's state is not what its marker says.
            UnsafeCheckpointError: an explicit path holds disallowed objects.
            CheckpointResumeError: ranks resolved different paths; an explicit path failed on another rank;
                or (``in_place``) no candidate of ``"latest"`` loaded.
        """
        if self._loading:
            return attempt(path)
        # a full unpickle (weights_only=False) runs code: every byte is checked before it, not while
        self._unpickles = _lightning.running_weights_only() is False
        self._in_place = in_place  # a strategy's own load: never memory-mapped under it
        self.converted = None  # the file loaded in its place (a conversion), when another
        if isinstance(path, str) and path == LATEST:
            return self._load_latest(attempt, in_place)
        return self._load_explicit(os.fspath(path), attempt)

    def _load_explicit(self, path: str, attempt: Callable[[str], Any]) -> Any:
        agree_on_path(self.trainer, path)
        storage = open_storage(self.dirpath)
        record = self._record_for(storage, path)
        result, error = self._try(storage, record, path, attempt)
        failures = gather_failures(self.trainer, error, f"loading checkpoint {path}")
        if not failures:
            if record is not None:
                self._note_world(record, path)
            return result
        refused_error(failures, error)
        kind = failure_kind(failures)
        if record is not None:
            self._skip(storage, record.name, kind, failures, explicit=True)
        if error is not None:
            raise error
        details = "; ".join(f"rank {rank}: {text}" for rank, text in failures)
        raise CheckpointResumeError(f"Loading checkpoint {path} failed on another rank ({details}).")

    def _load_latest(self, attempt: Callable[[str], Any], in_place: bool) -> Any:
        storage = open_storage(self.dirpath)
        records: list[Record] = []
        for record, marker, problem in storage.markers():
            if record is not None:
                records.append(record)
            else:
                announce(
                    "lplugins: ckpt_path='latest': skipped %s: %s (not a checkpoint to resume from)",
                    storage.path(marker), problem,
                )  # fmt: skip
        records.sort(key=order, reverse=True)
        skipped: list[tuple[str, str]] = []
        for record in [*records, None]:
            path = storage.path(record.name) if record is not None else None
            agree_on_path(self.trainer, path)
            if record is None or path is None:
                break
            result, error = self._try(storage, record, path, attempt)
            failures = gather_failures(self.trainer, error, f"resuming from {path}")
            if not failures:
                self._resolved(record, path, skipped)
                return result
            refused_error(failures, error)  # not this checkpoint's fault: the older ones would be refused too
            kind = failure_kind(failures)
            skipped.append((record.name, kind))
            self._skip(storage, record.name, kind, failures)
        self._resolved(None, None, skipped)
        if in_place and skipped:
            listing = ", ".join(f"{name} ({kind})" for name, kind in skipped)
            raise CheckpointResumeError(
                f"ckpt_path='latest': none of the committed checkpoints in {self.dirpath} could be loaded"
                f" ({listing}; the log says why). {type(self.trainer.strategy).__name__} loads into the model in"
                " place, so it may now hold part of one of them: not starting fresh from that. Damaged and"
                " inconsistent checkpoints were moved to the quarantine folder, so a restart starts fresh unless"
                " others are left (remove them, or for disallowed content you trust pass weights_only=False)."
            )
        return NoCheckpoint.new()

    def _record_for(self, storage: Storage, path: str) -> Record | None:
        """The commit record of ``path`` when it is a committed checkpoint of this directory."""
        name = os.path.basename(path.rstrip("/"))
        if os.path.normpath(storage.path(name)) != os.path.normpath(path):
            return None
        try:
            return Record.from_json(storage.read_bytes(name + COMMIT_SUFFIX))
        except (OSError, ValueError):
            return None

    def _try(
        self, storage: Storage, record: Record | None, path: str, attempt: Callable[[str], Any]
    ) -> tuple[Any, BaseException | None]:
        """Load ``path`` with its bytes verified against ``record``: ``(result, None)`` or ``(None, error)``."""
        try:
            return self._verified(storage, record, path, attempt), None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # every rank reports, then all skip (or raise) together; torch DCP's
            return None, err  # CheckpointException is a BaseException, and a load's failure all the same

    def _verified(self, storage: Storage, record: Record | None, path: str, attempt: Callable[[str], Any]) -> Any:
        if record is None:  # not a committed checkpoint of this directory: nothing to verify against
            return self._attempt(path, attempt)
        full = needs_full_checkpoint(self.trainer, record)
        overlapped = can_verify(record) and not (full or self.deep or self._unpickles or not storage.parallel_reads)
        # sizes, and the archive directory unless the whole file's CRC32 is checked while it loads
        problem = storage.check(record, archive=not (overlapped and record.crc32 is not None))
        if problem is not None:
            raise DamagedCheckpointError(f"{path}: {problem}")
        check_resume(self.trainer, record, path)  # a strategy change its layout cannot follow: refused
        rank, world = self.trainer.global_rank, max(1, self.trainer.world_size)
        seen: list[Any] = []  # the file the CRC32 pass read: the one loaded must be the same, unchanged
        check = functools.partial(bytes_problem, storage, record, rank, world, seen=seen)
        _safe_io.OPENED.pop(path, None)
        if full:  # converted from verified bytes only
            if can_verify(record) and (problem := check()) is not None:
                raise DamagedCheckpointError(f"{path}: {problem}")
            self.converted = portable_path(self.trainer, record, path)
            result = self._attempt(self.converted, attempt)
        elif not can_verify(record):
            result = self._attempt(path, attempt)
        elif not overlapped:  # before loading: deep, a full unpickle, or remote (one read at a time)
            if (problem := check()) is not None:
                raise DamagedCheckpointError(f"{path}: {problem}")
            result = self._attempt(path, attempt, mapping=storage.parallel_reads and record.kind != "dir")
        else:
            with Overlapped(check) as job:
                try:
                    result = self._attempt(path, attempt, mapping=record.kind != "dir")
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as err:
                    if (problem := job.result()) is not None:
                        raise DamagedCheckpointError(f"{path}: {problem}") from err
                    raise
            if (problem := job.result()) is not None:
                raise DamagedCheckpointError(f"{path}: {problem}")
        opened = _safe_io.OPENED.pop(path, None)
        if seen and opened is not None and opened != seen[0]:
            raise DamagedCheckpointError(
                f"{path}: the file loaded is not the one whose CRC32 was checked (replaced or written meanwhile)"
            )
        self._cross_check(record, result, path)
        self._adopt_moved_state(result)
        return result

    def _adopt_moved_state(self, loaded: Any) -> None:
        """A checkpoint moved to another directory: its ``DurableCheckpoint`` state (data position, RNG) is this one's.

        Lightning hands a callback the state saved under its ``state_key``, which names the ``dirpath``; a run
        moved to another machine or path would otherwise resume with a fresh data position.
        """
        callbacks = loaded.get("callbacks") if isinstance(loaded, dict) else None
        if not isinstance(callbacks, dict):
            return
        trainer: Any = self.trainer
        mine = [cb.state_key for cb in trainer.callbacks if type(cb).__name__ == "DurableCheckpoint"]
        saved = [key for key in callbacks if isinstance(key, str) and key.startswith("DurableCheckpoint{")]
        if len(mine) == 1 and len(saved) == 1 and saved[0] != mine[0] and mine[0] not in callbacks:
            callbacks[mine[0]] = callbacks.pop(saved[0])
            announce(
                "lplugins: the checkpoint was written as %s; its state (data position, RNG) resumes here", saved[0]
            )

    def _attempt(self, path: str, attempt: Callable[[str], Any], mapping: bool = False) -> Any:
        self._loading, self.mapping = True, mapping and not self._in_place
        try:
            return attempt(path)
        finally:
            self._loading = self.mapping = False

    @staticmethod
    def _cross_check(record: Record, loaded: Any, path: str) -> None:
        """The loaded state must be the one the marker describes (its step; its epoch, or the next at an epoch end)."""
        if not isinstance(loaded, dict):
            raise InconsistentCheckpointError(f"{path}: it holds a {type(loaded).__name__}, not a checkpoint's dict")
        step, epoch = loaded.get("global_step"), loaded.get("epoch")
        problems = []
        if isinstance(step, int) and step != record.global_step:
            problems.append(f"it holds global_step {step}, its commit marker says {record.global_step}")
        if isinstance(epoch, int) and epoch not in (record.epoch, record.epoch + 1):
            problems.append(f"it holds epoch {epoch}, its commit marker says {record.epoch}")
        if problems:
            raise InconsistentCheckpointError(f"{path}: {'; '.join(problems)}")

    # ------------------------------------------------------------------------------------------ telling
    def _skip(
        self, storage: Storage, name: str, kind: str, failures: list[tuple[int, str]], explicit: bool = False
    ) -> None:
        """Rank zero: quarantine a damaged or inconsistent checkpoint, and say what was skipped and why."""
        if not self.trainer.is_global_zero:
            return
        path = storage.path(name)
        detail = "; ".join(
            (f"rank {rank}: " if self.trainer.world_size > 1 else "")
            + text.splitlines()[0].replace(f"{path}: ", "").replace(f"{path!r}", "it")
            for rank, text in failures
        )
        where = ""
        if kind in (DAMAGED, INCONSISTENT):
            try:
                where = f"; moved to {storage.quarantine(name, f'{kind}: {detail}')} (kept, never resumed from)"
            except OSError as err:
                where = f"; could not move it to the quarantine folder ({err})"
            if self.forget is not None:
                self.forget(name)
        verb = "could not load" if explicit else "skipped"
        what = {
            DAMAGED: "damaged: its bytes do not match its commit marker",
            INCONSISTENT: "inconsistent: the state in it is not the one its commit marker describes",
            DISALLOWED: "disallowed content: it holds objects torch.load(weights_only=True) refuses, or exceeds"
            " lplugins' bounds for a checkpoint file; nothing in it was run. Left in place: load it with"
            " weights_only=False only if you wrote it and trust it",
            UNREADABLE: "unreadable: loading it failed",
        }[kind]
        announce("lplugins: ckpt_path: %s %s (%s) [%s]%s", verb, path, what, detail, where)

    def _resolved(self, record: Record | None, resolved: str | None, skipped: list[tuple[str, str]]) -> None:
        """Record and say on rank zero what ``"latest"`` resolved to, and why."""
        self.resolved = resolved
        _lightning.set_ckpt_path(self.trainer, resolved)
        passed = "; ".join(f"skipped newer {name}: {kind}" for name, kind in skipped)
        passed = f" ({passed})" if passed else ""
        if record is None or resolved is None:
            nothing = "no loadable committed checkpoint" if skipped else "no committed checkpoint"
            announce("lplugins: ckpt_path='latest': %s in %s: starting fresh%s", nothing, self.dirpath, passed)
            return
        if not can_verify(record):
            check = "size and archive directory checked; its marker has no CRC32 (written with crc32=False)"
        elif self.deep or self._unpickles or not open_storage(self.dirpath).parallel_reads:
            check = "every byte checked against its CRC32 before loading"
        else:
            check = "every byte checked against its CRC32 while loading"
        if self.converted not in (None, resolved):
            check = (
                f"every byte checked against its CRC32, then its conversion {self.converted} loaded, made from those"
                " bytes and checked against its own manifest"
            )
        announce(
            "lplugins: ckpt_path='latest': resuming from %s (step %d, epoch %d, trigger: %s): the newest committed"
            " checkpoint in %s that loads and matches its commit marker (%s)%s",
            resolved, record.global_step, record.epoch, record.reason or "unknown", self.dirpath, check, passed,
        )  # fmt: skip
        self._note_world(record, resolved)

    def _note_world(self, record: Record, path: str) -> None:
        describe_resume(self.trainer, record, path)

    # ------------------------------------------------------------------------------------------ installing
    def install(self) -> None:
        """Resolve in front of the strategy's ``CheckpointIO`` and, if it has one, its own ``load_checkpoint``."""
        strategy = self.trainer.strategy
        if not isinstance(strategy.checkpoint_io, SafeResumeIO):
            self._io = SafeResumeIO(strategy.checkpoint_io, self)
            strategy.checkpoint_io = self._io
        if loads_itself(self.trainer):
            _lightning.wrap_strategy_load(strategy, self._resolving_load)
        if self._unhide is None:
            # Lightning would log "Restoring states from the checkpoint path at latest" even for a fresh start
            self._unhide = _lightning.hide_lightning_info(f"Restoring states from the checkpoint path at {LATEST}")

    def uninstall(self) -> None:
        """Give the strategy its own ``CheckpointIO`` and ``load_checkpoint`` back."""
        strategy = self.trainer.strategy
        if self._io is not None and strategy.checkpoint_io is self._io:
            strategy.checkpoint_io = self._io.inner
        self._io = None
        _lightning.unwrap_strategy_load(strategy)
        if self._unhide is not None:
            self._unhide()
            self._unhide = None

    def _resolving_load(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The strategy's own ``load_checkpoint`` behind :meth:`load` (``weights_only`` passed on unchanged)."""

        def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            def attempt(target: str) -> Any:
                # ``weights_only`` as given: the strategy honours it (and warns for False, naming the file)
                try:
                    return original(target, *args, **kwargs)
                except pickle.UnpicklingError as err:
                    raise unsafe_error(target, err) from err

            return self.load(checkpoint_path, attempt, in_place=True)

        return load_checkpoint


def understand_ckpt_path(trainer: Trainer, durable: type) -> None:
    """Read Lightning's ``ckpt_path`` words the lplugins way on this trainer (its own instance only; idempotent).

    * ``"last"`` with a ``DurableCheckpoint`` in ``trainer.callbacks``: its newest committed checkpoint
      (resolved as ``"latest"``), said once on rank zero. Lightning's ``"last"`` only knows
      ``ModelCheckpoint`` and would start from scratch.
    * ``"latest"`` without one: :class:`~lplugins.callbacks.CheckpointResumeError` naming the fix, instead
      of Lightning's ``FileNotFoundError: Checkpoint file not found: latest`` (unless the LightningModule's
      ``configure_callbacks`` may add one later).

    Args:
        trainer: The Trainer, before ``fit`` (in ``Trainer()`` or any hook).
        durable: The class whose instances in ``trainer.callbacks`` resolve ``"latest"``
            (:class:`~lplugins.callbacks.DurableCheckpoint`; passed in, this module sits below it).
    """
    _lightning.translate_ckpt_path(trainer, functools.partial(_translate, durable))


def _translate(durable_type: type, trainer: Trainer, state_fn: Any, ckpt_path: Any) -> Any:
    """``ckpt_path`` as lplugins reads it (see :func:`understand_ckpt_path`)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not isinstance(ckpt_path, str) or ckpt_path not in (LAST, LATEST):
        return ckpt_path
    durable = [cb for cb in trainer.callbacks if isinstance(cb, durable_type)]  # type: ignore[attr-defined]
    fn = getattr(state_fn, "value", state_fn)
    if ckpt_path == LAST and durable:
        announce(
            "lplugins: %s(ckpt_path='last') means DurableCheckpoint's newest committed checkpoint (as 'latest')", fn
        )
        return LATEST
    if ckpt_path == LATEST and not durable:
        module = trainer.lightning_module
        if module is None or not is_overridden("configure_callbacks", module):
            raise CheckpointResumeError(
                f"trainer.{fn}(ckpt_path='latest') resumes from a DurableCheckpoint's directory, but this Trainer"
                " has no DurableCheckpoint: add DurableCheckpoint(dirpath=...) to the Trainer's callbacks"
                " (lplugins.callbacks.DurableCheckpoint, or the name 'durable_checkpoint'), or pass the path"
                " of a checkpoint file."
            )
    return ckpt_path


def loads_itself(trainer: Trainer) -> bool:
    """Whether the strategy has its own ``load_checkpoint`` (DeepSpeed, FSDP2: they bypass ``CheckpointIO``)."""
    from lightning.pytorch.strategies import Strategy

    return type(trainer.strategy).load_checkpoint is not Strategy.load_checkpoint
