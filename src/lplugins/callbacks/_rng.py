"""Capturing and restoring the random number generators (torch CPU, Python, NumPy) a checkpoint resumes with."""

from __future__ import annotations

import random
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["capture", "rank_and_world", "restore", "restore_this_rank"]


def capture() -> dict[str, Any]:
    """This process's generator states, as tensors and plain values (``weights_only`` loads them).

    Python's 625-word state is one int64 tensor (one record for ``torch.load``'s weights-only unpickler,
    which is pure Python: as a list it cost a resume more time than reading the whole model).
    """
    version, state, gauss = random.getstate()
    words = torch.tensor(state, dtype=torch.int64)
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, words, gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = [
            kind,
            torch.from_numpy(np.asarray(keys).astype("int64")),
            int(pos),
            int(has_gauss),
            float(cached),
        ]
    except ImportError:  # pragma: no cover
        pass
    return out


def restore(state: dict[str, Any]) -> None:
    """Set the generators to a state :func:`capture` returned."""
    torch.set_rng_state(state["torch"])
    version, values, gauss = state["python"]
    words = values.tolist() if isinstance(values, torch.Tensor) else values  # a list: written by earlier versions
    random.setstate((version, tuple(words), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def rank_and_world() -> tuple[int, int]:
    """This process's global rank and the world size, from torch.distributed itself (``(0, 1)`` without it).

    For ``load_state_dict``, which gets no trainer.
    """
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (torch.distributed.get_rank(), torch.distributed.get_world_size()) if dist else (0, 1)


def restore_this_rank(states: list[dict[str, Any]]) -> bool:
    """Restore this rank's entry of every rank's states (rank order); False (and a warning) if the world changed."""
    rank, world = rank_and_world()
    if len(states) != world:
        rank_zero_warn(
            f"DurableCheckpoint: the checkpoint holds the RNG states of {len(states)} rank(s) but this run has"
            f" {world}; the random number generators are not restored."
        )
        return False
    restore(states[rank])
    return True
