"""Ray Train as the engine (#18): the Ray names, lplugins.ray.fit, checkpoints reported to Ray, restarts.

One local Ray instance (127.0.0.1, 2 CPUs, no dashboard) serves the whole module. Every fit runs 2
workers on CPU (gloo). A worker is SIGKILLed by a callback, once (a marker file), after the first
commit; Ray restarts the worker group and training must resume from the newest committed checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer

import lplugins
import lplugins.ray
from lplugins.callbacks._record import COMMIT_SUFFIX
from tests.models import Regression, regression_loader

ROOT = Path(__file__).resolve().parents[1]
ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")]

QUIET = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no network
    "RAY_DEDUP_LOGS": "1",
    "RAY_TRAIN_V2_ENABLED": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_enable_metrics_collection": "0",
}


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """One local Ray instance for the module: 2 CPUs, 127.0.0.1, no dashboard, a small object store."""
    saved = {k: os.environ.get(k) for k in (*QUIET, "PYTHONPATH")}
    os.environ.update(QUIET)
    # the workers import tests.models and this module (callbacks sent by reference)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    ray.init(
        num_cpus=2,
        address="local",
        include_dashboard=False,
        object_store_memory=80 * 1024**2,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    try:
        yield
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class KillOnce(Callback):
    """SIGKILL global rank ``rank`` at ``step`` in the first attempt only (a marker file says it happened);
    optionally delete ``wipe`` first (a restarted worker on a fresh machine). Every attempt records
    the step it started from in ``starts``."""

    def __init__(self, marker: str, starts: str, step: int, rank: int = 1, wipe: str | None = None) -> None:
        self.marker, self.starts, self.step, self.rank, self.wipe = marker, starts, step, rank, wipe

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            with open(self.starts, "a") as f:
                f.write(f"{trainer.global_step}\n")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not os.path.exists(self.marker):
            Path(self.marker).touch()
            if self.wipe is not None:
                import shutil

                shutil.rmtree(self.wipe)
            os.kill(os.getpid(), signal.SIGKILL)


def _trainer(strategy: str, **extra: Any) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "max_steps": 6,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **extra,
    }


def _reported(result: Any) -> list[dict[str, Any]]:
    """The pointers of every checkpoint Ray registered, oldest first."""
    dirs = sorted(Path(result.path).glob("lplugins-[0-9]*"))  # not lplugins-stacks/ (the watchdog's stack files)
    return [json.loads((d / "lplugins_checkpoint.json").read_text()) for d in dirs]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "strategy",
    # ray_ddp: the restart tests below; deepspeed (extended): the same reporting path as [fsdp2] (a directory
    # checkpoint of every rank), with DeepSpeed's directory commits covered by test_checkpoint_deepspeed.py
    ["fsdp2", pytest.param("deepspeed_stage_2_cpu", marks=pytest.mark.extended)],
)
def test_trains_with_two_workers_and_reports_every_commit(ray_session: None, tmp_path: Path, strategy: str) -> None:
    result = lplugins.ray.fit(
        Regression(hidden=(8,), seed=0),
        regression_loader(),
        num_workers=2,
        storage_path=str(tmp_path / "ray"),
        name="run",
        trainer=_trainer(strategy, callbacks=[{"name": "durable_checkpoint", "every_n_steps": 2, "keep_last": 5}]),
    )
    assert result.error is None
    assert result.return_value["global_step"] == 6
    # the durable checkpoints live under Ray's run directory (shared storage): reported by pointer, no copy
    checkpoints = tmp_path / "ray" / "run" / "checkpoints"
    reported = _reported(result)
    assert [p["marker"]["global_step"] for p in reported] == [2, 4, 6]
    assert {p["mode"] for p in reported} == {"pointer"}
    for pointer in reported:
        assert (checkpoints / (pointer["name"] + COMMIT_SUFFIX)).exists()  # only committed ones are reported
    newest = lplugins.ray.checkpoint_path(result.checkpoint)
    assert newest == str(checkpoints / reported[-1]["name"]) and Path(newest).exists()
    assert result.metrics["step"] == 6
    # Ray ends its workers without atexit: a clean run still removes its watchdog stack files (#26)
    assert not list((tmp_path / "ray" / "run").glob("lplugins-stacks/rank*.txt"))


@pytest.mark.timeout(240)
def test_killed_worker_resumes_from_newest_commit(ray_session: None, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed at step 5 (commits at 2 and 4, written in the background): Ray restarts both workers,
    they resume at 4, end at 8."""
    starts = tmp_path / "starts.txt"
    kill = KillOnce(str(tmp_path / "killed"), str(starts), step=5)
    result = lplugins.ray.fit(
        Regression(hidden=(8,), seed=0),
        regression_loader(),
        num_workers=2,
        max_failures=1,
        storage_path=str(tmp_path / "ray"),
        name="run",
        trainer=_trainer(
            "ray_ddp",
            max_steps=8,
            # async: a commit lands on a background thread; each is reported once it is committed
            callbacks=[{"name": "durable_checkpoint", "every_n_steps": 2, "async_save": True}, kill],
        ),
    )
    assert (tmp_path / "killed").exists(), "the worker was not killed"
    assert starts.read_text().split() == ["0", "4"]  # first attempt from scratch, the restart from the step-4 commit
    assert result.return_value["global_step"] == 8
    # every commit reported once, in order (one Ray lost with the dying worker is reported after the restart),
    # by pointer: the checkpoints are under Ray's run directory (shared storage), not copied
    reported = _reported(result)
    assert [p["marker"]["global_step"] for p in reported] == [2, 4, 6, 8]
    assert {p["mode"] for p in reported} == {"pointer"}
    checkpoints = tmp_path / "ray" / "run" / "checkpoints"
    assert (checkpoints / (reported[-1]["name"] + COMMIT_SUFFIX)).exists()
    assert lplugins.ray.checkpoint_path(result.checkpoint) == str(checkpoints / reported[-1]["name"])


