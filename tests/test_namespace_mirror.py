"""The ``pytorch_lightning`` twins are generated at build time (``scripts/mirror_pl.py``) and committed.

Nothing is rewritten or executed a second time at import: ``lplugins._pl.X`` is an ordinary file.
These tests regenerate the twins and compare, so a change to a Lightning-facing module that was not
mirrored fails here, and check what the generator writes.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest

from tests._dist import ROOT, load_script

mirror = load_script("mirror_pl")


def test_the_committed_twins_are_what_the_generator_writes(capsys: pytest.CaptureFixture[str]) -> None:
    assert mirror.main(["--check"]) == 0, capsys.readouterr().out


def test_the_check_fails_on_a_stale_or_stray_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "_pl"
    shutil.copytree(ROOT / "src" / "lplugins" / "_pl", copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(mirror, "TWIN_DIR", copy)
    monkeypatch.setattr(mirror, "ROOT", tmp_path)
    stale = copy / "callbacks" / "checkpoint.py"
    stale.write_text(stale.read_text() + "\n# edited by hand\n")
    (copy / "callbacks" / "_crc.py").write_text("# a twin of a module that does not face Lightning\n")
    assert mirror.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "out of date: _pl/callbacks/checkpoint.py" in out
    assert "not generated: _pl/callbacks/_crc.py" in out
    assert mirror.main([]) == 0  # regenerating mends both
    assert mirror.main(["--check"]) == 0


def test_rewrite_points_lightning_and_twinned_modules_at_their_twins() -> None:
    known = set(mirror.modules())
    twins = set(mirror.twinned())
    source = (
        "from lightning.pytorch.callbacks import Callback\n"
        "import lightning.fabric\n"
        "from lplugins import _lightning, _log\n"
        "from lplugins.callbacks._resume import x\n"
        "from lplugins.callbacks._retention import Retention\n"
        "TABLE = {'DurableCheckpoint': 'lplugins.callbacks.checkpoint', 'crc': 'lplugins.callbacks._crc'}\n"
    )
    rewritten = mirror.rewrite(source, twins, known)
    assert rewritten.count("\n") == source.count("\n")  # tracebacks keep the source's line numbers
    assert "from pytorch_lightning.callbacks import Callback" in rewritten
    assert "import lightning_fabric" in rewritten
    assert "from lplugins._pl import _lightning; from lplugins import _log" in rewritten
    assert "from lplugins._pl.callbacks._resume import x" in rewritten
    assert "from lplugins.callbacks._retention import Retention" in rewritten  # no twin: the one module
    assert "'lplugins._pl.callbacks.checkpoint'" in rewritten and "'lplugins.callbacks._crc'" in rewritten
    # the bare package would import lightning.pytorch; a CLI flag is not a module
    bare = "    import lightning\n    v = lightning.__version__\nflag = '--lplugins.precision'\n"
    assert mirror.rewrite(bare, twins, known) == (
        "    import pytorch_lightning as lightning\n    v = lightning.__version__\nflag = '--lplugins.precision'\n"
    )


def test_only_modules_that_face_lightning_have_twins() -> None:
    twins = mirror.twinned()
    assert "lplugins.callbacks.checkpoint" in twins and "lplugins._lightning" in twins
    for shared in ("lplugins.accumulation._schedules", "lplugins.callbacks._retention", "lplugins.callbacks._errors"):
        assert shared not in twins
        assert not (ROOT / "src" / "lplugins" / "_pl" / (shared[9:].replace(".", "/") + ".py")).exists()


def test_a_twin_uses_the_one_class_of_what_does_not_face_lightning() -> None:
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning as pl

    from lplugins.callbacks import _errors

    twin = importlib.import_module("lplugins._pl.callbacks._resume")
    assert twin.CheckpointResumeError is _errors.CheckpointResumeError  # one class in the process
    checkpoint = importlib.import_module("lplugins._pl.callbacks.checkpoint")
    assert checkpoint is not importlib.import_module("lplugins.callbacks.checkpoint")
    assert issubclass(checkpoint.DurableCheckpoint, pl.callbacks.Checkpoint)
    # a real file: tools see the code that runs
    assert Path(checkpoint.__file__).is_file() and checkpoint.__file__.endswith("_pl/callbacks/checkpoint.py")
    assert "lplugins._lightning.namespace" not in {type(f).__module__ for f in sys.meta_path}
