"""The public surface, for both Lightning namespaces (#15): ``lightning.pytorch`` and ``pytorch_lightning``.

Every test here runs once per namespace (the ``ns`` fixture gives that namespace's package, its
Trainer and a small model written for it): compose, attach, strategy names in a plain Trainer after
``load()``, ``DurableCheckpoint`` with ``ckpt_path="latest"``, the accumulation schedules, precision
by name, the metrics callback, zero-code mode (each namespace's ``callbacks_factory`` group), the
``lplugins.testing`` fixtures, a 2-process DDP and a 2-process DeepSpeed-on-CPU run, and a process
that imports one namespace never importing the other.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import lplugins
from lplugins import ParameterError, PluginManager
from tests._dist import run_script

#: ``{package}``: ``lightning.pytorch`` or ``pytorch_lightning``.
MODEL = r"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import {package} as pl


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.steps_run += 1
        preds = self.net(x)
        return {{"loss": nn.functional.mse_loss(preds, y), "preds": preds.detach(), "target": y}}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n=64, batch_size=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)
"""

PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
NO_CKPT = {**QUIET, "enable_checkpointing": False}


@dataclass
class Namespace:
    """One Lightning namespace, as a test uses it."""

    name: str  # what compose(namespace=...) takes
    package: str  # lightning.pytorch or pytorch_lightning
    pl: types.ModuleType  # the package
    Regression: type
    loader: Any

    def trainer(self, **kwargs: Any) -> Any:
        return self.pl.Trainer(**{"accelerator": "cpu", "devices": 1, **QUIET, **kwargs})


_CACHE: dict[str, Namespace] = {}


@pytest.fixture(params=sorted(PACKAGES))
def ns(request: pytest.FixtureRequest) -> Namespace:
    name = request.param
    if name not in _CACHE:
        package = pytest.importorskip(PACKAGES[name])
        scope: dict[str, Any] = {}
        exec(compile(MODEL.format(package=PACKAGES[name]), f"<model-{name}>", "exec"), scope)
        _CACHE[name] = Namespace(name, PACKAGES[name], package, scope["Regression"], scope["loader"])
    return _CACHE[name]


def _committed(dirpath: Path) -> list[str]:
    return sorted(p.name for p in dirpath.glob("*.commit"))


def _built_for(obj: Any, ns: Namespace) -> bool:
    """``obj`` is lplugins' class for ``ns`` (a twin under ``lplugins._pl`` for pytorch_lightning)."""
    module = type(obj).__module__
    return module.startswith("lplugins._pl.") == (ns.name == "pytorch_lightning")


# ----------------------------------------------------------------------------- compose and attach


def test_compose_fit_then_attach_and_resume_latest(
    lplugins_manager: PluginManager, ns: Namespace, tmp_path: Path
) -> None:
    ckpts = tmp_path / "ckpts"
    kwargs = lplugins.compose(
        namespace=ns.name,
        accelerator="cpu",
        devices=1,
        max_steps=4,
        precision="auto",
        callbacks=[{"name": "durable_checkpoint", "dirpath": str(ckpts), "every_n_steps": 2}],
        **QUIET,
    )
    assert all(isinstance(cb, ns.pl.Callback) and _built_for(cb, ns) for cb in kwargs["callbacks"])
    trainer = ns.pl.Trainer(**kwargs)
    trainer.fit(ns.Regression(), ns.loader())
    assert trainer.global_step == 4
    assert _committed(ckpts)

    resumed = ns.trainer(max_steps=6)
    lplugins.attach(resumed, {"name": "durable_checkpoint", "dirpath": str(ckpts)}, manager=lplugins_manager)
    second = ns.Regression()
    resumed.fit(second, ns.loader(), ckpt_path="latest")
    assert second.steps_run == 2  # resumed at step 4 of 6
    assert resumed.global_step == 6


@pytest.mark.parametrize(
    ("name", "base"),
    [("ddp_timeout", "DDPStrategy"), ("deepspeed_stage_2_cpu", "DeepSpeedStrategy"), ("fsdp2", "Strategy")],
)
def test_strategy_names_in_a_plain_trainer_after_load(
    lplugins_manager: PluginManager, ns: Namespace, name: str, base: str
) -> None:
    trainer = ns.trainer(strategy=name)
    assert isinstance(trainer.strategy, getattr(ns.pl.strategies, base))
    assert _built_for(trainer.strategy, ns)


