"""Gradient-accumulation schedules and the AccumulationScheduler callback (single process)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lplugins
from lplugins.accumulation import (
    ConstantGlobalSchedule,
    EpochSchedule,
    RampSchedule,
    Schedule,
    ScheduleContext,
    ScheduleError,
    StepSchedule,
)

pl = pytest.importorskip("lightning.pytorch")
Callback = pl.Callback

LR = 0.1
FEATURES = 4


# ---------------------------------------------------------------------------- helpers (also used by DDP scripts)
def make_data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, FEATURES, generator=g), torch.randn(n, 1, generator=g)


class TinyModel(pl.LightningModule):
    """A linear regression with SGD; `training_step` returns the mean MSE of the micro-batch."""

    def __init__(self, n: int = 24, batch_size: int = 2, lr_scheduler: bool = False, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(FEATURES, 1)
        self.n = n
        self.batch_size = batch_size
        self.lr_scheduler = lr_scheduler
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if self.automatic_optimization:
            return loss
        from lplugins.accumulation import AccumulationScheduler

        opt = self.optimizers()
        if AccumulationScheduler.of(self.trainer).backward(self, loss):
            opt.step()
            opt.zero_grad()
        return None

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=LR)
        if not self.lr_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        dataset = TensorDataset(*make_data(self.n))
        if self.trainer.world_size == 1:
            return DataLoader(dataset, batch_size=self.batch_size)
        # deterministic shards for the DDP tests (run with use_distributed_sampler=False): rank r gets r, r+2, ...
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(
            dataset, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


class Observer(Callback):
    """Records, for every optimizer step, how many micro-batches it used, and when gradients were zeroed."""

    def __init__(self) -> None:
        self.window = 0
        self.factors: list[int] = []
        self.batches = 0
        self.zero_grad_at: list[int] = []  # 0-based index of the micro-batch that zeroed the gradients
        self.epoch_end_windows: list[int] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.window += 1
        self.batches += 1

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.factors.append(self.window)
        self.window = 0

    def on_before_zero_grad(self, *args: Any) -> None:
        self.zero_grad_at.append(self.batches - 1)

    def on_train_epoch_end(self, *args: Any) -> None:
        self.epoch_end_windows.append(self.window)
        self.window = 0


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    kwargs.update(overrides)
    return kwargs


def fit(
    model: Any,
    accumulation: Any,
    *,
    callbacks: Sequence[Any] = (),
    before: Sequence[Any] = (),
    ckpt_path: str | None = None,
    **kw: Any,
):
    """Fit through lplugins.compose; `before` callbacks run before the scheduler's hooks, `callbacks` after."""
    observer = Observer()
    trainer = pl.Trainer(
        **lplugins.compose(**trainer_kwargs(accumulate_grad_batches=accumulation, callbacks=list(before), **kw)),
    )
    lplugins.attach(trainer, observer, *callbacks)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, observer


