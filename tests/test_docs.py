"""Documentation stays true: every hook documented with its signature; the public API is exact; the
architecture page names every module, and the imports follow its arrows; the strict docs build has no
warning; docs/cli.md lists the keys ``lplugins list --json`` prints."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_readme_quickstart_composes(lplugins_manager: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's quickstart builds real Trainers (``fit`` itself is exercised by the component tests),
    run from a temporary directory so that whatever it would write lands there, not in the repository."""
    from lightning.pytorch import Trainer

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
    # relative paths (dirpath="ckpts", the Trainers' default_root_dir) resolve inside tmp_path
    durable = [cb for cb in trainer.callbacks if type(cb).__name__ == "DurableCheckpoint"]
    assert [os.path.abspath(cb.dirpath) for cb in durable] == [str(tmp_path / "ckpts")]
    assert trainer.default_root_dir == existing.default_root_dir == str(tmp_path)


# ------------------------------------------------------------------------ docs/architecture.md
SRC = DOCS.parent / "src" / "lplugins"
COMPONENTS = ("callbacks", "accumulation", "precision", "strategies", "metrics")
FOUNDATION = ("_lightning", "_validate", "_errors", "_log", "_env", "_coord", "rankzero", "_bounds")
MACHINERY = ("_plugins", "hookspecs")


def _module_map() -> set[str]:
    """The files the architecture page's module map names (a package's line is its ``__init__.py``)."""
    block = (DOCS / "architecture.md").read_text().split("## Module map")[1].split("```")[1]
    lines = [line for line in block.splitlines()[1:] if line.strip()]
    assert lines[0] == "src/lplugins/", "the module map starts at src/lplugins/"
    paths, stack = set(), []
    for line in lines[1:]:
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        name = line.split()[0]
        stack[depth:] = [name.rstrip("/")]
        if name.endswith("/"):
            paths.add("/".join([*stack, "__init__.py"]))
        else:
            paths.add("/".join(stack))
    return paths


def _own_sources() -> list[Path]:
    """lplugins' modules but the generated ``pytorch_lightning`` twins (``_pl/``: their sources stand for them)."""
    return sorted(
        p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] != "_pl" or p == SRC / "_pl" / "__init__.py"
    )


def test_architecture_module_map_matches_the_tree() -> None:
    on_disk = {
        p.relative_to(SRC).as_posix() for p in _own_sources() if p.parent.name != "_pl" or p.parent == SRC / "_pl"
    }
    in_map = _module_map()
    assert not on_disk - in_map, f"docs/architecture.md: add to the module map: {sorted(on_disk - in_map)}"
    assert not in_map - on_disk, f"docs/architecture.md: no longer exist: {sorted(in_map - on_disk)}"


def _imports(path: Path) -> list[tuple[str, bool]]:
    """The lplugins modules ``path`` imports, each with whether the import is at module level."""
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inner = {id(node) for f in functions for node in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "lplugins":
                names = [f"lplugins.{a.name}" for a in node.names]
            else:
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("lplugins.") or name == "lplugins":
                found.append((name, id(node) not in inner))
    return found


def _area(module: str) -> str:
    """``lplugins.callbacks._writer`` -> ``callbacks``; ``lplugins._plugins.manager`` -> ``_manager``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lplugins"


def test_import_arrows_point_down() -> None:
    """The rules of docs/architecture.md ("The arrows"), checked on every module's imports."""
    wrong = []
    for path in _own_sources():
        rel = path.relative_to(SRC).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
        area = rel.split(".")[0]
        for target, module_level in _imports(path):
            to = _area(target)
            if area in COMPONENTS and to not in (area, *FOUNDATION):
                wrong.append(f"{rel} (a component) imports {target}")
            if area in FOUNDATION and to not in FOUNDATION:
                wrong.append(f"{rel} (the foundation) imports {target}")
            if area == "hookspecs":
                wrong.append(f"hookspecs imports {target}: the contract imports nothing from lplugins")
            if area in MACHINERY and to in (*COMPONENTS, "_builtins", "_composition", "lplugins"):
                wrong.append(f"{rel} (the manager/registry) imports {target}")
            if area == "_builtins" and module_level and to not in ("hookspecs", *FOUNDATION):
                wrong.append(f"{rel} (a built-in) imports {target} at module level: import it inside the factory")
    assert not wrong, "imports against the arrows of docs/architecture.md:\n  " + "\n  ".join(wrong)


def _module_graph() -> dict[str, set[str]]:
    """lplugins module -> the lplugins modules it imports (anywhere in it, ``TYPE_CHECKING`` included)."""
    files = {
        "lplugins." + p.relative_to(SRC).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__"): p
        for p in _own_sources()
        if p.relative_to(SRC).parts[0] != "_pl"
    }
    files["lplugins"] = files.pop("lplugins.__init__", SRC / "__init__.py")
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [f"{node.module}.{a.name}" for a in node.names]
                targets |= {c for c in candidates if c in files} or ({node.module} & set(files))
                targets |= {node.module} & set(files) if any(c not in files for c in candidates) else set()
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names} & set(files)
        graph[name] = targets - {name}
    return graph


#: The layers of docs/architecture.md, bottom first: a module imports only from its own layer and below.
LAYERS = (
    ("_errors", "_validate", "_env", "_bounds"),
    ("_lightning",),
    ("rankzero", "_log"),
    ("_coord",),
    COMPONENTS,
    ("hookspecs",),
    ("_plugins",),
    ("_composition",),
    ("ray", "lightning_cli", "testing", "_fork"),
    ("lplugins", "__main__", "cli", "_cli", "_builtins"),
)