@pytest.mark.timeout(240)
def test_killed_worker_on_a_fresh_disk_resumes_from_the_copy_in_ray_storage(ray_session: None, tmp_path: Path) -> None:
    """A checkpoint directory outside Ray's storage is node-local: each commit is copied to Ray's storage, and a
    restart whose directory is gone (a new machine) gets the newest one back before fit(ckpt_path='latest')."""
    local = tmp_path / "node-local"
    starts = tmp_path / "starts.txt"
    kill = KillOnce(str(tmp_path / "killed"), str(starts), step=3, rank=0, wipe=str(local))
    result = lplugins.ray.fit(
        Regression(hidden=(8,), seed=0),
        regression_loader(),
        num_workers=2,
        max_failures=1,
        storage_path=str(tmp_path / "ray"),
        name="run",
        trainer=_trainer(
            "ray_ddp",
            callbacks=[{"name": "durable_checkpoint", "dirpath": str(local), "every_n_steps": 2}, kill],
        ),
    )
    assert starts.read_text().split() == ["0", "2"]  # the step-2 commit came back from Ray's copy
    assert result.return_value["global_step"] == 6
    reported = _reported(result)
    assert {p["mode"] for p in reported} == {"copy"}
    newest = Path(lplugins.ray.checkpoint_path(result.checkpoint))
    assert newest.parent == Path(result.checkpoint.path) and newest.is_file()
    assert (newest.parent / (newest.name + COMMIT_SUFFIX)).exists()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_workers": 0}, "num_workers=0"),
        ({"num_workers": 2, "use_gpu": "yes"}, "use_gpu='yes'"),
        ({"num_workers": 2, "max_failures": -2}, "max_failures=-2"),
        ({"num_workers": 2, "resources_per_worker": {"CPU": -1}}, "resources_per_worker['CPU']=-1"),
        ({"num_workers": 2, "resources_per_worker": {"GPU": 1}}, "use_gpu=False"),
        ({"num_workers": 2, "storage_path": ""}, "storage_path=''"),
        ({"num_workers": 2, "name": "a/b"}, "name='a/b'"),
        ({"num_workers": 2, "trainer": {"devices": 2}}, "trainer['devices']=2"),
        ({"num_workers": 2, "trainer": {"strategy": "ddp_spawn"}}, "strategy='ddp_spawn'"),
        ({"num_workers": 2, "trainer": {"strategy": "ray_fsdp"}}, "'fsdp2'"),
        ({"num_workers": 2, "trainer": {"strategy": "ray_deepspeed"}}, "deepspeed_stage_2_cpu"),
        ({"num_workers": 2, "trainer": {"accelerator": "gpu"}}, "use_gpu=False"),
        ({"num_workers": 2, "trainer": {"strategy": "ray_dpp"}}, "ray_ddp"),  # composed on the driver
        ({"num_workers": 2, "trainer": {"callbacks": [{"name": "durable_checkpoint", "every_n_steps": 0}]}}, "every_n"),
        ({"num_workers": 2, "ckpt_path": 3}, "ckpt_path=3"),
    ],
)
def test_bad_arguments_are_refused_before_ray_starts(tmp_path: Path, kwargs: dict[str, Any], needle: str) -> None:
    was_running = ray.is_initialized()
    with pytest.raises(lplugins.LPluginsError) as info:
        lplugins.ray.fit(Regression(), regression_loader(), **kwargs)
    assert needle in str(info.value)
    assert ray.is_initialized() == was_running  # refused before Ray was started (or asked to start workers)