def reference_sgd(
    x: torch.Tensor, y: torch.Tensor, windows: Sequence[Sequence[torch.Tensor]], factors: Sequence[int]
) -> torch.Tensor:
    """Plain-torch SGD: per window, sum over micro-batches of mean-MSE / k; one step per window."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=LR)
    for micro_batches, k in zip(windows, factors, strict=True):
        opt.zero_grad()
        for idx in micro_batches:
            (torch.nn.functional.mse_loss(layer(x[idx]), y[idx]) / k).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in layer.parameters()])


def sequential_windows(n: int, batch_size: int, factors: Sequence[int], epochs: int) -> list[list[torch.Tensor]]:
    """Split `epochs` passes over range(n) into windows of the given sizes (a window never spans epochs)."""
    windows: list[list[torch.Tensor]] = []
    it = iter(factors)
    for _ in range(epochs):
        batches = [torch.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
        while batches:
            k = next(it)
            windows.append(batches[:k])
            batches = batches[k:]
    return windows


def params(model: Any) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ---------------------------------------------------------------------------- schedules (pure)
def test_epoch_schedule_lookup() -> None:
    s = EpochSchedule({0: 8, 5: 4, 10: 2})
    assert [s.factor(ScheduleContext(epoch=e)) for e in range(12)] == [8] * 5 + [4] * 5 + [2] * 2


def test_schedule_before_first_key_is_one() -> None:
    s = StepSchedule({3: 4})
    assert [s.factor(ScheduleContext(step=n)) for n in range(5)] == [1, 1, 1, 4, 4]


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ({-1: 2}, "key -1"),
        ({0: 0}, "factor 0"),
        ({0: -2}, "factor -2"),
        ({0: 2.5}, "factor 2.5"),
        ({1.0: 2}, "key 1.0"),
        ({"0": 2}, "key '0'"),
        ({0: True}, "factor True"),
        ({0: 8, 10: 2, 5: 4}, "strictly increasing"),
        ({}, "empty"),
        ([(0, 8)], "must be a dict"),
    ],
)
def test_keyed_schedule_rejects_bad_input(bad: Any, fragment: str) -> None:
    for cls in (EpochSchedule, StepSchedule):
        with pytest.raises(ScheduleError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
            cls(bad)


def test_non_increasing_keys_error_suggests_sorted_order() -> None:
    with pytest.raises(ScheduleError, match=r"did you mean \{0: 8, 5: 4, 10: 2\}"):
        EpochSchedule({0: 8, 10: 2, 5: 4})


def test_ramp_linear_and_stepwise_factors() -> None:
    linear = RampSchedule(start=2, target=8, over=3, unit="steps", micro_batch_size=2)
    assert [linear.factor(ScheduleContext(step=n, micro_batch_size=2)) for n in range(6)] == [1, 2, 3, 4, 4, 4]
    stepwise = RampSchedule(start=2, target=8, over=12, kind="stepwise", increment=2, micro_batch_size=2)
    got = [stepwise.factor(ScheduleContext(samples=s, micro_batch_size=2)) for s in (0, 2, 4, 8, 11, 12, 100)]
    assert got == [1, 1, 2, 3, 3, 4, 4]
    # the same ramp on 2 processes: factors halve, the global batch stays the same
    assert [linear.factor(ScheduleContext(step=n, micro_batch_size=2, world_size=2)) for n in (0, 3)] == [1, 2]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"start": 16, "target": 8, "over": 10}, "start=16 is larger than target=8"),
        ({"start": 0, "target": 8, "over": 10}, "start=0"),
        ({"start": 2, "target": 8, "over": 0}, "over=0"),
        ({"start": 2, "target": 8, "over": 10, "unit": "epochs"}, "unit='epochs'"),
        ({"start": 2, "target": 8, "over": 10, "kind": "cosine"}, "kind='cosine'"),
        ({"start": 2, "target": 8, "over": 10, "kind": "stepwise"}, "needs increment"),
        ({"start": 2, "target": 8, "over": 10, "kind": "stepwise", "increment": 4}, "not a multiple of increment=4"),
        ({"start": 2, "target": 8, "over": 10, "increment": 2}, "only applies to kind='stepwise'"),
    ],
)
def test_ramp_rejects_bad_input(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ScheduleError, match=fragment.replace("(", r"\(")):
        RampSchedule(**kwargs)


def test_ramp_check_names_multiples() -> None:
    ramp = RampSchedule(start=6, target=16, over=10)
    with pytest.raises(ScheduleError, match=r"start=6 is not a multiple of .* = 4 .*use start=4 or 8"):
        ramp.check(micro_batch_size=2, world_size=2)


def test_constant_global_factor_and_impossible_target() -> None:
    s = ConstantGlobalSchedule(64)
    assert s.factor(ScheduleContext(micro_batch_size=8, world_size=1)) == 8
    assert s.factor(ScheduleContext(micro_batch_size=8, world_size=2)) == 4
    with pytest.raises(ScheduleError) as info:
        ConstantGlobalSchedule(100).check(micro_batch_size=8, world_size=2)
    message = str(info.value)
    assert "global_batch_size=100" in message and "16 samples per micro-step" in message
    assert "96 or 112" in message and "divides 50" in message
    with pytest.raises(ScheduleError, match="global_batch_size=0"):
        ConstantGlobalSchedule(0)


def test_registered_names_through_the_hook() -> None:
    manager = lplugins.load()
    registry = manager.registry("schedule")
    assert {"epoch", "step", "ramp", "constant_global"} <= set(registry.names())
    component = registry.get("epoch")
    assert component.plugin == "accumulation"
    assert isinstance(component.create(schedule={0: 8, 5: 4}), EpochSchedule)
    assert isinstance(registry.get("ramp").create(start=2, target=8, over=4), RampSchedule)


def test_third_party_schedule_registers_like_builtins(lplugins_manager: Any, lplugins_register: Any) -> None:
    class Halving(Schedule):
        def factor(self, context: ScheduleContext) -> int:
            return max(1, 8 >> context.epoch)

    class Plugin:
        @lplugins.hookimpl
        def lplugins_register_schedules(self, register: Any) -> None:
            register("halving", Halving, description="8, 4, 2, 1")

    lplugins_register(Plugin(), name="acme")
    kwargs = lplugins.compose(manager=lplugins_manager, accumulate_grad_batches="halving")
    (scheduler,) = kwargs["callbacks"]
    assert isinstance(scheduler.schedule, Halving)


# ---------------------------------------------------------------------------- compose and bad input before training
def test_compose_turns_the_seed_dict_into_a_scheduler() -> None:
    from lplugins.accumulation import AccumulationScheduler

    kwargs = lplugins.compose(accumulate_grad_batches={0: 8, 5: 4, 10: 2}, accelerator="cpu")
    assert "accumulate_grad_batches" not in kwargs
    (scheduler,) = kwargs["callbacks"]
    assert isinstance(scheduler, AccumulationScheduler)
    assert scheduler.schedule.schedule == {0: 8, 5: 4, 10: 2}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "value",
    [{0: -1}, {0: 8, 10: 2, 5: 4}, {"name": "ramp", "start": 16, "target": 8, "over": 4}, {"name": "step"}],
)
def test_compose_rejects_bad_schedules(value: Any) -> None:
    with pytest.raises((ScheduleError, TypeError)):
        lplugins.compose(accumulate_grad_batches=value)


def test_trainer_accumulate_grad_batches_and_a_schedule_is_an_error_before_training() -> None:
    from lplugins.accumulation import AccumulationScheduler

    model = TinyModel()
    before = params(model)
    observer = Observer()
    trainer = pl.Trainer(
        **trainer_kwargs(accumulate_grad_batches=4, callbacks=[AccumulationScheduler({0: 2}), observer], max_epochs=1)
    )
    with pytest.raises(ScheduleError, match=r"Trainer\(accumulate_grad_batches=4\) and the lplugins"):
        trainer.fit(model)
    assert observer.batches == 0
    assert torch.equal(params(model), before)


def test_lightning_gradient_accumulation_scheduler_alongside_is_an_error() -> None:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    trainer = pl.Trainer(**trainer_kwargs(max_epochs=1))
    lplugins.attach(trainer, GradientAccumulationScheduler({0: 2}))
    with pytest.raises(ScheduleError, match="GradientAccumulationScheduler"):
        lplugins.attach(trainer, *lplugins.compose(accumulate_grad_batches={0: 2})["callbacks"])
        trainer.fit(TinyModel())


@pytest.mark.parametrize(("manual", "driver"), [(False, "Automatic"), (True, "Manual")])
def test_the_driver_follows_the_optimization_mode(manual: bool, driver: str) -> None:
    from lplugins.accumulation._drivers import choose_driver

    trainer = pl.Trainer(**trainer_kwargs(max_epochs=1))
    assert type(choose_driver(trainer, TinyModel(manual=manual), EpochSchedule({0: 2}))).__name__ == driver


def test_a_strategy_that_accumulates_itself_but_is_not_deepspeed_is_refused() -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lplugins.accumulation._drivers import choose_driver

    class SelfAccumulating(SingleDeviceStrategy):
        @property
        def handles_gradient_accumulation(self) -> bool:
            return True

    trainer = pl.Trainer(**trainer_kwargs(max_epochs=1, strategy=SelfAccumulating(device=torch.device("cpu"))))
    with pytest.raises(ScheduleError, match="SelfAccumulating accumulates gradients itself"):
        choose_driver(trainer, TinyModel(), EpochSchedule({0: 2}))


def test_impossible_constant_global_fails_before_the_first_batch() -> None:
    model = TinyModel(batch_size=3)
    with pytest.raises(ScheduleError, match=r"global_batch_size=16 cannot be met with micro_batch_size=3"):
        fit(model, {"name": "constant_global", "global_batch_size": 16}, max_epochs=1)


# ---------------------------------------------------------------------------- semantics
def test_step_schedule_changes_mid_epoch_at_a_step_boundary() -> None:
    # 12 micro-batches per epoch; 2 per step for 3 steps, then 4; the epoch's last window is short (Lightning's rule)
    model = TinyModel(n=24, lr_scheduler=True)
    trainer, obs = fit(model, {"name": "step", "schedule": {0: 2, 3: 4}}, max_epochs=2)
    assert obs.factors == [2, 2, 2, 4, 2, 4, 4, 4]
    assert trainer.global_step == len(obs.factors) == 8
    assert obs.zero_grad_at == [0, 2, 4, 6, 10, 12, 16, 20]  # only at the first micro-batch of each window
    assert obs.epoch_end_windows == [0, 0]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8  # step-interval LR scheduler: once per step
    x, y = make_data(24)
    expected = reference_sgd(x, y, sequential_windows(24, 2, [2, 2, 2, 4, 2, 4, 4, 4], 2), [2, 2, 2, 4, 4, 4, 4, 4])
    torch.testing.assert_close(params(model), expected)


def test_accumulation_equals_one_big_batch() -> None:
    # k=4 micro-batches of 2 == batches of 8 without accumulation (mean loss), same data order
    accumulated = TinyModel(n=32, batch_size=2)
    _, obs = fit(accumulated, {"name": "step", "schedule": {0: 4}}, max_epochs=2)
    assert obs.factors == [4] * 8
    plain = TinyModel(n=32, batch_size=8)
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=2))
    trainer.fit(plain)
    assert trainer.global_step == 8
    torch.testing.assert_close(params(accumulated), params(plain))
    assert not torch.equal(params(plain), params(TinyModel()))  # it did train


def test_seed_dict_example_trains_to_completion() -> None:
    # the guide's Trainer(accumulate_grad_batches={0: 8, 5: 4, 10: 2}), through lplugins, 8 micro-batches per epoch
    model = TinyModel(n=16)
    trainer, obs = fit(model, {0: 8, 5: 4, 10: 2}, max_epochs=11)
    assert trainer.state.finished and trainer.current_epoch == 11
    assert obs.factors == [8] * 5 + [4] * 10 + [2] * 4
    assert trainer.global_step == 19


def test_epoch_schedule_matches_plain_sgd_reference() -> None:
    model = TinyModel(n=24)
    _, obs = fit(model, {0: 4, 1: 3}, max_epochs=2)
    assert obs.factors == [4, 4, 4, 3, 3, 3, 3]
    x, y = make_data(24)
    expected = reference_sgd(x, y, sequential_windows(24, 2, obs.factors, 2), obs.factors)
    torch.testing.assert_close(params(model), expected)


def test_ramp_over_steps_and_samples() -> None:
    _, obs = fit(TinyModel(n=28), {"name": "ramp", "start": 2, "target": 8, "over": 3, "unit": "steps"}, max_epochs=1)
    assert obs.factors == [1, 2, 3, 4, 4]
    stepwise = {"name": "ramp", "start": 2, "target": 8, "over": 12, "kind": "stepwise", "increment": 2}
    _, obs = fit(TinyModel(n=30), stepwise, max_epochs=1)
    assert obs.factors == [1, 1, 2, 3, 4, 4]


def test_lightning_gradient_accumulation_scheduler_gives_the_same_steps() -> None:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    ours = TinyModel(n=24)
    _, obs = fit(ours, {0: 4, 1: 2}, max_epochs=2)
    theirs = TinyModel(n=24)
    lightning_obs = Observer()
    trainer = pl.Trainer(
        **trainer_kwargs(max_epochs=2, callbacks=[GradientAccumulationScheduler({0: 4, 1: 2}), lightning_obs])
    )
    trainer.fit(theirs)
    assert obs.factors == lightning_obs.factors == [4, 4, 4, 2, 2, 2, 2, 2, 2]
    torch.testing.assert_close(params(ours), params(theirs))


# ---------------------------------------------------------------------------- observability
class MemoryLogger(pl.loggers.Logger):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))


def test_factor_logged_once_per_change_and_shown_in_progress_bar(caplog: pytest.LogCaptureFixture) -> None:
    logger = MemoryLogger()
    with caplog.at_level(logging.INFO, logger="lplugins"):
        trainer, _ = fit(TinyModel(n=24), {"name": "step", "schedule": {0: 2, 3: 4}}, max_epochs=2, logger=logger)
    changes = [m for _, m in logger.records if "accumulation/factor" in m]
    assert changes == [
        {"accumulation/factor": 2.0, "accumulation/global_batch": 4.0},
        {"accumulation/factor": 4.0, "accumulation/global_batch": 8.0},
    ]
    lines = [r.getMessage() for r in caplog.records if "gradient accumulation" in r.getMessage()]
    assert len(lines) == 2 and "effective global batch 8" in lines[1] and "optimizer step 3" in lines[1]
    assert trainer.progress_bar_metrics["accum"] == 4.0
    assert trainer.progress_bar_metrics["global_batch"] == 8.0


# ---------------------------------------------------------------------------- manual optimization
def test_manual_optimization_with_the_helper_matches_reference() -> None:
    model = TinyModel(n=24, manual=True)
    trainer, _ = fit(model, {"name": "step", "schedule": {0: 2, 3: 4}}, max_epochs=1)
    factors = [2, 2, 2, 4, 2]
    assert trainer.global_step == len(factors)
    x, y = make_data(24)
    expected = reference_sgd(x, y, sequential_windows(24, 2, factors, 1), [2, 2, 2, 4, 4])
    torch.testing.assert_close(params(model), expected)


def test_manual_optimization_without_the_helper_is_a_clear_error() -> None:
    class Manual(TinyModel):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.manual_backward(torch.nn.functional.mse_loss(self.layer(x), y))

    with pytest.raises(ScheduleError, match=r"manual optimization.*\.backward\(self, loss\)"):
        fit(Manual(manual=True), {0: 2}, max_epochs=1)


# ---------------------------------------------------------------------------- checkpoints
class SaveAt(Callback):
    """Save a checkpoint at the end of the given micro-batch (0-based, counted over the run)."""

    def __init__(self, at: int, path: Path) -> None:
        self.at = at
        self.path = path
        self.seen = 0

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.seen == self.at:
            trainer.save_checkpoint(self.path)
        self.seen += 1


def test_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "mid.ckpt"
    # 16 micro-batches per epoch, factor 4 for 3 steps then 2; save after micro-batch 9 (2nd of the 3rd window)
    schedule = {"name": "step", "schedule": {0: 4, 3: 2}}
    full_trainer, full = fit(TinyModel(n=32), schedule, max_epochs=2, callbacks=[SaveAt(9, ckpt)])
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    (saved,) = [v for k, v in state.items() if k.startswith("AccumulationScheduler")]
    assert (saved["steps"], saved["window_pos"], saved["window_factor"]) == (2, 2, 4)
    assert full.factors == [4, 4, 4, 2, 2] + [2] * 8

    resumed_trainer, resumed = fit(TinyModel(n=32), schedule, max_epochs=2, ckpt_path=str(ckpt))
    # the open window needs its 2 remaining micro-batches; afterwards the windows are those of the uninterrupted run
    assert resumed.factors == [2, *full.factors[3:]]
    assert resumed_trainer.global_step == full_trainer.global_step


def test_resume_at_an_epoch_boundary_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    schedule = {"name": "step", "schedule": {0: 4, 4: 2}}  # changes inside the 2nd epoch
    uninterrupted = TinyModel(n=24)
    _, full = fit(uninterrupted, schedule, max_epochs=2)
    first = TinyModel(n=24)
    trainer, part1 = fit(first, schedule, max_epochs=1)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    second = TinyModel(n=24)
    _, part2 = fit(second, schedule, max_epochs=2, ckpt_path=str(tmp_path / "epoch1.ckpt"))
    assert part1.factors + part2.factors == full.factors == [4, 4, 4, 4, 2, 2, 2, 2]
    torch.testing.assert_close(params(second), params(uninterrupted))


# ---------------------------------------------------------------------------- docs
def test_docs_examples_run(lplugins_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ```python block of docs/accumulation.md runs, in order, in one namespace (with a fresh
    process-wide manager: the page registers a plugin in-script; from a temporary directory)."""
    import re

    monkeypatch.chdir(tmp_path)
    text = (Path(__file__).resolve().parents[1] / "docs" / "accumulation.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    assert len(blocks) >= 6
    namespace: dict[str, Any] = {"__name__": "docs_accumulation"}
    for block in blocks:
        exec(compile(block, "docs/accumulation.md", "exec"), namespace)
    assert namespace["trainer"].global_step == 4  # the last example (manual optimization) trained
    assert lplugins_manager.plugin("my-schedules").registered == {"schedule": ["halving"]}


def test_checkpoint_saved_by_a_callback_that_runs_before_the_scheduler(tmp_path: Path) -> None:
    # Lightning resumes a checkpoint saved in on_train_batch_end as "this batch is done", whatever the callback
    # order; the scheduler's state must say the same even if its own on_train_batch_end has not run yet
    schedule = {"name": "step", "schedule": {0: 4, 3: 2}}
    early, late = tmp_path / "early.ckpt", tmp_path / "late.ckpt"
    fit(TinyModel(n=32), schedule, max_epochs=1, before=[SaveAt(9, early)], callbacks=[SaveAt(9, late)])

    def state(path: Path) -> dict[str, Any]:
        callbacks = torch.load(path, weights_only=False)["callbacks"]
        return next(v for k, v in callbacks.items() if k.startswith("AccumulationScheduler"))

    assert state(early) == state(late)
    assert (state(early)["steps"], state(early)["window_pos"], state(early)["samples"]) == (2, 2, 20)


def test_estimated_stepping_batches_follows_the_schedule() -> None:
    from lplugins.accumulation import AccumulationScheduler

    class OneCycle(TinyModel):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=LR)
            self.total = AccumulationScheduler.of(self.trainer).estimated_stepping_batches(self.trainer)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=self.total)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    model = OneCycle(n=24)  # OneCycleLR raises if stepped more than total_steps times
    trainer, obs = fit(model, {"name": "step", "schedule": {0: 2, 3: 4}}, max_epochs=2)
    assert model.total == trainer.global_step == len(obs.factors) == 8
    model = OneCycle(n=24)
    trainer, _ = fit(model, {"name": "step", "schedule": {0: 2, 3: 4}}, max_epochs=2, max_steps=5)
    assert model.total == trainer.global_step == 5


