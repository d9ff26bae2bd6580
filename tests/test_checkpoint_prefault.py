"""A verified resume makes the private copies of the optimizer state it maps in the background, bytes unchanged.

The optimizer's first step writes its whole state; on a copy-on-write mapping of the checkpoint file that
costs one page fault per 4 KiB page. :mod:`lplugins.callbacks._prefault` makes those copies with
``madvise(MADV_POPULATE_WRITE)`` on a thread: checked here through the kernel's own account of the
mapping (``/proc/self/smaps``: a copied page of a file mapping counts as ``Anonymous``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lplugins.callbacks import DurableCheckpoint, _prefault
from lplugins.callbacks._safe_io import mapped_load
from tests.models import Regression, regression_loader

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")

MIB = 1 << 20


def copied_kib(path: Path) -> int:
    """KiB of ``path``'s mappings in this process that are private copies (smaps ``Anonymous``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Anonymous:"):
            total += int(head[1])
    return total


def test_only_the_optimizer_state_is_copied_and_its_bytes_do_not_change(tmp_path: Path) -> None:
    path = tmp_path / "state.ckpt"
    moments = torch.arange(MIB, dtype=torch.float32)  # 4 MiB
    torch.save({"state_dict": {"w": torch.ones(MIB)}, "optimizer_states": [{"state": {0: {"m": moments}}}]}, path)
    before = path.read_bytes()
    loaded = mapped_load(str(path))
    assert copied_kib(path) < 1024, "a fresh mapping holds no private copies"
    _prefault.prefault_writes(loaded["optimizer_states"])
    _prefault.wait_for_prefaults(30)
    if not _prefault._supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    copied = copied_kib(path)
    assert 4096 <= copied < 4096 + 1024, f"{copied} KiB copied: the 4 MiB of moments, not the 4 MiB of weights"
    assert torch.equal(loaded["optimizer_states"][0]["state"][0]["m"], moments)
    assert path.read_bytes() == before


def test_a_verified_resume_prefaults_what_it_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seed_everything(5, verbose=False)
    quiet = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    durable = DurableCheckpoint(tmp_path, every_n_steps=2, save_on_train_end=False)
    trainer = Trainer(callbacks=[durable], max_steps=2, **quiet)
    model = Regression(hidden=[16], optimizer="adam")
    trainer.fit(model, regression_loader(16, batch_size=4))

    import lplugins.callbacks._safe_io as safe_io

    given: list[Any] = []
    monkeypatch.setattr(safe_io, "prefault_writes", lambda tree: given.append(tree) or _prefault.prefault_writes(tree))
    durable.setup(trainer, model, "fit")
    try:
        loaded = trainer.strategy.checkpoint_io.load_checkpoint("latest")
    finally:
        durable.teardown(trainer, model, "fit")
    _prefault.wait_for_prefaults(30)
    assert len(given) == 1 and given[0] is loaded["optimizer_states"]
