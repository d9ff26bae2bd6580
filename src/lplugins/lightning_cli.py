"""``LightningCLI`` with an ``lplugins`` section: precision, schedule and callback names in YAML.

Strategy names registered by plugins already work in a plain ``LightningCLI`` once
:func:`lplugins.load` has run (they are in Lightning's ``StrategyRegistry``). Lightning's CLI types
``trainer.precision`` and ``trainer.accumulate_grad_batches`` narrowly, so lplugins names for those
(and callback names) go in an ``lplugins`` section::

    trainer:
      strategy: deepspeed_stage_2_cpu
      accelerator: cpu
      devices: 2
    lplugins:
      precision: auto
      accumulate_grad_batches: {0: 8, 5: 4, 10: 2}
      callbacks:
        - durable_checkpoint
        - {name: metrics, metrics: {acc: {class_path: torchmetrics.classification.MulticlassAccuracy,
                                          init_args: {num_classes: 3}}}}

Use :class:`LightningCLI` from this module in place of Lightning's; everything else is unchanged.

Both Lightning namespaces: ``LightningCLI(Model)`` with a ``pytorch_lightning`` model, datamodule
or ``trainer_class`` builds the ``pytorch_lightning`` CLI (a ``pytorch_lightning.cli.LightningCLI``
with the same ``lplugins`` section, composing for ``pytorch_lightning.Trainer``). A subclass for a
``pytorch_lightning`` project derives from ``PytorchLightningCLI`` of this module instead: the same
class, written for ``pytorch_lightning`` (this module itself imports ``lightning.pytorch``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.cli import LightningCLI as _LightningCLI

from lplugins._composition.compose import compose
from lplugins._errors import CompositionError
from lplugins._lightning import InstantiateTrainerMixin
from lplugins._lightning import namespace as _namespace
from lplugins._plugins.manager import load

__all__ = ["LightningCLI"]

#: The Lightning namespace this module is written for (its twin ``lplugins._pl.lightning_cli`` serves the other).
_OWN_NAMESPACE = _namespace.of_module(__name__)
#: This module's public name (in the twin too).
_PUBLIC = "lplugins" + ".lightning_cli"


class LightningCLI(InstantiateTrainerMixin, _LightningCLI):
    """Lightning's ``LightningCLI`` plus an ``lplugins`` config section, composed with :func:`lplugins.compose`.

    Plugins are loaded before the arguments are parsed, so registered strategy names validate.
    A subclass that overrides ``add_arguments_to_parser`` must call ``super().add_arguments_to_parser(parser)``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """The CLI of the namespace of the model, datamodule or Trainer class passed.

        Raises:
            CompositionError: a subclass of this namespace's CLI was given the other namespace's classes.
        """
        given = [*args[:2], kwargs.get("model_class"), kwargs.get("datamodule_class"), kwargs.get("trainer_class")]
        namespace = _namespace.detect([g for g in given if isinstance(g, type)])
        if namespace is None or namespace == _OWN_NAMESPACE:
            return super().__new__(cls)
        if cls is not LightningCLI:
            theirs, ours = _namespace.NAMESPACES[namespace][0], _namespace.NAMESPACES[_OWN_NAMESPACE][0]
            name = "PytorchLightningCLI" if namespace == _namespace.PYTORCH_LIGHTNING else "LightningCLI"
            raise CompositionError(
                f"{cls.__qualname__} is a {ours} LightningCLI but was given {theirs} classes: derive it from "
                f"{_PUBLIC}.{name} for a {theirs} project"
            )
        return _namespace.module_for(__name__, namespace).LightningCLI(*args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        load()
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add ``--lplugins.precision``, ``--lplugins.accumulate_grad_batches``, ``--lplugins.strategy``
        and ``--lplugins.callbacks``."""
        super().add_arguments_to_parser(parser)
        parser.add_argument(
            "--lplugins.precision", type=Any, default=None, help="a precision name: 'auto', Lightning's, or a plugin's"
        )
        parser.add_argument(
            "--lplugins.accumulate_grad_batches",
            type=Any,
            default=None,
            help="an epoch dict {0: 8, 5: 4}, a schedule name, or {name: ..., params...}",
        )
        parser.add_argument(
            "--lplugins.strategy", type=Any, default=None, help="a strategy name or {name: ..., params...}"
        )
        parser.add_argument(
            "--lplugins.callbacks", type=Any, default=None, help="callback names or {name: ..., params...}"
        )

    def trainer_kwargs(self, config: dict[str, Any]) -> dict[str, Any]:
        """The Trainer's keyword arguments: ``trainer`` and ``lplugins`` sections merged, then composed.

        Raises:
            CompositionError: a key is set in both sections, or the composition fails.
            UnknownNameError: an unknown strategy, precision, schedule or callback name.
        """
        values = _as_dict(self.config_section("lplugins"))
        merged = dict(config)
        for key in ("precision", "accumulate_grad_batches", "strategy"):
            value = values.get(key)
            if value is None:
                continue
            given = merged.get(key)
            default = {"precision": None, "accumulate_grad_batches": 1, "strategy": "auto"}[key]
            if given not in (None, default) and given != value:
                raise CompositionError(
                    f"Both trainer.{key}={given!r} and lplugins.{key}={value!r} are set; keep one of them."
                )
            merged[key] = _plain(value)
        extra = values.get("callbacks")
        if extra:
            merged["callbacks"] = list(merged.get("callbacks") or []) + [_plain(cb) for cb in _listify(extra)]
        composed = compose(namespace=_OWN_NAMESPACE, **merged)
        composed.setdefault("callbacks", [])
        return composed


def __getattr__(name: str) -> Any:
    if name == "PytorchLightningCLI":  # imported on first use: pytorch_lightning may not be installed
        return _namespace.module_for(__name__, _namespace.PYTORCH_LIGHTNING).LightningCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _listify(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _as_dict(section: Any) -> dict[str, Any]:
    if section is None:
        return {}
    if hasattr(section, "as_dict"):
        return dict(section.as_dict())
    return dict(section)


def _plain(value: Any) -> Any:
    """jsonargparse Namespaces and string-keyed epoch dicts ('0': 8) into plain Python values."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        out = {k: _plain(v) for k, v in value.items()}
        if out and "name" not in out and all(isinstance(k, str) and k.lstrip("-").isdigit() for k in out):
            return {int(k): v for k, v in out.items()}
        return out
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
