"""lplugins with the standalone ``pytorch_lightning`` namespace (#15): real fits on CPU.

``pytorch_lightning`` + ``lightning_fabric`` are a class hierarchy separate from ``lightning.pytorch`` +
``lightning.fabric``; lplugins serves both from one source (``lplugins._pl`` twins, see
``lplugins._namespace``).
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

MODEL = r"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import pytorch_lightning as pl


class PLRegression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.steps_run += 1
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n=64, batch_size=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)
"""

_model_ns: dict[str, Any] = {}
exec(compile(MODEL, "<pl-model>", "exec"), _model_ns)
PLRegression, loader = _model_ns["PLRegression"], _model_ns["loader"]

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def _committed(dirpath: Path) -> list[str]:
    return sorted(p.name for p in dirpath.glob("*.commit"))


def test_import_lplugins_imports_neither_namespace(tmp_path: Path) -> None:
    out = run_script(
        "import sys, lplugins, lplugins._pl\n"
        "print([m for m in ('lightning.pytorch', 'pytorch_lightning', 'torch') if m in sys.modules])\n",
        tmp_path,
    ).check()
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_compose_for_pytorch_lightning_fits_and_resumes_latest(lplugins_manager: PluginManager, tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    kwargs = lplugins_compose(
        namespace="pytorch_lightning",
        accelerator="cpu",
        devices=1,
        max_steps=4,
        precision="auto",
        callbacks=[{"name": "durable_checkpoint", "dirpath": str(ckpts), "every_n_steps": 2}],
        **QUIET,
    )
    assert all(isinstance(cb, pl.Callback) for cb in kwargs["callbacks"])
    trainer = pl.Trainer(**kwargs)
    trainer.fit(PLRegression(), loader())
    assert trainer.global_step == 4
    assert _committed(ckpts)

    import lplugins

    resumed = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, **QUIET)
    lplugins.attach(resumed, {"name": "durable_checkpoint", "dirpath": str(ckpts)}, manager=lplugins_manager)
    second = PLRegression()
    resumed.fit(second, loader(), ckpt_path="latest")
    assert second.steps_run == 2  # resumed at step 4 of 6
    assert resumed.global_step == 6


def test_accumulation_schedule_fit_for_pytorch_lightning(lplugins_manager: PluginManager) -> None:
    kwargs = lplugins_compose(
        namespace="pytorch_lightning",
        accelerator="cpu",
        devices=1,
        max_steps=3,
        accumulate_grad_batches={0: 2},
        **QUIET,
    )
    model = PLRegression()
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, loader())
    assert trainer.global_step == 3
    assert model.steps_run == 6  # two micro-batches per optimizer step


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


@pytest.mark.parametrize(
    ("name", "base"),
    [("ddp_timeout", "DDPStrategy"), ("deepspeed_stage_2_cpu", "DeepSpeedStrategy"), ("fsdp2", "Strategy")],
)
def test_strategy_names_in_a_plain_pytorch_lightning_trainer(
    lplugins_manager: PluginManager, name: str, base: str
) -> None:
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=1, **QUIET)
    assert isinstance(trainer.strategy, getattr(pl.strategies, base))