def test_strategy_parameters_are_checked_against_lightnings_ddp(lplugins_manager: PluginManager, ns: Namespace) -> None:
    """The keyword arguments DDPStrategy hands to torch's DDP are known in both namespaces."""
    with pytest.raises(
        ParameterError, match=r"no parameter 'find_unused_params'. Did you mean 'find_unused_parameters'"
    ):
        lplugins.compose(namespace=ns.name, strategy={"name": "ddp_timeout", "find_unused_params": True})
    kwargs = lplugins.compose(namespace=ns.name, strategy={"name": "ddp_timeout", "find_unused_parameters": True})
    assert isinstance(kwargs["strategy"], ns.pl.strategies.DDPStrategy)


# ------------------------------------------------------------------ schedules, precision, metrics


@pytest.mark.parametrize(
    ("schedule", "micro_batches"),
    [
        ({"name": "epoch", "schedule": {0: 2}}, 6),
        ({"name": "step", "schedule": {0: 2}}, 6),
        ({"name": "constant_global", "global_batch_size": 8}, 6),  # batch 4 on one device: 2 per step
        ({"name": "ramp", "start": 4, "target": 8, "over": 100, "unit": "samples"}, None),
    ],
    ids=["epoch", "step", "constant_global", "ramp"],
)
def test_accumulation_schedules_fit(
    lplugins_manager: PluginManager, ns: Namespace, schedule: dict[str, Any], micro_batches: int | None
) -> None:
    kwargs = lplugins.compose(
        namespace=ns.name, accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=schedule, **NO_CKPT
    )
    assert _built_for(kwargs["callbacks"][0], ns)
    model = ns.Regression()
    trainer = ns.pl.Trainer(**kwargs)
    trainer.fit(model, ns.loader())
    assert trainer.global_step == 3
    if micro_batches is not None:
        assert model.steps_run == micro_batches
    else:
        assert model.steps_run >= 3


def test_precision_by_name(lplugins_manager: PluginManager, lplugins_register: Any, ns: Namespace) -> None:
    assert lplugins.compose(namespace=ns.name, accelerator="cpu", precision="auto")["precision"] == "32-true"

    def double(**kwargs: Any) -> Any:  # a plugin's precision, built for the namespace asked for
        package = PACKAGES[lplugins.current_namespace()]
        return __import__(f"{package}.plugins", fromlist=["DoublePrecision"]).DoublePrecision(**kwargs)

    lplugins_register(
        types.SimpleNamespace(lplugins_register_precisions=lambda register: register("double_both", double)), "dbl"
    )
    kwargs = lplugins.compose(namespace=ns.name, accelerator="cpu", plugins=["double_both"], max_steps=1, **NO_CKPT)
    trainer = ns.pl.Trainer(**kwargs)
    assert isinstance(trainer.precision_plugin, ns.pl.plugins.DoublePrecision)
    with lplugins_manager_namespace(ns.name):  # the callbacks plugins add for a precision (fp16: loss scale)
        added = lplugins_manager.trainer_callbacks({"precision": "16-mixed"})
    assert [type(cb).__name__ for cb in added] == ["LossScaleMonitor"]
    assert isinstance(added[0], ns.pl.Callback) and _built_for(added[0], ns)


def lplugins_manager_namespace(name: str) -> Any:
    from lplugins._lightning import namespace as _namespace

    return _namespace.using(name)


def test_metrics_callback_fit(lplugins_manager: PluginManager, ns: Namespace) -> None:
    kwargs = lplugins.compose(
        namespace=ns.name,
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[
            {"name": "metrics", "metrics": {"mse": "torchmetrics.regression.MeanSquaredError"}, "log_every_n_steps": 2}
        ],
        **NO_CKPT,
    )
    (callback,) = kwargs["callbacks"]
    assert isinstance(callback, ns.pl.Callback) and _built_for(callback, ns)
    trainer = ns.pl.Trainer(**kwargs)
    trainer.fit(ns.Regression(), ns.loader())
    assert "train/mse" in trainer.callback_metrics, sorted(trainer.callback_metrics)


#: Callbacks that need a service running (Ray's session): built by their own tests.
NEEDS_A_SERVICE = {"ray_report"}


def test_every_builtin_callback_and_schedule_builds(lplugins_manager: PluginManager, ns: Namespace) -> None:
    params: dict[str, dict[str, Any]] = {
        "durable_checkpoint": {"dirpath": "unused"},
        "early_stopping": {"monitor": "loss"},
        "throughput": {"batch_size_fn": len},
        "metrics": {"metrics": "torchmetrics.MeanMetric"},
    }
    for name in lplugins_manager.registry("callback"):
        if name in NEEDS_A_SERVICE:
            continue
        kwargs = lplugins.compose(namespace=ns.name, callbacks=[{"name": name, **params.get(name, {})}])
        assert isinstance(kwargs["callbacks"][0], ns.pl.Callback), name
    schedules: dict[str, dict[str, Any]] = {
        "epoch": {"schedule": {0: 2}},
        "step": {"schedule": {0: 2}},
        "ramp": {"start": 1, "target": 4, "over": 10, "unit": "steps"},
        "constant_global": {"global_batch_size": 8},
    }
    assert set(schedules) == set(lplugins_manager.registry("schedule"))
    for name, schedule_params in schedules.items():
        kwargs = lplugins.compose(namespace=ns.name, accumulate_grad_batches={"name": name, **schedule_params})
        assert isinstance(kwargs["callbacks"][0], ns.pl.Callback) and _built_for(kwargs["callbacks"][0], ns)