def test_names_build_for_lightning_and_refuse_pytorch_lightning() -> None:
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment

    kwargs = lplugins.compose(strategy="ray_ddp", plugins=["ray"], accelerator="cpu")
    assert isinstance(kwargs["strategy"], RayDDPStrategy)
    assert isinstance(kwargs["plugins"][0], RayLightningEnvironment)
    with pytest.raises(lplugins.CompositionError, match=r"written for lightning\.pytorch"):
        lplugins.compose(strategy="ray_ddp", accelerator="cpu", namespace="pytorch_lightning")
    with pytest.raises(lplugins.CompositionError, match="does not run on CPU"):
        lplugins.compose(strategy="ray_fsdp", accelerator="cpu")
    with pytest.raises(lplugins.ray.RayArgumentError, match="inside a Ray Train worker"):
        lplugins.ray.compose(strategy="ray_ddp")


HIDE_RAY = """
import importlib.abc, sys

class HideRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideRay())
"""


@pytest.mark.timeout(120)
def test_without_ray_the_names_are_listed_unavailable(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(HIDE_RAY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    listing = subprocess.run(
        [sys.executable, "-m", "lplugins", "list"], env=env, capture_output=True, text=True, timeout=100, check=True
    )
    assert "Traceback" not in listing.stderr + listing.stdout
    lines = {line.split(" - ")[0].strip(): line for line in listing.stdout.splitlines() if " - " in line}
    for name in ("ray_ddp", "ray_fsdp", "ray_deepspeed", "ray", "ray_report"):
        assert 'unavailable: Ray is not installed (pip install "lplugins[ray]")' in lines[name], lines.get(name)
    script = (
        "import lplugins, lplugins.ray\n"
        "try:\n    lplugins.compose(strategy='ray_ddp')\n"
        "except lplugins.ray.RayUnavailableError as e:\n    print('E1', e)\n"
        "try:\n    lplugins.ray.fit(lambda: None, num_workers=2)\nexcept lplugins.ray.RayUnavailableError as e:\n"
        "    print('E2', e)\n"
    )
    errors = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=100)
    assert (
        "E1 The Ray names (ray_ddp, ray_fsdp, ray_deepspeed, ray) need Ray Train: Ray is not installed (pip"
        in errors.stdout
    )
    assert "E2 The Ray names" in errors.stdout and "Traceback" not in errors.stderr, errors.stderr