def test_one_scheduler_object_in_two_fresh_runs_starts_over() -> None:
    from lplugins.accumulation import AccumulationScheduler

    scheduler = AccumulationScheduler(StepSchedule({0: 2, 3: 4}))
    runs = []
    for _ in range(2):
        observer = Observer()
        trainer = pl.Trainer(**trainer_kwargs(max_epochs=1, callbacks=[scheduler, observer]))
        trainer.fit(TinyModel(n=24))
        runs.append(observer.factors)
    assert runs[0] == runs[1] == [2, 2, 2, 4, 2]
    assert scheduler.steps == 5 and scheduler.samples == 24


def test_resume_from_a_checkpoint_without_scheduler_state_uses_lightnings_step(tmp_path: Path) -> None:
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=1))
    trainer.fit(TinyModel(n=24))  # 12 optimizer steps, no schedule
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    resumed, obs = fit(
        TinyModel(n=24),
        {"name": "step", "schedule": {0: 1, 12: 3}},
        max_epochs=2,
        ckpt_path=str(tmp_path / "plain.ckpt"),
    )
    assert obs.factors == [3, 3, 3, 3]
    assert resumed.global_step == 16


# ---------------------------------------------------------------------------- decisions said once, on rank zero
def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lplugins" and "accumulation" in r.getMessage()]