# ------------------------------------------------------------------------ lplugins.testing fixtures


def test_testing_fixtures_serve_the_namespace(
    lplugins_manager: PluginManager, lplugins_register: Any, ns: Namespace
) -> None:
    """``lplugins_manager`` is the process-wide manager for the test; a strategy registered through
    ``lplugins_register`` is a name in that namespace's ``StrategyRegistry`` until it is unregistered
    (what the fixture does when the test ends)."""
    assert lplugins.get_manager() is lplugins_manager

    def single(**kwargs: Any) -> Any:
        package = PACKAGES[lplugins.current_namespace()]
        strategies = __import__(f"{package}.strategies", fromlist=["SingleDeviceStrategy"])
        return strategies.SingleDeviceStrategy(device="cpu", **kwargs)

    info = lplugins_register(
        types.SimpleNamespace(lplugins_register_strategies=lambda register: register("single_both", single)), "sb"
    )
    registry = ns.pl.strategies.StrategyRegistry
    assert "single_both" in registry
    trainer = ns.trainer(strategy="single_both")
    assert isinstance(trainer.strategy, ns.pl.strategies.SingleDeviceStrategy)
    lplugins_manager.unregister(info.name)
    assert "single_both" not in registry


# ---------------------------------------------------------------------------------- zero-code mode

LAUNCHER = """
import runpy, site, sys
site.addsitedir(sys.argv[1])
runpy.run_path("project.py", run_name="__main__")
"""


def test_zero_code_mode_through_the_namespaces_callbacks_factory(ns: Namespace, tmp_path: Path) -> None:
    """A plain Trainer of either namespace gets plugins' callbacks through its own
    ``callbacks_factory`` entry-point group (declared by lplugins' distribution), and
    ``ckpt_path="latest"`` without a DurableCheckpoint is lplugins' named error."""
    site = tmp_path / "site"
    info = site / "lr_everywhere-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lr-everywhere\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lplugins]\nlr_everywhere = lr_everywhere\n")
    (site / "lr_everywhere.py").write_text(
        "import importlib\nimport lplugins\n\n"
        "@lplugins.hookimpl\n"
        "def lplugins_trainer_callbacks(trainer_kwargs):\n"
        f"    package = {PACKAGES!r}[lplugins.current_namespace()]\n"
        "    return [importlib.import_module(package + '.callbacks').LearningRateMonitor()]\n"
    )
    (tmp_path / "project.py").write_text(
        f"import {ns.package} as pl\n"
        "trainer = pl.Trainer(accelerator='cpu', logger=False)\n"
        "print('CALLBACKS', sorted(type(cb).__module__ + '.' + type(cb).__name__ for cb in trainer.callbacks))\n"
        "class M(pl.LightningModule):\n"
        "    pass\n"
        "try:\n"
        "    trainer.fit(M(), ckpt_path='latest')\n"
        "except Exception as exc:\n"
        "    print('FIT', type(exc).__module__, type(exc).__name__, str(exc).splitlines()[0])\n"
    )
    out = run_script(
        LAUNCHER, tmp_path, env={"LPLUGINS_AUTO_CALLBACKS": "1"}, args=[str(site)], name="launch.py", timeout=180
    ).check()
    callbacks = next(line for line in out.stdout.splitlines() if line.startswith("CALLBACKS"))
    assert f"{ns.package}.callbacks.lr_monitor.LearningRateMonitor" in callbacks, out.stdout + out.stderr
    fit = next(line for line in out.stdout.splitlines() if line.startswith("FIT"))
    assert "CheckpointResumeError" in fit and "DurableCheckpoint" in fit, fit


# ------------------------------------------------------------------- one namespace, never the other

ONLY_ONE = r"""
import sys
import lplugins

OTHER = "pytorch_lightning" if pl.__name__ == "lightning.pytorch" else "lightning"
lplugins.load()
for steps in (2, 4):  # the second fit resumes: the load path too
    kwargs = lplugins.compose(
        namespace="lightning" if pl.__name__ == "lightning.pytorch" else "pytorch_lightning",
        accelerator="cpu", devices=1, max_steps=steps, precision="auto", strategy="ddp_timeout",
        accumulate_grad_batches={"name": "constant_global", "global_batch_size": 8},
        callbacks=[{"name": "metrics", "metrics": "torchmetrics.regression.MeanSquaredError"}],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer = pl.Trainer(**kwargs)
    lplugins.attach(trainer, {"name": "durable_checkpoint", "dirpath": "ckpts", "every_n_steps": 2})
    trainer.fit(Regression(), loader(), ckpt_path="latest")
print("STEP", trainer.global_step)
print("OTHER", sorted(m for m in sys.modules if m.split(".")[0] == OTHER))
"""


