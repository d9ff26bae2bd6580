"""Bad input to ``DurableCheckpoint`` fails when it is built, naming the argument, the value and what is allowed."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Trainer

from lplugins.callbacks import CheckpointConfigError, DurableCheckpoint, request_checkpoint
from tests.models import Regression, regression_loader

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}


# ------------------------------------------------------------------------------ preemption signals
@pytest.mark.parametrize("sig", ["SIGKILL", "KILL", signal.SIGKILL, int(signal.SIGKILL), "SIGSTOP"])
def test_a_signal_that_cannot_be_caught_is_refused_when_built(sig: Any) -> None:
    with pytest.raises(CheckpointConfigError) as err:
        DurableCheckpoint(preemption_signals=[sig])
    message = str(err.value)
    assert "preemption_signals" in message and "cannot be caught" in message
    assert "'SIGTERM'" in message and "'SIGUSR1'" in message  # what is allowed


@pytest.mark.parametrize("value", ["SIGTERM", 15, signal.SIGTERM])
def test_a_bare_signal_instead_of_a_list_is_refused(value: Any) -> None:
    with pytest.raises(CheckpointConfigError, match=r"preemption_signals=.* must be a list of signals"):
        DurableCheckpoint(preemption_signals=value)


@pytest.mark.parametrize("value", ["SIGNOPE", 0, 9999, 1.5, True])
def test_something_that_is_not_a_signal_is_refused(value: Any) -> None:
    with pytest.raises(CheckpointConfigError, match=r"preemption_signals: .* is not a signal"):
        DurableCheckpoint(preemption_signals=[value])


def test_catchable_signals_by_name_or_number_are_kept_once() -> None:
    cb = DurableCheckpoint(preemption_signals=["TERM", signal.SIGTERM, "SIGUSR2", int(signal.SIGHUP)])
    assert cb.preemption_signals == (signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP)


# ------------------------------------------------------------------------------ bools are bools
BOOLS = ["save_on_train_end", "async_save", "slurm_requeue", "crc32", "auto_insert_metric_name"]


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_a_bool_argument_must_be_a_real_bool(name: str, value: Any) -> None:
    with pytest.raises(CheckpointConfigError) as err:
        DurableCheckpoint(**{name: value})
    assert str(err.value) == f"DurableCheckpoint: {name}={value!r} is not allowed; it must be True or False."


@pytest.mark.parametrize("name", BOOLS)
def test_real_bools_are_accepted(name: str) -> None:
    value = name not in ("save_on_train_end", "crc32", "auto_insert_metric_name")  # not the default
    assert getattr(DurableCheckpoint(every_n_steps=1, **{name: value}), name) is value


# ------------------------------------------------------------------------------ dirpath
def test_an_empty_dirpath_is_an_error_that_says_to_pass_none() -> None:
    for empty in ("", "  "):
        with pytest.raises(CheckpointConfigError, match=r"dirpath=.* pass None for the default"):
            DurableCheckpoint(empty)


@pytest.mark.parametrize("value", [123, 1.5, b"ckpts", ["ckpts"]])
def test_a_dirpath_that_is_not_a_path_names_dirpath(value: Any) -> None:
    with pytest.raises(CheckpointConfigError, match=r"^DurableCheckpoint: dirpath=.* must be a directory"):
        DurableCheckpoint(value)


def test_paths_and_none_are_accepted(tmp_path: Path) -> None:
    assert DurableCheckpoint(tmp_path).dirpath == str(tmp_path)
    assert DurableCheckpoint(None).dirpath is None
    assert DurableCheckpoint("memory://run").dirpath == "memory://run"


# ------------------------------------------------------------------------------ a callback that saves only on request
def test_a_callback_without_automatic_triggers_says_so_and_warns_when_it_saved_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Decision: request_checkpoint() counts as a trigger (the guide's rank-zero pattern relies on it), so
    # such a callback is allowed; it is announced at train start and a fit without any request warns.
    caplog.set_level(logging.INFO, logger="lplugins")
    cb = DurableCheckpoint(tmp_path, save_on_train_end=False, preemption_signals=())
    trainer = Trainer(callbacks=[cb], max_steps=2, **QUIET)
    with pytest.warns(UserWarning, match=r"saved nothing in this fit: it has no automatic trigger"):
        trainer.fit(Regression(), regression_loader(16, batch_size=4))
    (line,) = [r.getMessage() for r in caplog.records if "no automatic trigger" in r.getMessage()]
    assert "saves only when request_checkpoint(trainer) is called" in line
    assert not list(tmp_path.glob("*.ckpt"))


def test_a_request_only_callback_that_got_a_request_does_not_warn(tmp_path: Path) -> None:
    from lightning.pytorch import Callback

    class Request(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            request_checkpoint(trainer)

    cb = DurableCheckpoint(tmp_path, save_on_train_end=False, preemption_signals=())
    trainer = Trainer(callbacks=[cb, Request()], max_steps=2, **QUIET)
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saved nothing.*")
        trainer.fit(Regression(), regression_loader(16, batch_size=4))
    assert len(list(tmp_path.glob("*.ckpt"))) >= 1
