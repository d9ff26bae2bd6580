"""Root conftest: keeps every test hermetic (no leaked env vars or process groups)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _no_leaks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test that leaks environment variables or an initialised process group."""
    # the user's plugin controls must not change what the tests see
    for var in (
        "LPLUGINS_DISABLE_AUTOLOAD",
        "LPLUGINS_PLUGINS",
        "LPLUGINS_DISABLE",
        "LPLUGINS_STRICT",
        "LPLUGINS_AUTO_CALLBACKS",
    ):
        monkeypatch.delenv(var, raising=False)
    before = dict(os.environ)
    yield
    monkeypatch.undo()  # what the test set through monkeypatch is restored, not a leak
    after = dict(os.environ)
    leaked = {k for k in set(before) ^ set(after) if not k.startswith(("PYTEST_", "LPLUGINS_"))}
    leaked |= {k for k in set(before) & set(after) if before[k] != after[k] and not k.startswith("PYTEST_")}
    # Lightning sets these on purpose in single-process runs; anything else is a leak
    # and these are set once, at import, by lightning.fabric / deepspeed / torch
    leaked -= {
        "PL_GLOBAL_SEED",
        "PL_SEED_WORKERS",
        "CUDA_MODULE_LOADING",
        "KMP_DUPLICATE_LIB_OK",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "TORCHINDUCTOR_CACHE_DIR",
    }
    for k in leaked:
        if k in before:
            os.environ[k] = before[k]
        else:
            os.environ.pop(k, None)
    assert not leaked, f"test leaked environment variables: {sorted(leaked)}"
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            pytest.fail("test leaked an initialised torch.distributed process group")
    except ImportError:  # pragma: no cover
        pass
