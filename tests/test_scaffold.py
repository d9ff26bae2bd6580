"""The plugin-author kit: a scaffolded package installs, is discovered, and its own tests pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lplugins import LPluginsError
from lplugins._cli.scaffold import scaffold


@pytest.mark.timeout(240)
def test_scaffolded_plugin_installs_and_is_discovered(tmp_path: Path) -> None:
    pkg = tmp_path / "widget-lplugins"
    out = subprocess.run(
        [sys.executable, "-m", "lplugins", "new-plugin", "widget-lplugins", "--dir", str(pkg)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "created" in out and (pkg / "pyproject.toml").exists()
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(pkg)],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    listing = subprocess.run(
        [sys.executable, "-m", "lplugins", "list", "--json"], env=env, capture_output=True, text=True, check=True
    ).stdout
    plugins = {p["name"]: p for p in json.loads(listing)["plugins"]}
    assert plugins["widget"]["distribution"] == "widget-lplugins"
    assert plugins["widget"]["registered"] == {"strategy": ["widget_ddp"], "callback": ["widget_hello"]}
    # the scaffolded package's own tests (using lplugins.testing) pass against the installed copy
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(pkg / "tests")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert "2 passed" in tests.stdout


def test_scaffold_refuses_bad_names_and_non_empty_directories(tmp_path: Path) -> None:
    with pytest.raises(LPluginsError, match="Invalid plugin package name 'Bad Name'"):
        scaffold("Bad Name", tmp_path / "x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("user data")
    with pytest.raises(LPluginsError, match="exists and is not empty"):
        scaffold("ok-lplugins", tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "user data"
