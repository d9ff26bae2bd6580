"""lplugins with the standalone ``pytorch_lightning`` namespace (#15): what is particular to it.

The public surface, for both namespaces (fits, resume, DDP, DeepSpeed), is in
``tests/test_namespace_surface.py``.

``pytorch_lightning`` + ``lightning_fabric`` are a class hierarchy separate from ``lightning.pytorch`` +
``lightning.fabric``; lplugins serves both from one source (``lplugins._pl`` twins, see
``lplugins._lightning.namespace``).
"""

from __future__ import annotations

import json
import pickle
import types
from pathlib import Path
from typing import Any

import pytest

from lplugins import CompositionError, PluginManager
from tests._dist import run_script

pl = pytest.importorskip("pytorch_lightning")

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def test_import_lplugins_imports_neither_namespace(tmp_path: Path) -> None:
    out = run_script(
        "import sys, lplugins, lplugins._pl\n"
        "print([m for m in ('lightning.pytorch', 'pytorch_lightning', 'torch') if m in sys.modules])\n",
        tmp_path,
    ).check()
    assert out.stdout.strip().splitlines()[-1] == "[]"


def lplugins_compose(**kwargs: Any) -> dict[str, Any]:
    import lplugins

    return lplugins.compose(**kwargs)


def test_namespace_detected_from_objects_passed(lplugins_manager: PluginManager) -> None:
    kwargs = lplugins_compose(accelerator="cpu", callbacks=[pl.callbacks.LearningRateMonitor(), "durable_checkpoint"])
    assert isinstance(kwargs["callbacks"][1], pl.Callback)
    assert type(kwargs["callbacks"][1]).__module__.startswith("lplugins._pl.")


def test_both_namespaces_in_one_process(lplugins_manager: PluginManager) -> None:
    import lightning.pytorch as lp

    ours = lplugins_compose(
        namespace="lightning", accelerator="cpu", strategy="ddp_timeout", callbacks=["durable_checkpoint"]
    )
    theirs = lplugins_compose(
        namespace="pytorch_lightning", accelerator="cpu", strategy="ddp_timeout", callbacks=["durable_checkpoint"]
    )
    assert isinstance(ours["strategy"], lp.strategies.DDPStrategy)
    assert not isinstance(ours["strategy"], pl.strategies.Strategy)
    assert isinstance(theirs["strategy"], pl.strategies.DDPStrategy)
    assert not isinstance(theirs["strategy"], lp.strategies.Strategy)
    lp.Trainer(**ours, **QUIET)
    pl.Trainer(**theirs, **QUIET)


def test_a_plugin_built_for_the_other_namespace_is_named(
    lplugins_manager: PluginManager, lplugins_register: Any
) -> None:
    from lightning.pytorch.callbacks import Callback

    class OnlyLightning(Callback):
        pass

    lplugins_register(
        types.SimpleNamespace(lplugins_register_callbacks=lambda register: register("only_lightning", OnlyLightning)),
        "onlyl",
    )
    with pytest.raises(CompositionError, match=r"lightning\.pytorch class.*pytorch_lightning\.Trainer") as info:
        lplugins_compose(namespace="pytorch_lightning", callbacks=["only_lightning"])
    assert "current_namespace" in str(info.value)


def test_a_plugin_serving_both_namespaces(lplugins_manager: PluginManager, lplugins_register: Any) -> None:
    import lplugins

    def both(**kwargs: Any) -> Any:
        package = "pytorch_lightning" if lplugins.current_namespace() == "pytorch_lightning" else "lightning.pytorch"
        callbacks = __import__(f"{package}.callbacks", fromlist=["Callback"])
        return callbacks.LearningRateMonitor(**kwargs)

    lplugins_register(
        types.SimpleNamespace(lplugins_register_callbacks=lambda register: register("lr_both", both)), "both"
    )
    import lightning.pytorch as lp

    assert isinstance(
        lplugins_compose(namespace="pytorch_lightning", callbacks=["lr_both"])["callbacks"][0], pl.Callback
    )
    assert isinstance(lplugins_compose(namespace="lightning", callbacks=["lr_both"])["callbacks"][0], lp.Callback)


def test_bad_namespace_is_named(lplugins_manager: PluginManager) -> None:
    with pytest.raises(CompositionError, match=r"namespace='pl'.*'lightning', 'pytorch_lightning'"):
        lplugins_compose(namespace="pl")


def test_twin_objects_pickle_into_a_fresh_process(lplugins_manager: PluginManager, tmp_path: Path) -> None:
    kwargs = lplugins_compose(namespace="pytorch_lightning", callbacks=[{"name": "durable_checkpoint", "dirpath": "x"}])
    (tmp_path / "cb.pkl").write_bytes(pickle.dumps(kwargs["callbacks"][0]))
    out = run_script(
        "import pickle, pytorch_lightning as pl\n"
        "cb = pickle.load(open('cb.pkl', 'rb'))\n"
        "print(type(cb).__module__, isinstance(cb, pl.callbacks.Checkpoint))\n",
        tmp_path,
    ).check()
    assert out.stdout.strip().splitlines()[-1] == "lplugins._pl.callbacks.checkpoint True"


def test_pytorch_lightning_imported_after_load_gets_the_names(tmp_path: Path) -> None:
    out = run_script(
        "import sys, lplugins\n"
        "lplugins.load()\n"
        "assert 'pytorch_lightning' not in sys.modules\n"
        "import pytorch_lightning as pl\n"
        "t = pl.Trainer(strategy='deepspeed_stage_1_cpu', accelerator='cpu', devices=1, logger=False)\n"
        "print(type(t.strategy).__module__)\n",
        tmp_path,
    ).check()
    assert out.stdout.strip().splitlines()[-1] == "lplugins._pl.strategies.deepspeed"


def test_lplugins_list_says_which_namespaces_each_name_serves() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    from lplugins._lightning import namespace as _namespace

    assert _namespace.served_by(DDPStrategy) == ("lightning",)
    assert _namespace.served_by(pl.strategies.DDPStrategy) == ("pytorch_lightning",)
    assert _namespace.served_by(lambda: None) is None  # a function: checked when it builds
    from lplugins._builtins.strategies import fsdp2

    assert _namespace.served_by(fsdp2) == ("lightning", "pytorch_lightning")


def test_lplugins_list_json_has_namespaces(tmp_path: Path) -> None:
    out = run_script(
        "import sys\nfrom lplugins.cli import main\nsys.exit(main(['list', '--json']))\n", tmp_path
    ).check()
    plugins = {p["name"]: p for p in json.loads(out.stdout[out.stdout.index("{") :])["plugins"]}
    assert plugins["strategies"]["namespaces"]["fsdp2"] == ["lightning", "pytorch_lightning"]


def test_compose_trainer_builds_the_namespace_it_was_given_and_says_when_it_chose(
    lplugins_manager: PluginManager, caplog: pytest.LogCaptureFixture
) -> None:
    import lplugins

    trainer = lplugins.compose_trainer(
        namespace="pytorch_lightning", accelerator="cpu", callbacks=["durable_checkpoint"]
    )
    assert isinstance(trainer, pl.Trainer)
    with caplog.at_level("INFO", logger="lplugins"):
        lplugins.compose(accelerator="cpu", callbacks=[pl.callbacks.LearningRateMonitor()])
    assert "compose() builds for a pytorch_lightning.Trainer (a pytorch_lightning object was passed)" in caplog.text
