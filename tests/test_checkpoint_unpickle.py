"""The fast weights-only load: C ``pickle`` restricted to (a subset of) torch's allow-list; anything else
goes to torch's own weights-only unpickler, so it accepts and refuses exactly what torch does."""

from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer

from lplugins.callbacks import DurableCheckpoint
from lplugins.callbacks._unpickle import _Module, fast_weights_only_load
from tests.models import Regression, regression_loader

QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def lightning_checkpoint(tmp_path: Path) -> str:
    durable = DurableCheckpoint(tmp_path, every_n_steps=2, save_on_train_end=False)
    Trainer(callbacks=[durable], max_steps=2, **QUIET).fit(
        Regression(hidden=[16, 16], optimizer="adam"), regression_loader(16, batch_size=4)
    )
    return durable.committed[-1]


@pytest.mark.parametrize("mmap", [True, False])
def test_a_lightning_checkpoint_loads_on_the_fast_path_as_torch_loads_it(tmp_path: Path, mmap: bool) -> None:
    path = lightning_checkpoint(tmp_path)
    # the fast path alone (no fallback): everything in a Lightning checkpoint is on its list
    fast = torch.load(path, mmap=mmap, weights_only=False, pickle_module=_Module)
    assert same(fast, torch.load(path, mmap=mmap, weights_only=True))
    assert same(fast_weights_only_load(path, None, mmap=mmap), fast)
    assert fast["optimizer_states"][0]["state"][0]["exp_avg"].numel() > 0  # Adam's state, as tensors


def test_protocol_2_names_and_the_builtins_torch_allows_are_on_the_fast_path(tmp_path: Path) -> None:
    value = {"s": {1, 2}, "c": 1 + 2j, "b": b"\x00\xff", "a": bytearray(b"ab"), "size": torch.Size([2, 3]),
             "dtype": torch.bfloat16, "device": torch.device("cpu"),
             "p": torch.nn.Parameter(torch.ones(2))}  # fmt: skip
    path = tmp_path / "v.pt"
    torch.save(value, path)  # protocol 2: builtins are named __builtin__
    fast = torch.load(path, weights_only=False, pickle_module=_Module)
    assert same({k: v for k, v in fast.items() if k != "p"}, {k: v for k, v in value.items() if k != "p"})
    assert isinstance(fast["p"], torch.nn.Parameter) and torch.equal(fast["p"], value["p"])


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_a_payload_is_refused_as_torch_refuses_it_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "x": Payload(marker)}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):  # torch's own message
        fast_weights_only_load(str(path), None, mmap=True)
    assert not marker.exists()


class Allowed:
    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Allowed) and other.n == self.n


def test_what_only_torch_allows_is_loaded_by_torch(tmp_path: Path) -> None:
    """A global torch allows and the fast path does not (``Counter``; a type the user added with
    ``safe_globals``): the fast path refuses it, and the load is torch's."""
    path = tmp_path / "v.pt"
    torch.save({"counts": collections.Counter("aab"), "mine": Allowed(3), "w": torch.arange(4)}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=False, pickle_module=_Module)
    with torch.serialization.safe_globals([Allowed]):
        loaded = fast_weights_only_load(str(path), None, mmap=True)
    assert loaded["counts"] == collections.Counter("aab") and loaded["mine"] == Allowed(3)
    assert torch.equal(loaded["w"], torch.arange(4))
    with pytest.raises(pickle.UnpicklingError, match="Allowed"):  # not allowed: torch refuses it, naming it
        fast_weights_only_load(str(path), None, mmap=True)
