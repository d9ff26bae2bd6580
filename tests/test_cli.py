"""The ``lplugins`` command's conventions: ``--version``, ``python -m lplugins``, help when run bare."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from lplugins.cli import main


def test_version_flag_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lplugins {version('lplugins')}"


def test_bare_command_prints_help_and_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lplugins")
    for command in ("list", "demo", "new-plugin", "advise"):
        assert command in out


def test_python_dash_m_runs_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lplugins", "--version"], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == f"lplugins {version('lplugins')}"
