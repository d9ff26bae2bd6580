"""A verified resume memory-maps the committed file (no fresh copy), and never writes to it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer, seed_everything

from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._record import COMMIT_SUFFIX, Record
from lplugins.callbacks._storages import open_storage
from lplugins.callbacks._verify import bytes_problem
from tests.models import Regression, regression_loader

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}


class OwnIO(TorchCheckpointIO):
    """A user's ``CheckpointIO``: its own ``load_checkpoint`` must be the one that runs."""

    loads = 0

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        OwnIO.loads += 1
        return super().load_checkpoint(*args, **kwargs)


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds ``tensor``'s bytes (``/proc/self/maps``), or None (anonymous memory, heap)."""
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                name = fields[5].strip() if len(fields) == 6 else ""
                return name if name.startswith("/") else None
    return None


def saved_then_loaded(tmp_path: Path, **trainer_kw: Any) -> tuple[dict[str, Any], Path]:
    """Fit 2 steps with a DurableCheckpoint, then load ``"latest"`` through the trainer's wrapped CheckpointIO."""
    seed_everything(3, verbose=False)
    durable = DurableCheckpoint(tmp_path, every_n_steps=2, save_on_train_end=False)
    trainer = Trainer(callbacks=[durable], max_steps=2, **QUIET, **trainer_kw)
    model = Regression(hidden=[16], optimizer="adam")
    trainer.fit(model, regression_loader(16, batch_size=4))
    durable.setup(trainer, model, "fit")  # installs the resolver in front of the CheckpointIO, as a resume does
    try:
        loaded = trainer.strategy.checkpoint_io.load_checkpoint("latest")
    finally:
        durable.teardown(trainer, model, "fit")
    return loaded, tmp_path / "step=000000002-epoch=0000.ckpt"


def test_a_verified_resume_maps_the_committed_file_and_loads_what_torch_load_does(tmp_path: Path) -> None:
    loaded, path = saved_then_loaded(tmp_path)
    weights = loaded["state_dict"]["net.0.weight"]
    assert mapped_file(weights) == os.path.realpath(path)  # a view of the file's pages, not a copy
    moment = loaded["optimizer_states"][0]["state"][0]["exp_avg"]
    assert mapped_file(moment) == os.path.realpath(path)
    reference = torch.load(path, weights_only=True)
    assert mapped_file(reference["state_dict"]["net.0.weight"]) is None
    for name, tensor in reference["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor), name
    assert loaded["global_step"] == reference["global_step"] == 2


def test_writing_to_a_mapped_tensor_never_changes_the_committed_file(tmp_path: Path) -> None:
    loaded, path = saved_then_loaded(tmp_path)
    assert mapped_file(loaded["state_dict"]["net.0.weight"]) == os.path.realpath(path)
    before = path.read_bytes()
    for tensor in loaded["state_dict"].values():
        tensor.add_(1.0)  # what an optimizer step does to the state it was given
    loaded["optimizer_states"][0]["state"][0]["exp_avg"].mul_(3.0)
    assert path.read_bytes() == before  # copy-on-write (MAP_PRIVATE): nothing reaches the file
    record = Record.from_json((tmp_path / (path.name + COMMIT_SUFFIX)).read_bytes())
    assert bytes_problem(open_storage(str(tmp_path)), record) is None


@pytest.mark.parametrize("io", ["stock", "own"])
def test_only_lightnings_own_checkpoint_io_is_replaced_by_the_mapped_load(tmp_path: Path, io: str) -> None:
    OwnIO.loads = 0
    loaded, path = saved_then_loaded(tmp_path, **({"plugins": [OwnIO()]} if io == "own" else {}))
    mapped = mapped_file(loaded["state_dict"]["net.0.weight"])
    if io == "own":  # a user's CheckpointIO subclass keeps its own load_checkpoint
        assert OwnIO.loads == 1 and mapped is None
    else:
        assert mapped == os.path.realpath(path)


def test_pythons_generator_state_is_one_tensor_and_the_older_list_form_still_restores() -> None:
    import random

    from lplugins.callbacks import _rng

    random.seed(11)
    state = _rng.capture()
    words = state["python"][1]
    assert isinstance(words, torch.Tensor) and words.numel() == 625  # one record, not 625 pickled ints
    expected = [random.random() for _ in range(3)]
    _rng.restore(state)
    assert [random.random() for _ in range(3)] == expected
    older = {**state, "python": [state["python"][0], words.tolist(), state["python"][2]]}  # written before this
    _rng.restore(older)
    assert [random.random() for _ in range(3)] == expected
