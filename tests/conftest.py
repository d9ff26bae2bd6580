"""Shared fixtures: the example plugin package, really installed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACME = ROOT / "examples" / "acme-lplugins"


@pytest.fixture(scope="session")
def acme_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the example plugin ``acme-lplugins``, pip-installed (real dist-info, real
    entry point) with ``pip install --target``, so the test environment itself is not modified."""
    target = tmp_path_factory.mktemp("acme-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(ACME)],
        check=True,
        capture_output=True,
    )
    assert (target / "acme_lplugins" / "plugin.py").exists()
    return target


@pytest.fixture
def acme_on_path(acme_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Put the installed example plugin on ``sys.path`` for this test."""
    monkeypatch.syspath_prepend(str(acme_site))
    yield acme_site
    for name in [m for m in sys.modules if m == "acme_lplugins" or m.startswith("acme_lplugins.")]:
        del sys.modules[name]
