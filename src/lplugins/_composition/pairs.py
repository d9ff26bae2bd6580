"""Pairs of Trainer arguments that do not fit together, refused when the Trainer is composed.

Each check turns what Lightning would do later (fail in ``fit`` after the processes started, or
silently switch to something else) into an error before training that names the bad pair, says
why, and says what works instead:

* a Lightning DeepSpeed (or FSDP) strategy name on CPU -> the lplugins name that runs there;
* fp16 mixed precision on CPU (Lightning would switch to bf16 with a warning);
* a registered precision with a DeepSpeed or FSDP strategy, which use their own precision plugins;
* ``accumulate_grad_batches`` ints below 1 (and bools);
* common precision spellings that are not Lightning's (``fp16`` means ``16-mixed``);
* Lightning's default ``ModelCheckpoint`` beside an attached checkpoint callback
  (:func:`is_default_model_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from lplugins._errors import CompositionError
from lplugins._validate import positive_int

__all__ = [
    "PRECISION_ALIASES",
    "check_accumulation_int",
    "check_precision_on_accelerator",
    "check_precision_plugin_for_strategy",
    "check_strategy_on_accelerator",
    "is_default_model_checkpoint",
    "precision_hint",
]

#: Spellings users type for a precision, and Lightning's name for what they mean.
PRECISION_ALIASES: Mapping[str, str] = {
    "fp16": "16-mixed",
    "float16": "16-mixed",
    "16bit": "16-mixed",
    "16-bit": "16-mixed",
    "amp": "16-mixed",
    "mixed": "16-mixed",
    "fp16-mixed": "16-mixed",
    "16_mixed": "16-mixed",
    "half": "16-true",
    "fp16-true": "16-true",
    "bfloat16": "bf16-mixed",
    "bf16_mixed": "bf16-mixed",
    "bf16-amp": "bf16-mixed",
    "bfloat16-mixed": "bf16-mixed",
    "bf16_true": "bf16-true",
    "fp32": "32-true",
    "float32": "32-true",
    "float": "32-true",
    "full": "32-true",
    "32bit": "32-true",
    "fp64": "64-true",
    "float64": "64-true",
    "double": "64-true",
    "64bit": "64-true",
    "te": "transformer-engine",
}

#: What runs on CPU among Lightning's precisions.
CPU_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true", "64-true")


def precision_hint(name: object, available: Collection[str]) -> str | None:
    """Lightning's name for a common spelling of a precision (``"fp16"`` -> ``"16-mixed"``), if it is available.

    >>> precision_hint("FP16", ["16-mixed", "bf16-mixed"])
    '16-mixed'
    >>> precision_hint("bf16-mixd", ["16-mixed", "bf16-mixed"]) is None
    True
    """
    if not isinstance(name, str):
        return None
    hint = PRECISION_ALIASES.get(name.strip().lower())
    return hint if hint in available else None


def _where(accelerator: str, given: object) -> str:
    if given is None or given == "auto":
        return f"accelerator='auto' (the default), which is {accelerator!r} on this machine"
    return f"accelerator={given!r}"


def check_strategy_on_accelerator(
    name: str, strategy_class: type | None, accelerator: str, given: object, registered: Collection[str]
) -> None:
    """Refuse a Lightning DeepSpeed or FSDP strategy *name* on CPU and point to the lplugins one.

    Lightning's ``DeepSpeedStrategy`` refuses any accelerator but CUDA once the processes run;
    its FSDP refuses CPU when the Trainer is built. lplugins' ``deepspeed_*_cpu`` and ``fsdp2``
    run on CPU (gloo).

    Args:
        name: The strategy name the user gave (a Lightning one: lplugins names are resolved before).
        strategy_class: The class the name stands for in Lightning's ``StrategyRegistry``.
        accelerator: The resolved accelerator.
        given: The ``accelerator`` argument as given.
        registered: lplugins' strategy names (what can be suggested).

    Raises:
        CompositionError: the pair does not run; the message names the lplugins name that does.
    """
    if accelerator != "cpu" or strategy_class is None:
        return
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if issubclass(strategy_class, DeepSpeedStrategy):
        family, counterpart = "DeepSpeed", f"{name}_cpu" if name.startswith("deepspeed_") else "deepspeed_stage_2_cpu"
        if counterpart not in registered:
            counterpart = next((n for n in sorted(registered) if n.startswith("deepspeed") and n.endswith("_cpu")), "")
        why = "Lightning's DeepSpeedStrategy runs on CUDA only (it fails in fit, after the processes started)"
    elif issubclass(strategy_class, FSDPStrategy):
        family, counterpart = "FSDP", "fsdp2" if "fsdp2" in registered else ""
        why = "Lightning's FSDPStrategy requires a GPU accelerator (torch's FSDP1 refuses CPU)"
    else:
        return
    fix = (
        f" Use strategy={counterpart!r}: the lplugins {family} strategy that runs on CPU (gloo) as well as CUDA."
        if counterpart
        else f" lplugins' {family} strategies that run on CPU are not loaded (see `lplugins list`)."
    )
    raise CompositionError(f"strategy={name!r} cannot run with {_where(accelerator, given)}: {why}.{fix}")


def check_precision_on_accelerator(precision: str, accelerator: str, given: object) -> None:
    """Refuse fp16 mixed precision on CPU (Lightning would switch to ``bf16-mixed`` instead).

    Args:
        precision: Lightning's unified precision name (``"16-mixed"`` for ``16`` and ``"16"``).
        accelerator: The resolved accelerator.
        given: The ``accelerator`` argument as given.

    Raises:
        CompositionError: fp16 AMP on CPU; the message lists what runs on CPU.
    """
    if accelerator == "cpu" and precision == "16-mixed":
        raise CompositionError(
            f"precision='16-mixed' (fp16 mixed precision) cannot be used with {_where(accelerator, given)}: AMP with "
            f"fp16 and a gradient scaler needs a GPU, and Lightning would silently train in 'bf16-mixed' instead. "
            f"On CPU use one of: {', '.join(CPU_PRECISIONS)} (or 'auto')."
        )


def check_precision_plugin_for_strategy(
    name: str, plugin: Any, declared: Collection[str] | None, strategy_class: type | None, label: str
) -> None:
    """Refuse a registered precision with a DeepSpeed or FSDP strategy, unless it is built for them.

    Those strategies need their own precision plugin (``DeepSpeedPrecision``/``FSDPPrecision``);
    any other one reaches DeepSpeed or FSDP and fails inside it (``KeyError: 0`` for float64 in
    DeepSpeed), as Lightning's ``64-true`` would, which is refused the same way. A plugin that lists
    the strategy in ``register(..., strategies=(...))`` is trusted.

    Args:
        name: The precision's registered name.
        plugin: The precision plugin object its factory built.
        declared: The ``strategies`` the plugin declared (``None``: not declared).
        strategy_class: The strategy's class (``None`` when unknown or "auto").
        label: The strategy's name, for the message.

    Raises:
        CompositionError: the precision cannot work with the strategy.
    """
    if strategy_class is None or (declared is not None and label in declared):
        return
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    from lplugins import _lightning

    needed: type
    if issubclass(strategy_class, DeepSpeedStrategy):
        needed, family, allowed = DeepSpeedPrecision, "DeepSpeed", _lightning.strategy_precisions("deepspeed")
    elif issubclass(strategy_class, FSDPStrategy):
        needed, family, allowed = FSDPPrecision, "FSDP", _lightning.strategy_precisions("fsdp")
    else:
        return
    if isinstance(plugin, needed):
        return
    raise CompositionError(
        f"Precision {name!r} ({type(plugin).__name__}) cannot be used with strategy {label!r}: {family} uses its own "
        f"precision plugin ({needed.__name__}) and {name!r} is not one, nor declared for {label!r} by its plugin "
        f"(register(..., strategies=(...))). With {label!r} use one of: {', '.join(allowed)}."
    )


def check_accumulation_int(value: Any) -> None:
    """Refuse ``accumulate_grad_batches`` ints below 1, and bools (``True`` is an int in Python).

    Raises:
        CompositionError: the value; the message says what is allowed.
    """
    if isinstance(value, bool) or (isinstance(value, int) and value < 1):
        try:
            positive_int("accumulate_grad_batches", value, error=CompositionError)
        except CompositionError as exc:
            raise CompositionError(
                f"{exc} (Or an epoch-keyed dict such as {{0: 8, 5: 4}}, a schedule name or {{'name': ..., **params}}.)"
            ) from None


def is_default_model_checkpoint(callback: Any) -> bool:
    """Whether ``callback`` is a ``ModelCheckpoint`` exactly as ``Trainer`` adds by default.

    That is: that class (not a subclass), and every attribute equal to a fresh ``ModelCheckpoint()``'s
    (so not configured, and not used yet). :func:`lplugins.attach` replaces such a one when it attaches
    another checkpoint callback: two checkpoint systems would write two sets of files.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    if type(callback) is not ModelCheckpoint:
        return False
    mine, fresh = vars(callback), vars(ModelCheckpoint())
    return mine.keys() == fresh.keys() and all(_same(mine[k], fresh[k]) for k in fresh)


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:
        return False