def test_every_builtin_callback_schedule_and_precision_builds_for_pytorch_lightning(
    lplugins_manager: PluginManager,
) -> None:
    import lplugins

    params: dict[str, dict[str, Any]] = {
        "durable_checkpoint": {"dirpath": "unused"},
        "early_stopping": {"monitor": "loss"},
        "throughput": {"batch_size_fn": len},
        "metrics": {"metrics": "torchmetrics.MeanMetric"},
    }
    for name in lplugins_manager.registry("callback"):
        kwargs = lplugins.compose(namespace="pytorch_lightning", callbacks=[{"name": name, **params.get(name, {})}])
        assert isinstance(kwargs["callbacks"][0], pl.Callback), name
        assert not type(kwargs["callbacks"][0]).__module__.startswith("lightning."), name
    schedules: dict[str, dict[str, Any]] = {
        "epoch": {"schedule": {0: 2}},
        "step": {"schedule": {0: 2}},
        "ramp": {"start": 1, "target": 4, "over": 10, "unit": "steps"},
        "constant_global": {"global_batch_size": 8},
    }
    assert set(schedules) == set(lplugins_manager.registry("schedule"))
    for name, schedule_params in schedules.items():
        kwargs = lplugins.compose(
            namespace="pytorch_lightning", accumulate_grad_batches={"name": name, **schedule_params}
        )
        assert isinstance(kwargs["callbacks"][0], pl.Callback)
    kwargs = lplugins.compose(namespace="pytorch_lightning", accelerator="cpu", precision="auto")
    assert kwargs["precision"] == "32-true"
    from lplugins import _namespace

    with _namespace.using("pytorch_lightning"):  # the callbacks plugins add (fp16: the loss-scale monitor)
        added = lplugins_manager.trainer_callbacks({"precision": "16-mixed"})
    assert [type(cb).__name__ for cb in added] == ["LossScaleMonitor"]
    assert isinstance(added[0], pl.Callback)


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


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_process_ddp_fit_with_pytorch_lightning(tmp_path: Path) -> None:
    script = (
        MODEL
        + r"""
import json, os, sys
import lplugins

lplugins.load()
trainer = pl.Trainer(strategy="ddp_timeout", accelerator="cpu", devices=2, max_steps=6, logger=False,
                     enable_progress_bar=False, enable_model_summary=False)
lplugins.attach(trainer, {"name": "durable_checkpoint", "dirpath": "ckpts", "every_n_steps": 3})
trainer.fit(PLRegression(), loader())
with open(f"result-{trainer.global_rank}.json", "w") as f:
    strategy = type(trainer.strategy).__module__
    json.dump({"world": trainer.world_size, "step": trainer.global_step, "strategy": strategy}, f)
"""
    )
    out = run_script(script, tmp_path, timeout=240).check()
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result-*.json"))]
    assert len(results) == 2, out.stdout + out.stderr
    assert all(r["world"] == 2 and r["step"] == 6 for r in results)
    assert results[0]["strategy"] == "lplugins._pl.strategies.ddp"
    assert _committed(tmp_path / "ckpts")


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_two_process_deepspeed_cpu_fit_with_pytorch_lightning_resumes_latest(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    script = (
        MODEL
        + r"""
import json, sys
import lplugins

lplugins.load()
steps = int(sys.argv[1])
trainer = pl.Trainer(strategy="deepspeed_stage_2_cpu", accelerator="cpu", devices=2, max_steps=steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False)
lplugins.attach(trainer, {"name": "durable_checkpoint", "dirpath": "ckpts", "every_n_steps": 2})
model = PLRegression()
trainer.fit(model, loader(), ckpt_path="latest" if steps > 2 else None)
with open(f"result-{steps}-{trainer.global_rank}.json", "w") as f:
    json.dump({"step": trainer.global_step, "ran": model.steps_run, "strategy": type(trainer.strategy).__module__}, f)
"""
    )
    for steps, ran in ((2, 2), (4, 2)):
        out = run_script(script, tmp_path, timeout=300, args=[str(steps)]).check()
        results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob(f"result-{steps}-*.json"))]
        assert len(results) == 2, out.stdout + out.stderr
        assert all(r["step"] == steps and r["ran"] == ran for r in results), results
        assert all(r["strategy"] == "lplugins._pl.strategies.deepspeed" for r in results)


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

    from lplugins import _namespace

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


def test_twins_rewrite_lightning_and_share_what_does_not_face_it() -> None:
    import importlib

    from lplugins import _namespace

    source = (
        "from lightning.pytorch.callbacks import Callback\n"
        "import lightning.fabric\n"
        "from lplugins import _lightning, _log\n"
        "from lplugins.callbacks._resume import x\n"
    )
    rewritten = _namespace.rewrite(source)
    assert rewritten.count("\n") == source.count("\n")  # tracebacks keep their line numbers
    assert "from pytorch_lightning.callbacks import Callback" in rewritten
    assert "import lightning_fabric" in rewritten
    assert "from lplugins._pl import _lightning; from lplugins import _log" in rewritten
    assert "from lplugins._pl.callbacks._resume import x" in rewritten
    # pure-Python parts are one module (one class) for both namespaces; Lightning-facing ones are twins
    for shared in ("accumulation._schedules", "callbacks._retention", "callbacks._errors"):
        assert importlib.import_module(f"lplugins._pl.{shared}") is importlib.import_module(f"lplugins.{shared}")
    twin = importlib.import_module("lplugins._pl.callbacks.checkpoint")
    assert twin is not importlib.import_module("lplugins.callbacks.checkpoint")
    assert issubclass(twin.DurableCheckpoint, pl.callbacks.Checkpoint)