def test_a_process_of_one_namespace_never_imports_the_other(ns: Namespace, tmp_path: Path) -> None:
    """load(), the strategy-registry mirror, compose (parameter checks included), attach, fit and
    resume in a process that imported one namespace import nothing of the other."""
    out = run_script(MODEL.format(package=ns.package) + ONLY_ONE, tmp_path, timeout=180).check()
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("STEP", "OTHER")))
    assert lines["STEP"] == "4", out.stdout + out.stderr
    assert lines["OTHER"] == "[]", lines["OTHER"][:2000]


# ----------------------------------------------------------------------------- real processes

DDP = r"""
import json
import lplugins

lplugins.load()
results = {}
for steps in (3, 6):  # the second Trainer resumes from the first one's checkpoint (same processes)
    trainer = pl.Trainer(strategy="ddp_timeout", accelerator="cpu", devices=2, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    lplugins.attach(trainer, {"name": "durable_checkpoint", "dirpath": "ckpts", "every_n_steps": 3})
    model = Regression()
    trainer.fit(model, loader(), ckpt_path="latest")
    results[steps] = {"step": trainer.global_step, "ran": model.steps_run, "world": trainer.world_size}
with open(f"result-{trainer.global_rank}.json", "w") as f:
    json.dump({"runs": results, "strategy": type(trainer.strategy).__module__}, f)
"""


#: the 2-process runs under ``lightning.pytorch`` are in the ``extended`` tier (``bash scripts/test.sh --all``):
#: tests/test_checkpoint_dist.py and tests/test_checkpoint_deepspeed.py run the same strategies and durable
#: checkpoints, fit and resume, in 2 processes under that namespace in the default tier
EXTENDED_FOR_LIGHTNING = pytest.mark.parametrize(
    "ns", [pytest.param("lightning", marks=pytest.mark.extended), "pytorch_lightning"], indirect=True
)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@EXTENDED_FOR_LIGHTNING
def test_two_process_ddp_fit_and_resume(ns: Namespace, tmp_path: Path) -> None:
    out = run_script(MODEL.format(package=ns.package) + DDP, tmp_path, timeout=240).check()
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result-*.json"))]
    assert len(results) == 2, out.stdout + out.stderr
    for r in results:
        assert r["runs"] == {"3": {"step": 3, "ran": 3, "world": 2}, "6": {"step": 6, "ran": 3, "world": 2}}, r
        assert r["strategy"] == (
            "lplugins._pl.strategies.ddp" if ns.name == "pytorch_lightning" else "lplugins.strategies.ddp"
        )
    assert _committed(tmp_path / "ckpts")


DEEPSPEED = r"""
import json
import lplugins

lplugins.load()
results = {}
for steps in (2, 4):  # the second Trainer resumes from the first one's checkpoint directory (same processes)
    trainer = pl.Trainer(strategy="deepspeed_stage_2_cpu", accelerator="cpu", devices=2, max_steps=steps,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    lplugins.attach(trainer, {"name": "durable_checkpoint", "dirpath": "ckpts", "every_n_steps": 2})
    model = Regression()
    trainer.fit(model, loader(), ckpt_path="latest")
    results[steps] = {"step": trainer.global_step, "ran": model.steps_run}
with open(f"result-{trainer.global_rank}.json", "w") as f:
    json.dump({"runs": results, "strategy": type(trainer.strategy).__module__}, f)
"""


@pytest.mark.distributed
@pytest.mark.timeout(400)
@EXTENDED_FOR_LIGHTNING
def test_two_process_deepspeed_cpu_fit_and_resume(ns: Namespace, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    out = run_script(MODEL.format(package=ns.package) + DEEPSPEED, tmp_path, timeout=300).check()
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result-*.json"))]
    assert len(results) == 2, out.stdout + out.stderr
    twin = "lplugins._pl.strategies.deepspeed" if ns.name == "pytorch_lightning" else "lplugins.strategies.deepspeed"
    for r in results:
        assert r["runs"] == {"2": {"step": 2, "ran": 2}, "4": {"step": 4, "ran": 2}}, r  # resumed at step 2
        assert r["strategy"] == twin
    assert any((tmp_path / "ckpts").glob("*.commit"))
