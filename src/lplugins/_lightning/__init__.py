"""The Lightning boundary: every access lplugins makes to Lightning's (and DeepSpeed's, torch's) private internals.

Lightning's public API does not offer everything lplugins needs (reordering callbacks the way
``Trainer()`` does, reading the path ``fit`` will restore from, deciding accumulation windows from
outside the loop...). Each such access lives in this package and nowhere else, as a small function
with a name that says what it does, next to the declaration of each private name it touches
(:data:`PRIVATES`, :mod:`lplugins._lightning.registry`), one module per area:

* ``trainer``: composing a Trainer, checkpointing, Lightning's own messages, the data position;
* ``accumulation``: the epoch loop's step and zero-grad decisions, for accumulation schedules;
* ``strategies``: DeepSpeed on CPU, process groups, timeouts;
* ``loading``: what a strategy's own load may unpickle (the weights-only policy);
* ``portable``: checkpoint layouts (ZeRO and sharded directories, files) and the conversions between them;
  ``zero_shards``: a ZeRO directory read once as one full checkpoint; ``converted``: conversions made once and
  kept beside their checkpoint;
* ``runtime``: Lightning objects found on a stack or in ``sys.modules`` (the watchdog, the guard).

``tests/test_lightning_internals.py`` resolves every entry of :data:`PRIVATES` against the
installed Lightning and fails, naming the attribute, when a release renames or removes one; a
second test greps the rest of ``src/lplugins`` for private Lightning names. CI runs those tests on
the oldest and the newest supported Lightning. To add an access: write a function in the module of
its area, declare what it touches with ``_private``, and call the function from the module that
needs it (this package re-exports it).

May import: the standard library, ``lplugins._errors``; Lightning, torch and DeepSpeed inside
functions only (importing it imports none of them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lplugins._lightning.accumulation import (
    is_last_batch_of_epoch,
    logging_step,
    override_accumulation_windows,
    reset_deepspeed_accumulation_boundary,
    set_progress_bar_values,
    setup_train_data,
)
from lplugins._lightning.registry import (
    CHECKED_VERSIONS,
    PRIVATES,
    Private,
)
from lplugins._lightning.runtime import (
    loaded_classes,
    logged_metric,
)
from lplugins._lightning.strategies import (
    DeepSpeedHooksMixin,
    attached_trainer,
    deepspeed_auto_batch_size,
    init_deepspeed_distributed,
    init_dist_connection,
    process_group_backend,
    shard_over_all_ranks,
    strategy_timeout,
)
from lplugins._lightning.trainer import (
    LITLOGGER_TIP,
    NOT_RESUMABLE_WARNING,
    InstantiateTrainerMixin,
    batches_resumed_in_epoch,
    batches_trained_in_epoch,
    callback_state_key,
    checkpoint_dict,
    hide_lightning_info,
    hide_lightning_warning,
    reorder_callbacks,
    set_ckpt_path,
    shift_batches_trained_in_epoch,
    shift_epochs,
    strategy_precisions,
    trainer_being_built,
    translate_ckpt_path,
    unified_precision,
    unwrap_strategy_load,
    wrap_process_dataloader,
    wrap_strategy_load,
)

if TYPE_CHECKING:
    from lplugins._lightning.loading import (
        DCP_METADATA_TYPES,
        DEEPSPEED_SAFE_TYPES,
        load_weights_only,
        running_weights_only,
        unsafe_checkpoint_error,
        weights_only_file,
    )
    from lplugins._lightning.portable import (
        LayoutError,
        load_full_into_deepspeed,
        restore_loss_scale,
        torch_loss_scale,
    )

#: Names imported on first use: the checkpoint formats' modules are needed by a resume, not by ``load()``.
_LAZY = {
    **dict.fromkeys(
        (
            "DCP_METADATA_TYPES",
            "DEEPSPEED_SAFE_TYPES",
            "load_weights_only",
            "running_weights_only",
            "unsafe_checkpoint_error",
            "weights_only_file",
        ),
        "loading",
    ),
    **dict.fromkeys(("LayoutError", "load_full_into_deepspeed", "restore_loss_scale", "torch_loss_scale"), "portable"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CHECKED_VERSIONS",
    "LayoutError",
    "load_full_into_deepspeed",
    "restore_loss_scale",
    "torch_loss_scale",
    "DCP_METADATA_TYPES",
    "DEEPSPEED_SAFE_TYPES",
    "DeepSpeedHooksMixin",
    "InstantiateTrainerMixin",
    "LITLOGGER_TIP",
    "NOT_RESUMABLE_WARNING",
    "PRIVATES",
    "Private",
    "attached_trainer",
    "batches_resumed_in_epoch",
    "batches_trained_in_epoch",
    "callback_state_key",
    "checkpoint_dict",
    "deepspeed_auto_batch_size",
    "hide_lightning_info",
    "hide_lightning_warning",
    "init_deepspeed_distributed",
    "init_dist_connection",
    "is_last_batch_of_epoch",
    "load_weights_only",
    "loaded_classes",
    "logged_metric",
    "logging_step",
    "override_accumulation_windows",
    "process_group_backend",
    "reorder_callbacks",
    "reset_deepspeed_accumulation_boundary",
    "running_weights_only",
    "set_ckpt_path",
    "set_progress_bar_values",
    "setup_train_data",
    "shard_over_all_ranks",
    "shift_batches_trained_in_epoch",
    "shift_epochs",
    "strategy_precisions",
    "strategy_timeout",
    "trainer_being_built",
    "translate_ckpt_path",
    "unified_precision",
    "unsafe_checkpoint_error",
    "unwrap_strategy_load",
    "weights_only_file",
    "wrap_process_dataloader",
    "wrap_strategy_load",
]
