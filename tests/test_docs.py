"""Documentation stays true: every hook documented with its signature; the public API is exact."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import lplugins
from lplugins import hookspecs

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _hook_signatures() -> dict[str, str]:
    specs = {}
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if name.startswith("lplugins_"):
            params = ", ".join(inspect.signature(fn).parameters)
            specs[name] = f"{name}({params})"
    return specs


def test_every_hook_has_a_section_with_its_signature() -> None:
    text = (DOCS / "hooks.md").read_text()
    headings = re.findall(r"^## (lplugins_\w+\(.*\))$", text, flags=re.M)
    specs = _hook_signatures()
    assert sorted(headings) == sorted(specs.values()), "docs/hooks.md headings must match lplugins.hookspecs"
    for name in specs:
        section = text.split(f"## {name}(")[1].split("\n## ")[0]
        assert f"def {name}(" in section, f"{name}: the section needs an example implementation"


def test_every_hookspec_has_an_example_docstring() -> None:
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if name.startswith("lplugins_"):
            assert fn.__doc__ and "Example::" in fn.__doc__, name


def test_public_api_is_exactly_all() -> None:
    public = {n for n in vars(lplugins) if not n.startswith("_") and not inspect.ismodule(getattr(lplugins, n))}
    public -= {"annotations"}
    assert public | {"__version__"} == set(lplugins.__all__)
    for name in lplugins.__all__:
        assert getattr(lplugins, name) is not None


def test_import_is_light() -> None:
    code = (
        "import sys, lplugins; heavy = [m for m in ('lightning', 'torch', 'deepspeed') if m in sys.modules]; "
        "print(heavy); lplugins.load(); print('deepspeed' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]", f"import lplugins imported {out[0]}"
    assert out[1] == "False", "loading the built-in plugins imported deepspeed"


def test_readme_quickstart_composes(lplugins_manager: object, tmp_path: Path, monkeypatch: object) -> None:
    """The README's quickstart builds real Trainers (``fit`` itself is exercised by the component tests)."""
    import pytest
    from lightning.pytorch import Trainer

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    monkeypatch.chdir(tmp_path)
    text = (DOCS.parent / "README.md").read_text()
    block = text.split("## Quickstart")[1].split("```python")[1].split("```")[0]
    fits: list[object] = []
    block = block.replace('trainer.fit(model, ckpt_path="latest")', "fits.append(trainer)")
    existing = Trainer(accelerator="cpu", logger=False)
    namespace = {"fits": fits, "existing_trainer": existing}
    exec(compile(block, "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert fits == [trainer]
    assert type(trainer.strategy).__name__ == "DeepSpeedStrategy"
    names = {type(cb).__name__ for cb in existing.callbacks}
    assert {"DurableCheckpoint", "MetricsCallback"} <= names
