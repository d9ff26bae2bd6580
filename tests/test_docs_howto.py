"""Docs that teach, executed: every code block of the how-to pages (``docs/how-to/*.md``; ``hydra.md``
is run by ``tests/test_hydra.py``), the home page's and the tutorial's first Trainer, each example of
``docs/hooks.md`` pasted into a script, and the in-script registrations of ``concepts.md``,
``writing-a-plugin.md``, ``precision.md`` and ``testing-a-plugin.md``. Single process, CPU, a few steps.

Python blocks run in one namespace per page, in order, in a temporary working directory, with a fresh
process-wide plugin manager; shell lines run as commands (``lplugins`` as ``python -m lplugins``); an
output shown on a page is compared with what the code prints. The lines not run are named in each
test: those that would change this environment (``pip install -e``) or need a cluster or an index
(``#SBATCH``, ``twine upload``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOWTO = ROOT / "docs" / "how-to"


def _blocks(page: str, lang: str = "python") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", (HOWTO / page).read_text(), flags=re.M | re.S)


def _exec_page(page: str, namespace: dict[str, Any]) -> dict[str, Any]:
    for block in _blocks(page):
        exec(compile(block, f"docs/how-to/{page}", "exec"), namespace)
    return namespace


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LOCAL_RANK", "NODE_RANK"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_every_how_to_page_is_executed_here_or_in_its_own_test() -> None:
    pages = {p.name for p in HOWTO.glob("*.md")}
    tested = {"existing-trainer.md", "register-in-script.md", "resume.md", "publish-a-plugin.md",
              "pick-a-strategy.md", "hydra.md",
              "my-job-hangs.md"}  # fmt: skip  # my-job-hangs.md: tests/test_fault_matrix.py
    tested.add("move-a-run.md")  # tests/test_resume_matrix.py::test_move_a_run_how_to
    assert pages == tested, "a new how-to page needs a test that runs its code blocks"


@pytest.mark.timeout(300)
def test_existing_trainer(lplugins_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ns = _exec_page("existing-trainer.md", {"__name__": "howto_existing"})
    trainer = ns["trainer"]
    assert trainer.global_step == 16
    assert {"DurableCheckpoint", "MetricsCallback"} <= {type(cb).__name__ for cb in trainer.callbacks}
    assert "ModelCheckpoint" not in {type(cb).__name__ for cb in trainer.callbacks}  # the default one, replaced
    assert glob.glob("ckpts/*.commit")
    assert 0.0 <= float(trainer.callback_metrics["train/acc"]) <= 1.0


@pytest.mark.timeout(300)
def test_register_in_script(lplugins_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    script = types.ModuleType("howto_script")  # the page's script, as a module (it registers itself)
    monkeypatch.setitem(sys.modules, script.__name__, script)
    ns = _exec_page("register-in-script.md", script.__dict__)
    assert lplugins_manager.plugin("my-plugin").registered == {"schedule": ["halving"], "callback": ["lr_every_step"]}
    assert lplugins_manager.plugin("my-script").registered == {"schedule": ["warmup"]}
    names = {type(cb).__name__ for cb in ns["trainer"].callbacks}
    assert {"AccumulationScheduler", "LearningRateMonitor"} <= names
    assert type(ns["kwargs"]["callbacks"][0]).__name__ == "AccumulationScheduler"
    # what the page says about a second registration under the same name
    import lplugins

    with pytest.raises(lplugins.PluginError, match="a plugin of that name is already registered"):
        lplugins.get_manager().register(ns["MyPlugin"](), "my-plugin")
    # and about a hookimpl that is never registered: it does nothing
    with pytest.raises(lplugins.UnknownNameError):
        lplugins.compose(accumulate_grad_batches="not_registered_anywhere")


@pytest.mark.timeout(300)
def test_resume_after_preemption(tmp_path: Path) -> None:
    """train.py as shown: SIGTERM after its first committed checkpoint exits 75; the same command resumes."""
    (tmp_path / "train.py").write_text(_blocks("resume.md")[0])
    commands = [line.split("#")[0].strip() for line in _blocks("resume.md", "bash")[0].splitlines()]
    assert commands == ["python train.py", "python train.py"]
    proc = subprocess.Popen(
        [sys.executable, "train.py"], cwd=tmp_path, env=_env(), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 200
        while not glob.glob(str(tmp_path / "ckpts" / "*.commit")) and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint committed"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # as SLURM or Kubernetes would
        first = proc.communicate(timeout=200)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 75, first[-3000:]
    assert "preemption checkpoint saved at step" in first
    second = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240
    )
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    shown = _blocks("resume.md", "text")[0].split("...")[0].strip()  # the line as the page shows it
    assert re.search(re.sub(r"\d+", r"\\d+", re.escape(shown)), out), f"not as shown:\n{shown}\n{out[-3000:]}"
    assert "max_steps=2000` reached" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_publish_a_plugin(tmp_path: Path) -> None:
    """The scaffold command as shown; the entry point the page shows is the one generated; once installed
    (``pip install --target``, so this environment is not changed) ``lplugins list`` finds its names.
    Not run: ``pip install -e`` (would change this environment), ``pytest acme-lplugins`` (the scaffold's
    own tests, run by ``tests/test_scaffold.py``), ``python -m build`` and ``twine upload``."""
    new = _blocks("publish-a-plugin.md", "bash")[0].strip()
    assert new.startswith("lplugins new-plugin ")
    subprocess.run([sys.executable, "-m", "lplugins", *new.split()[1:]], cwd=tmp_path, env=_env(), check=True)
    pkg = tmp_path / "acme-lplugins"
    toml = _blocks("publish-a-plugin.md", "toml")[0]
    assert toml in (pkg / "pyproject.toml").read_text()
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(pkg)],
        check=True, capture_output=True,
    )  # fmt: skip
    env = {**_env(), "PYTHONPATH": str(site)}
    listing = subprocess.run(
        [sys.executable, "-m", "lplugins", "list", "--json"], env=env, capture_output=True, text=True, check=True
    ).stdout
    plugins = {p["name"]: p for p in json.loads(listing)["plugins"]}
    assert plugins["acme"]["distribution"] == "acme-lplugins"
    assert plugins["acme"]["registered"] == {"strategy": ["acme_ddp"], "callback": ["acme_hello"]}


@pytest.mark.timeout(300)
def test_pick_a_strategy(
    lplugins_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    ns = _exec_page("pick-a-strategy.md", {"__name__": "howto_strategy"})
    printed = capsys.readouterr().out
    for line in _blocks("pick-a-strategy.md", "text")[0].strip().splitlines():
        assert line in printed, f"the page shows {line!r}, the advisor printed:\n{printed}"
    assert type(ns["kwargs"]["strategy"]).__name__ == "DeepSpeedStrategy"


def test_home_page_example_composes(lplugins_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/index.md's example builds its Trainer (``fit`` needs a model: the how-to pages train)."""
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / "index.md").read_text()
    block = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)[0]
    fits: list[object] = []
    block = block.replace('trainer.fit(model, ckpt_path="latest")', "fits.append(trainer)")
    ns: dict[str, Any] = {"fits": fits}
    exec(compile(block, "docs/index.md", "exec"), ns)
    trainer = ns["trainer"]
    assert fits == [trainer]
    assert type(trainer.strategy).__name__ == "FSDP2Strategy"
    assert {"DurableCheckpoint", "AccumulationScheduler"} <= {type(cb).__name__ for cb in trainer.callbacks}