def test_no_import_points_up_a_layer() -> None:
    """Every import (function-level and ``TYPE_CHECKING`` ones included) points to the same layer or below."""
    level = {area: i for i, areas in enumerate(LAYERS) for area in areas}
    graph = _module_graph()
    areas = {_area(m) for m in graph}
    assert not areas - set(level), f"docs/architecture.md: give these a layer: {sorted(areas - set(level))}"
    up = [
        f"{source} ({_area(source)}, layer {level[_area(source)]}) imports {target} (layer {level[_area(target)]})"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if level[_area(target)] > level[_area(source)]
    ]
    assert not up, "imports pointing up a layer:\n  " + "\n  ".join(up)


def test_no_import_circles() -> None:
    """No two lplugins modules import each other, directly or through others (function-level and
    ``TYPE_CHECKING`` imports count: a circle is a design knot even when Python tolerates it)."""
    graph = _module_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in circles)


#: Each API reference page and the module it documents (mkdocs.yml's "API reference").
REFERENCE = {
    "lplugins": "lplugins",
    "hookspecs": "lplugins.hookspecs",
    "callbacks": "lplugins.callbacks",
    "strategies": "lplugins.strategies",
    "accumulation": "lplugins.accumulation",
    "precision": "lplugins.precision",
    "metrics": "lplugins.metrics",
    "rankzero": "lplugins.rankzero",
    "testing": "lplugins.testing",
    "lightning_cli": "lplugins.lightning_cli",
    "ray": "lplugins.ray",
}


def _public_names(module_name: str) -> list[str]:
    import importlib

    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    # no __all__: the module's own public functions and classes (hookspecs' hooks, testing's fixtures)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and getattr(obj, "__module__", None) == module_name
    ]


# ------------------------------------------------------------------------ the strict docs build
@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """``mkdocs build --strict`` once for this module: the site directory, the exit status, the log.

    Not ``--quiet``: it drops mkdocs' warnings before strict mode counts them, so the build cannot fail.
    """
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life banner
    mkdocs = Path(sys.executable).with_name("mkdocs")
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(site)],
        cwd=DOCS.parent, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    return site, result.returncode, result.stdout + result.stderr


@pytest.mark.slow
def test_docs_build_has_no_warnings(built_site: tuple[Path, int, str]) -> None:
    """Every warning of the strict build (griffe on docstrings, autorefs, links and anchors) fails it."""
    _, returncode, log = built_site
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "mkdocs build --strict:\n  " + "\n  ".join(warnings)
    assert returncode == 0, log


@pytest.mark.slow
def test_doctests_render_as_code(built_site: tuple[Path, int, str]) -> None:
    """A ``>>>`` example outside an ``Examples:`` section is Markdown to mkdocstrings: three nested quotes."""
    site, _, _ = built_site
    nested = re.compile(r"(<blockquote>\s*){3}")
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if nested.search(p.read_text()))
    assert not pages, f"doctests rendered as block quotes (put them under 'Examples:'): {pages}"


@pytest.mark.slow
def test_api_reference_documents_every_public_name(built_site: tuple[Path, int, str]) -> None:
    """The strict docs build renders every name of every public module's ``__all__`` in its reference page."""
    site, returncode, _ = built_site
    pages = {p.stem for p in (DOCS / "reference").glob("*.md")}
    assert pages == set(REFERENCE), "docs/reference/ and REFERENCE must list the same modules"
    assert returncode == 0, "the docs build failed: see test_docs_build_has_no_warnings"
    missing = []
    for page, module_name in REFERENCE.items():
        html = (site / "reference" / page / "index.html").read_text()
        anchors = set(re.findall(r'id="([^"]+)"', html))
        missing += [f"{module_name}.{n}" for n in _public_names(module_name) if f"{module_name}.{n}" not in anchors]
    assert not missing, f"not in the API reference (give each a docstring): {missing}"


# ------------------------------------------------------------------------ docs/cli.md
def _documented_list_json() -> tuple[set[str], set[str]]:
    """docs/cli.md's ``lplugins list --json`` section: the top-level keys, and the keys of a plugin."""
    section = (DOCS / "cli.md").read_text().split("## `lplugins list --json`\n")[1].split("\n## ")[0]
    intro, table = section.split("\n|", 1)
    return set(re.findall(r'"(\w+)":', intro)), set(re.findall(r"^\| `(\w+)` \|", "|" + table, flags=re.M))


def test_cli_md_documents_the_keys_list_json_prints(
    lplugins_manager: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """The keys docs/cli.md lists for ``lplugins list --json`` are exactly those the command prints."""
    from lplugins.cli import main

    assert main(["list", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    top, keys = _documented_list_json()
    assert top == set(printed), f"docs/cli.md: `lplugins list --json` prints {sorted(printed)}, documented {top}"
    assert printed["plugins"], "lplugins list --json listed no plugins"
    for plugin in printed["plugins"]:
        assert set(plugin) == keys, (
            f"docs/cli.md, `lplugins list --json`, plugin {plugin['name']!r}: "
            f"printed but not documented: {sorted(set(plugin) - keys)}; "
            f"documented but not printed: {sorted(keys - set(plugin))}"
        )