def test_the_starting_factor_is_said_once_with_its_schedule(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lplugins"):
        fit(TinyModel(n=24), {0: 2, 1: 4}, max_epochs=2)
    assert _said(caplog) == [
        "lplugins: gradient accumulation per EpochSchedule({0: 2, 1: 4}): 2 micro-batch(es) per optimizer step, "
        "effective global batch 4 (from optimizer step 0, epoch 0)",
        "lplugins: gradient accumulation now 4 micro-batch(es) per optimizer step, effective global batch 8 "
        "(from optimizer step 6, epoch 1); was 2",
    ]


def test_accumulation_decisions_are_said_on_rank_zero_only(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lplugins.rankzero._rank as rank

    monkeypatch.setattr(rank, "is_global_zero", lambda: False)  # as on global rank 1 of a job
    with caplog.at_level(logging.INFO, logger="lplugins"):
        fit(TinyModel(n=24), {0: 2, 1: 4}, max_epochs=2)
    assert _said(caplog) == []


def test_resume_inside_a_window_and_without_scheduler_state_are_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "mid.ckpt"
    schedule = {"name": "step", "schedule": {0: 4, 3: 2}}
    fit(TinyModel(n=32), schedule, max_epochs=1, callbacks=[SaveAt(9, ckpt)])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lplugins"):
        fit(TinyModel(n=32), schedule, max_epochs=2, ckpt_path=str(ckpt))
    said = _said(caplog)
    assert said[0] == (
        "lplugins: gradient accumulation (StepSchedule({0: 4, 3: 2})): resuming inside a window of 4 micro-batches "
        "per optimizer step (2 already accumulated before the checkpoint)."
    )
    assert said[1].startswith("lplugins: gradient accumulation now 2 micro-batch(es)") and len(said) == 2

    plain = pl.Trainer(**trainer_kwargs(max_epochs=1))
    plain.fit(TinyModel(n=24))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lplugins"):
        fit(
            TinyModel(n=24),
            {"name": "step", "schedule": {0: 1, 12: 3}},
            max_epochs=2,
            ckpt_path=str(tmp_path / "plain.ckpt"),
        )
    assert [m for m in _said(caplog) if "no accumulation-scheduler state" in m] == [
        "lplugins: the checkpoint holds no accumulation-scheduler state; StepSchedule({0: 1, 12: 3}) continues "
        "from optimizer step 12 (samples counted from 0)."
    ]