def test_precision_page_opening_runs(
    lplugins_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/precision.md's examples run as shown (this machine is a CPU for them: ``accelerator="cpu"``)."""
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / "precision.md").read_text()
    ns: dict[str, Any] = {"__name__": "docs_precision"}
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S):
        exec(compile(block, "docs/precision.md", "exec"), ns)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "32-true"
    assert printed[1].endswith("On CPU use one of: 32-true, bf16-mixed, bf16-true, 16-true, 64-true (or 'auto').")


def _hook_examples() -> list[Any]:
    text = (ROOT / "docs" / "hooks.md").read_text()
    sections = re.findall(r"^## (lplugins_\w+)\(.*?\)$\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    return [pytest.param(re.findall(r"^```python\n(.*?)^```", body, flags=re.M | re.S)[0], id=name)
            for name, body in sections]  # fmt: skip


@pytest.mark.parametrize("example", _hook_examples())
def test_hook_example_is_a_script_that_works(
    example: str, lplugins_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each example of docs/hooks.md, pasted into a script, registers itself and its name works."""
    monkeypatch.chdir(tmp_path)
    script = types.ModuleType("hook_example")
    monkeypatch.setitem(sys.modules, script.__name__, script)
    exec(compile(example, "docs/hooks.md", "exec"), script.__dict__)
    info = lplugins_manager.plugin("acme")
    assert info.status == "loaded"
    assert info.registered or info.contributes_callbacks or "lplugins_choose_precision" in example
    if info.contributes_callbacks:
        assert "AcmeAudit" in {type(cb).__name__ for cb in script.kwargs["callbacks"]}


def test_writing_a_plugin_before_packaging(
    lplugins_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/writing-a-plugin.md: the example package's hooks, registered by hand from a script, work."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "acme-lplugins" / "src"))
    text = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    block = next(b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S) if "get_manager()" in b)
    try:
        exec(compile(block, "docs/writing-a-plugin.md", "exec"), {"__name__": "docs_writing"})
        assert lplugins_manager.plugin("acme").registered["strategy"] == ["acme_ddp"]
    finally:
        for name in [m for m in sys.modules if m == "acme_lplugins" or m.startswith("acme_lplugins.")]:
            del sys.modules[name]


def test_concepts_example_registers_a_plugin(
    lplugins_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / "concepts.md").read_text()
    ns: dict[str, Any] = {"__name__": "docs_concepts"}
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S):
        exec(compile(block, "docs/concepts.md", "exec"), ns)
    assert lplugins_manager.plugin("my-plugin").registered == {"callback": ["lr_every_step"]}
    assert "LearningRateMonitor" in {type(cb).__name__ for cb in ns["kwargs"]["callbacks"]}


@pytest.mark.timeout(240)
def test_testing_a_plugin_example_passes(tmp_path: Path) -> None:
    """docs/testing-a-plugin.md's test file, run by pytest against the example package's source."""
    text = (ROOT / "docs" / "testing-a-plugin.md").read_text()
    block = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)[0]
    assert block.startswith("# tests/test_plugin.py\n")
    (tmp_path / "test_plugin.py").write_text(block)
    env = {**_env(), "PYTHONPATH": str(ROOT / "examples" / "acme-lplugins" / "src")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_plugin.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout


@pytest.mark.timeout(300)
def test_getting_started_first_trainer(lplugins_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tutorial's first composed Trainer trains as shown."""
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / "getting-started.md").read_text()
    block = text.split("## Your first composed Trainer")[1].split("```python\n")[1].split("```")[0]
    ns: dict[str, Any] = {"__name__": "docs_getting_started"}
    exec(compile(block, "docs/getting-started.md", "exec"), ns)
    assert glob.glob("ckpts/*.commit")
