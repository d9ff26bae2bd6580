"""Turning lplugins names into objects for a stock ``lightning.pytorch.Trainer``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lplugins import _lightning
from lplugins._composition import pairs as _pairs
from lplugins._composition.resolve import (
    as_list,
    check_duplicates,
    check_trainer_arguments,
    detect_cluster_environment,
    is_cluster_environment,
    resolve_accumulation,
    resolve_callback,
    resolve_plugin,
    resolve_precision,
    resolve_strategy,
    strategy_class,
)
from lplugins._errors import CompositionError
from lplugins._lightning import namespace as _namespace
from lplugins._log import announce
from lplugins._plugins.manager import PluginManager, get_manager
from lplugins._validate import is_int
from lplugins.precision._auto import resolve_accelerator

if TYPE_CHECKING:
    from lightning.pytorch import Callback, Trainer

#: The Lightning namespace this module is written for (its twin ``lplugins._pl._composition.compose`` serves the other).
_OWN_NAMESPACE = _namespace.of_module(__name__)


def compose(
    *, manager: PluginManager | None = None, cpu_bf16: bool = False, namespace: str | None = None, **trainer_kwargs: Any
) -> dict[str, Any]:
    """Turn Trainer keyword arguments that use lplugins names into ones the stock Trainer accepts.

    ``strategy``, ``precision``, ``accumulate_grad_batches``, ``callbacks`` and ``plugins`` may use
    names registered by plugins (built-ins included); everything else is passed through unchanged.
    Every name and argument is checked here, before any training starts. Callbacks contributed by
    plugins through ``lplugins_trainer_callbacks`` are added.

    Args:
        manager: The plugin manager (default: the process-wide one, loaded on first use).
        cpu_bf16: Let ``precision="auto"`` pick bf16 on CPU.
        namespace: ``"lightning"`` (for ``lightning.pytorch.Trainer``) or ``"pytorch_lightning"``
            (for ``pytorch_lightning.Trainer``); default: the namespace of the Lightning objects
            passed, else the one already imported (``"lightning"`` when both or neither are).
        **trainer_kwargs: Keyword arguments for ``lightning.pytorch.Trainer``. In addition to what
            Lightning accepts: ``strategy`` may be any registered strategy name or
            ``{"name": ..., **params}`` (Lightning's names too); ``precision`` may be ``"auto"``, a
            registered precision name or ``{"name": ..., **params}`` for one;
            ``accumulate_grad_batches`` may be an epoch-keyed dict (``{0: 8, 5: 4}``), a schedule
            name, ``{"name": ..., **params}`` or a schedule object; ``callbacks`` and ``plugins``
            may hold registered names or ``{"name": ..., **params}``.

    Returns:
        Keyword arguments for ``lightning.pytorch.Trainer``.

    Raises:
        UnknownNameError: an unknown strategy, precision, schedule or callback name (the message
            lists the names that exist and the closest match; ``BlockedNameError`` when a blocked
            plugin provides it).
        ParameterError: a parameter a named component does not take, or a required one missing.
        CompositionError: an unknown Trainer argument, or parts that do not fit together (a
            Lightning DeepSpeed name or ``16-mixed`` on CPU, a precision its strategy cannot use,
            ``accumulate_grad_batches`` below 1).

    Examples:
        >>> import lplugins
        >>> from lightning.pytorch import Trainer
        >>> kwargs = lplugins.compose(accelerator="cpu", precision="auto", max_steps=1, logger=False)
        >>> kwargs["precision"]
        '32-true'
        >>> trainer = Trainer(**kwargs, enable_progress_bar=False, enable_model_summary=False)
    """
    namespace, why = _namespace.choose(namespace, trainer_kwargs)
    if why is not None:
        announce(
            "lplugins: compose() builds for a %s.Trainer (%s); pass namespace='lightning' or 'pytorch_lightning' "
            "to choose.",
            _namespace.NAMESPACES[namespace][0],
            why,
        )
    if namespace != _OWN_NAMESPACE:
        twin = _namespace.module_for(__name__, namespace)
        return twin.compose(manager=manager, cpu_bf16=cpu_bf16, namespace=namespace, **trainer_kwargs)
    with _namespace.using(namespace):
        return _compose(manager, cpu_bf16, trainer_kwargs)


def _compose(manager: PluginManager | None, cpu_bf16: bool, trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
    manager = manager or get_manager()
    check_trainer_arguments(trainer_kwargs)
    _pairs.check_accumulation_int(trainer_kwargs.get("accumulate_grad_batches"))
    out = dict(trainer_kwargs)
    plugins = as_list(out.pop("plugins", None))
    callbacks = as_list(out.pop("callbacks", None))

    accelerator = resolve_accelerator(out.get("accelerator"))
    strategy_component = None
    strategy = out.get("strategy")
    if isinstance(strategy, (str, Mapping)):
        strategy_component, out["strategy"] = resolve_strategy(manager, strategy, trainer_kwargs)

    resolved_plugins: list[Any] = []
    for item in plugins:
        resolved_plugins.append(resolve_plugin(manager, item, accelerator, out.get("strategy"), strategy_component))

    precision = out.get("precision")
    hook_view = dict(trainer_kwargs)
    if precision is not None:
        precision_obj = resolve_precision(
            manager, precision, accelerator, out.get("strategy"), strategy_component, cpu_bf16, out.get("accelerator")
        )
        if isinstance(precision_obj, (str, int)):
            out["precision"] = hook_view["precision"] = precision_obj
        else:
            out.pop("precision")
            resolved_plugins.append(precision_obj)

    name = strategy.get("name") if isinstance(strategy, Mapping) else strategy
    if strategy_component is None and isinstance(name, str):
        registered = manager.registry("strategy")
        _pairs.check_strategy_on_accelerator(
            name, strategy_class(name), accelerator, trainer_kwargs.get("accelerator"), list(registered)
        )

    if not any(is_cluster_environment(p) for p in resolved_plugins):
        detected = detect_cluster_environment(manager)
        if detected is not None:
            resolved_plugins.append(detected)

    accumulation: Any = out.get("accumulate_grad_batches")
    if accumulation is not None and not is_int(accumulation):
        out.pop("accumulate_grad_batches")
        callbacks.append(resolve_accumulation(manager, accumulation))

    resolved_callbacks = [resolve_callback(manager, cb) for cb in callbacks]
    if is_int(accumulation) and accumulation > 1:
        from lplugins.accumulation import AccumulationScheduler

        if any(isinstance(cb, AccumulationScheduler) for cb in resolved_callbacks):
            raise CompositionError(
                f"accumulate_grad_batches={accumulation} and an AccumulationScheduler in callbacks both set the "
                f"accumulation factor; keep one (give the schedule as accumulate_grad_batches=...)."
            )
    resolved_callbacks.extend(manager.trainer_callbacks(MappingProxyType(hook_view)))
    check_duplicates(resolved_callbacks)

    if resolved_callbacks:
        out["callbacks"] = resolved_callbacks
    if resolved_plugins:
        out["plugins"] = resolved_plugins
    return out


def compose_trainer(
    *, manager: PluginManager | None = None, cpu_bf16: bool = False, namespace: str | None = None, **trainer_kwargs: Any
) -> Trainer:
    """``Trainer(**compose(**trainer_kwargs))`` in one call: the ``_target_`` for a config system.

    With Hydra, set ``_target_: lplugins.compose_trainer`` where a config says
    ``_target_: lightning.pytorch.Trainer``; ``hydra.utils.instantiate(cfg.trainer, callbacks=...)``
    then accepts lplugins names (strategies, precisions, schedules, ``{"name": ..., **params}``
    callbacks). OmegaConf containers (what Hydra passes without ``_convert_``) are turned into plain
    dicts and lists first.

    Args:
        manager: As for :func:`compose`.
        cpu_bf16: As for :func:`compose`.
        namespace: As for :func:`compose`: which ``Trainer`` is built.
        **trainer_kwargs: ``Trainer`` keyword arguments; names as :func:`compose` accepts them.

    Returns:
        A stock ``lightning.pytorch.Trainer`` (``pytorch_lightning.Trainer`` for that namespace).

    Raises:
        LPluginsError: as :func:`compose` (an unknown name, a bad parameter, a pair that does not fit).

    Examples:
        >>> import lplugins
        >>> trainer = lplugins.compose_trainer(
        ...     accelerator="cpu", precision="auto", max_steps=1, logger=False, enable_progress_bar=False,
        ...     enable_model_summary=False,
        ... )
        >>> type(trainer).__name__, trainer.precision
        ('Trainer', '32-true')
    """
    plain = {key: _plain_container(value) for key, value in trainer_kwargs.items()}
    chosen, _ = _namespace.choose(namespace, plain)
    if chosen != _OWN_NAMESPACE:
        twin = _namespace.module_for(__name__, chosen)
        return twin.compose_trainer(manager=manager, cpu_bf16=cpu_bf16, namespace=namespace, **plain)
    from lightning.pytorch import Trainer

    return Trainer(**compose(manager=manager, cpu_bf16=cpu_bf16, namespace=namespace, **plain))


def _plain_container(value: Any) -> Any:
    """An OmegaConf ``DictConfig``/``ListConfig`` as plain dicts and lists (resolved); anything else unchanged."""
    if type(value).__module__.split(".")[0] != "omegaconf":
        return value
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True)


def attach(
    trainer: Trainer, *callbacks: Callback | str | Mapping[str, Any], manager: PluginManager | None = None
) -> list[Callback]:
    """Attach callbacks to an already-built Trainer, before ``fit``.

    Lightning's ordering rules are applied (tuner callbacks first, checkpoint callbacks last), a
    second instance of a stateful callback is refused, and the attached callbacks' state is saved
    into and restored from checkpoints like any other callback's.

    Attaching a checkpoint callback (a ``lightning.pytorch.callbacks.Checkpoint``, such as
    ``durable_checkpoint``) removes Lightning's *default* ``ModelCheckpoint`` -- the one ``Trainer``
    adds when ``enable_checkpointing=True`` and no checkpoint callback was given, recognised by
    every argument and all its state still at their defaults -- and says so, so that checkpoints
    are written by one system in one place. A ``ModelCheckpoint`` configured in any way is kept.

    Args:
        trainer: A ``lightning.pytorch.Trainer`` or a ``pytorch_lightning.Trainer``.
        *callbacks: ``Callback`` instances, registered callback names or ``{"name": ..., **params}``.
        manager: The plugin manager (default: the process-wide one).

    Returns:
        The attached callback objects.

    Raises:
        CompositionError: the Trainer is running, or a stateful callback would be duplicated.
        UnknownNameError: an unknown callback name (``BlockedNameError``: one a blocked plugin provides).
        ParameterError: a parameter the callback does not take, or a required one missing.
    """
    namespace = _namespace.of_object(trainer) or _OWN_NAMESPACE
    if namespace != _OWN_NAMESPACE:
        return _namespace.module_for(__name__, namespace).attach(trainer, *callbacks, manager=manager)
    with _namespace.using(namespace):
        return _attach(trainer, callbacks, manager)


def _attach(trainer: Trainer, callbacks: Sequence[Any], manager: PluginManager | None) -> list[Callback]:
    from lightning.pytorch.trainer.states import TrainerStatus

    _arm_watchdog(trainer)  # also where lplugins' callbacks_factory entry point is not installed
    _give_resume_position(trainer)
    if trainer.state.status == TrainerStatus.RUNNING:
        raise CompositionError(
            "Cannot attach callbacks while the Trainer is running; call lplugins.attach() before trainer.fit()."
        )
    from lightning.pytorch.callbacks import Checkpoint

    manager = manager or get_manager()
    new = [resolve_callback(manager, cb) for cb in callbacks]
    existing: list[Callback] = list(getattr(trainer, "callbacks", []))
    checkpoints = [cb for cb in new if isinstance(cb, Checkpoint)]
    if checkpoints:
        defaults = [cb for cb in existing if _pairs.is_default_model_checkpoint(cb)]
        if defaults:
            existing = [cb for cb in existing if not any(cb is d for d in defaults)]
            announce(
                "lplugins: attach() removed Lightning's default ModelCheckpoint (added by Trainer because "
                "enable_checkpointing=True and no checkpoint callback was given): %s writes the checkpoints now. "
                "Pass a configured ModelCheckpoint to the Trainer to keep both.",
                type(checkpoints[0]).__name__,
            )
    check_duplicates(existing + new)
    trainer.callbacks = _lightning.reorder_callbacks(existing + new)  # type: ignore[attr-defined]  # set in Trainer()
    _understand_ckpt_path(trainer)
    return new


def _arm_watchdog(trainer: Any) -> None:
    """Give a Trainer of more than one process the collective watchdog (``LPLUGINS_COLLECTIVE_TIMEOUT``,
    ``LPLUGINS_HEARTBEAT_TIMEOUT``; stack files under the Trainer's ``default_root_dir``): the settings are
    checked now, the thread runs from each run's ``setup`` to its ``teardown`` (:class:`CollectiveWatch`).

    Raises:
        LPluginsError: a setting is not a number of seconds > 0, ``auto`` or ``off`` (the message names it).
    """
    from lplugins._composition.watch import CollectiveWatch
    from lplugins._coord import settings as _settings
    from lplugins._coord import watchdog as _watchdog

    chosen = _settings.from_env()
    if chosen.collective == 0:
        _watchdog.arm(0)  # off: stops one a previous run left armed
        return
    callbacks = getattr(trainer, "callbacks", None)
    if getattr(trainer, "world_size", 1) > 1 and isinstance(callbacks, list):
        if not any(isinstance(cb, CollectiveWatch) for cb in callbacks):
            callbacks.append(
                CollectiveWatch(chosen.collective, chosen.heartbeat, getattr(trainer, "default_root_dir", None))
            )


def _give_resume_position(trainer: Any) -> None:
    """A Trainer whose strategy lplugins provides resumes any checkpoint mid-epoch at its batch, or says why not
    (:class:`~lplugins.callbacks._resume_position.ResumePosition`); other Trainers are left as Lightning made them."""
    from lplugins.callbacks._resume_position import ResumePosition, provided_by_lplugins

    callbacks = getattr(trainer, "callbacks", None)
    if isinstance(callbacks, list) and provided_by_lplugins(getattr(trainer, "strategy", None)):
        if not any(isinstance(cb, ResumePosition) for cb in callbacks):
            callbacks.append(ResumePosition())


def _understand_ckpt_path(trainer: Any) -> None:
    """``fit(ckpt_path="last")`` means an attached DurableCheckpoint's newest; ``"latest"`` without one is explained."""
    from lplugins.callbacks import DurableCheckpoint
    from lplugins.callbacks._resume import understand_ckpt_path

    understand_ckpt_path(trainer, DurableCheckpoint)
