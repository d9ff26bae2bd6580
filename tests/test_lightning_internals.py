"""Guard rails for Lightning's private internals: every one lplugins uses is declared, still exists,
and is used from ``lplugins/_lightning.py`` only.

* Each entry of :data:`lplugins._lightning.PRIVATES` is resolved against the installed Lightning
  (and DeepSpeed); a missing one fails, naming the attribute, where it was looked for and the
  installed versions -- the signal that a Lightning release changed something lplugins relies on.
* The rest of ``src/lplugins`` is searched for private Lightning names: the declared ones, and any
  private attribute reached from a Lightning object or imported from a Lightning module.

CI runs this file on the oldest and the newest supported Lightning (``scripts/test-oldest.sh``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from lplugins._lightning import CHECKED_VERSIONS, PRIVATES, Private
from lplugins._lightning.registry import Kind


def _declare_all(package: str) -> None:
    """Import every area module of ``package`` (some are imported on first use): each declares its privates."""
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{info.name}")


_declare_all("lplugins._lightning")

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "lplugins"
INTERNALS = SRC / "_lightning"  # the package: every private access lives there

#: Top-level packages whose private names count as "Lightning internals" here.
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "deepspeed")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _installed() -> str:
    return ", ".join(f"{d} {_version(d)}" for d in ("lightning", "torch", "deepspeed"))


def _describe(entry: Private) -> str:
    why = f" (lplugins uses it for: {entry.why})" if entry.why else ""
    return f"{entry.kind} private {entry.name!r} of {entry.where!r}{why}"


def _missing(entry: Private, detail: str) -> str:
    return (
        f"{_describe(entry)} is missing with {_installed()}: {detail}. A release renamed or removed it: update "
        f"the function that uses it in src/lplugins/_lightning.py (and its _private() declaration), or narrow "
        f"the supported versions in pyproject.toml."
    )


def _resolve_dotted(entry: Private) -> Any:
    """Import ``entry.where``: the longest importable module prefix, then attributes for the rest."""
    parts = entry.where.split(".")
    try:
        importlib.import_module(parts[0])
    except ImportError:
        pytest.skip(f"{parts[0]} is not installed; cannot check {_describe(entry)}")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attr):
                pytest.fail(_missing(entry, f"{'.'.join(parts[:i])!r} has no attribute {attr!r}"), pytrace=False)
            obj = getattr(obj, attr)
        return obj
    raise AssertionError("unreachable: the top-level package was imported above")  # pragma: no cover


@pytest.fixture(scope="module")
def trainer() -> Any:
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        max_steps=1,
    )


@pytest.fixture(scope="module")
def pl_trainer() -> Any:
    """A ``pytorch_lightning.Trainer``: the twin's ``trainer`` entries are checked on it."""
    pl = pytest.importorskip("pytorch_lightning")
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        max_steps=1,
    )


def test_privates_are_declared() -> None:
    assert PRIVATES, "lplugins._lightning.PRIVATES is empty: every private Lightning name used must be declared"
    assert all(isinstance(p, Private) for p in PRIVATES)


def test_privates_are_declared_once_each() -> None:
    seen: dict[tuple[str, str], int] = {}
    for entry in PRIVATES:
        seen[(entry.where, entry.name)] = seen.get((entry.where, entry.name), 0) + 1
    twice = [f"{where}.{name} ({count}x)" for (where, name), count in seen.items() if count > 1]
    assert not twice, f"declared more than once in lplugins/_lightning.py: {twice}"


def test_privates_are_well_formed() -> None:
    bad = []
    for entry in PRIVATES:
        if entry.kind not in get_args(Kind):
            bad.append(f"{entry}: kind must be one of {get_args(Kind)}")
        private_name = entry.name.startswith("_") and not entry.name.startswith("__")
        # or a public name reached through Lightning's internals: a private class, a loop, a module's layout
        internal_path = any(part.startswith("_") for part in entry.where.split(".")) or (
            entry.why and (entry.where.startswith("trainer.fit_loop") or entry.where.count(".") >= 3)
        )
        if not (private_name or internal_path):
            bad.append(f"{entry}: name must be a private name (one leading underscore), or reached through internals")
        if entry.kind == "trainer" and entry.where.split(".")[0] != "trainer":
            bad.append(f"{entry}: a 'trainer' entry's where must start with 'trainer'")
        if not entry.why.strip():
            bad.append(f"{entry}: say why lplugins needs it (why=...)")
    assert not bad, "\n".join(bad)


def _twin_privates() -> list[Private]:
    """The ``pytorch_lightning`` twin's declarations (``lplugins._pl._lightning``: the same source with
    ``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` -> ``lightning_fabric``) that
    differ from the originals: those naming a standalone package, and every ``trainer`` entry (checked
    on a ``pytorch_lightning.Trainer``). Empty when ``pytorch_lightning`` is not installed."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return []
    _declare_all("lplugins._pl._lightning")
    twin = importlib.import_module("lplugins._pl._lightning")
    return [p for p in twin.PRIVATES if p.kind == "trainer" or p.where.split(".")[0] in TWIN_PACKAGES]


#: The packages the twins name instead of ``lightning.pytorch`` / ``lightning.fabric``.
TWIN_PACKAGES = ("pytorch_lightning", "lightning_fabric")
TWIN_PRIVATES = _twin_privates()
#: ``(namespace, entry)``: every declaration, for each namespace it is used with.
ALL_PRIVATES = [("lightning", p) for p in PRIVATES] + [("pytorch_lightning", p) for p in TWIN_PRIVATES]


def test_twin_declares_the_same_privates() -> None:
    """The twin's PRIVATES are the original's with the package names rewritten, entry for entry."""
    if not TWIN_PRIVATES:
        pytest.skip("pytorch_lightning is not installed")
    from tests._dist import load_script

    mirror = load_script("mirror_pl")
    twins, known = set(mirror.twinned()), set(mirror.modules())

    def rewrite(text: str) -> str:
        return mirror.rewrite(text, twins, known)

    twin = importlib.import_module("lplugins._pl._lightning")
    rewritten = [(rewrite(p.where), p.name, p.kind, rewrite(p.why)) for p in PRIVATES]
    assert [(p.where, p.name, p.kind, p.why) for p in twin.PRIVATES] == rewritten
    assert any(p.where.startswith("pytorch_lightning.") for p in TWIN_PRIVATES)
    assert any(p.where.startswith("lightning_fabric.") for p in TWIN_PRIVATES)


@pytest.mark.parametrize(
    ("namespace", "entry"), ALL_PRIVATES, ids=[f"{ns}-{p.kind}:{p.where}.{p.name}" for ns, p in ALL_PRIVATES]
)
def test_private_exists_in_the_installed_version(
    namespace: str, entry: Private, request: pytest.FixtureRequest
) -> None:
    if entry.kind == "trainer":
        obj: Any = request.getfixturevalue("trainer" if namespace == "lightning" else "pl_trainer")
        parts = entry.where.split(".")
        for i, attr in enumerate(parts[1:], start=1):
            if not hasattr(obj, attr):
                pytest.fail(_missing(entry, f"{'.'.join(parts[:i])!r} has no attribute {attr!r}"), pytrace=False)
            obj = getattr(obj, attr)
        if not hasattr(obj, entry.name):
            found = f"{entry.where!r} (a {type(obj).__qualname__}) has no attribute {entry.name!r}"
            pytest.fail(_missing(entry, found), pytrace=False)
    elif entry.kind == "class":
        obj = _resolve_dotted(entry)
        if not hasattr(obj, entry.name):
            pytest.fail(_missing(entry, f"{entry.where!r} has no attribute {entry.name!r}"), pytrace=False)
    elif entry.kind == "field":
        cls = _resolve_dotted(entry)
        if entry.name not in {f.name for f in dataclasses.fields(cls)}:
            pytest.fail(_missing(entry, f"{entry.where!r} has no field {entry.name!r}"), pytrace=False)
    elif entry.kind == "init":
        cls = _resolve_dotted(entry)
        source = inspect.getsource(cls.__init__)
        if not re.search(rf"(?<![\w]){re.escape(entry.name)}\b", source):
            pytest.fail(_missing(entry, f"{entry.where}.__init__ no longer mentions {entry.name!r}"), pytrace=False)
    else:  # pragma: no cover - test_privates_are_well_formed names it
        pytest.fail(f"unknown kind {entry.kind!r} for {entry}")


def _checked_range() -> tuple[Version, Version]:
    low, high = (Version(v.strip()) for v in re.split(r"\s+[-\u2013]\s+", CHECKED_VERSIONS))
    return low, high


def _lightning_requirement() -> Requirement:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^\s*"(lightning[<>=!~ ][^"]*)"', text, flags=re.M)
    assert match, "pyproject.toml: no lightning requirement found"
    return Requirement(match.group(1))


def test_installed_lightning_is_a_checked_version() -> None:
    low, high = _checked_range()
    installed = Version(_version("lightning"))
    assert low <= installed <= high, (
        f"lightning {installed} is installed but lplugins/_lightning.py was checked against {CHECKED_VERSIONS} only: "
        f"run tests/test_lightning_internals.py with it, then update CHECKED_VERSIONS and pyproject.toml"
    )


def test_pyproject_allows_only_checked_versions() -> None:
    """Both ends of the checked range are allowed; the next minor release after the newest is not."""
    low, high = _checked_range()
    spec = _lightning_requirement().specifier
    untested_next = Version(f"{high.major}.{high.minor + 1}.0")
    assert spec.contains(low) and spec.contains(high), f"pyproject.toml {spec} must allow {CHECKED_VERSIONS}"
    assert not spec.contains(untested_next), (
        f"pyproject.toml allows lightning {spec}, but only {CHECKED_VERSIONS} was checked: {untested_next} is untested"
    )


# ------------------------------------------------------------------------------------ the grep


def _sources() -> Iterator[Path]:
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] not in (INTERNALS.name, "_pl"):  # the twins: below
            yield path


def _declared_patterns() -> list[tuple[str, re.Pattern[str]]]:
    """For each declared name: as an attribute (``._name``), as a string (``"_name"``) or imported.
    (Defined as a method, an override, is found by :func:`_methods_named`.)"""
    patterns = []
    # a public name reached through internals (``setup_data`` of the fit loop, ``Trainer`` of its module) is
    # everywhere in ordinary code: its entry is checked for existence, not grepped
    for name in sorted({p.name for p in PRIVATES if p.name.startswith("_")}):
        n = re.escape(name)
        regex = rf"\.{n}\b|[\"']{n}[\"']|\bimport\b[^\n]*\b{n}\b"
        patterns.append((f"declared private {name!r}", re.compile(regex)))
    return patterns


#: Names that hold Lightning (or DeepSpeed) objects in lplugins' code, by convention.
_LIGHTNING_OBJECTS = (
    r"(?:\w+_)?strategy|(?:\w+_)?connector|\w*loop|module|pl_module|lightning_module|engine|"
    r"precision_plugin|accelerator|launcher|checkpoint_io|\w*optimi[sz]ation|cluster_environment"
)
_PKG = "|".join(LIGHTNING_PACKAGES)
_PRIVATE = r"_(?!_)\w+"  # one leading underscore: not a dunder such as __version__

_OBJECT = rf"(?:[\w.]*\b(?:trainer|{_LIGHTNING_OBJECTS})|(?:get|has)attr\([^()]*\))"


def _generic_patterns(aliases: frozenset[str] = frozenset()) -> list[tuple[str, re.Pattern[str]]]:
    """A private attribute reached from a Lightning object (or a local alias of one), named in a
    string next to one, poked into an object's ``__dict__``, or a private Lightning dotted name."""
    objects = "|".join([_LIGHTNING_OBJECTS, *sorted(map(re.escape, aliases))])
    return [
        ("private attribute of a trainer", re.compile(rf"\btrainer(?:\.\w+)*\.{_PRIVATE}")),
        ("private attribute of a Lightning object", re.compile(rf"\b(?:{objects})\.{_PRIVATE}")),
        (
            "private attribute of a Lightning object by name",
            re.compile(rf"\b(?:get|set|has|del)attr\(\s*(?:{_OBJECT}|(?:{objects}))\s*,\s*[\"']{_PRIVATE}"),
        ),
        (
            "private attribute named next to a Lightning object",
            re.compile(rf"\(\s*(?:{objects})\s*,\s*[\"']{_PRIVATE}"),
        ),
        ("private attribute set through __dict__", re.compile(rf"__dict__\[\s*[\"']{_PRIVATE}")),
        ("private Lightning module or name", re.compile(rf"\b(?:{_PKG})(?:\.\w+)*\.{_PRIVATE}")),
    ]


def _lightning_aliases(tree: ast.AST) -> frozenset[str]:
    """Local names bound to a Lightning object (``auto = epoch_loop.automatic_optimization``)."""
    aliases: set[str] = set()
    assignments = [
        (node.targets[0].id, ast.unparse(node.value))
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    ]
    while True:
        objects = "|".join(["trainer", _LIGHTNING_OBJECTS, *sorted(map(re.escape, aliases))])
        chain = re.compile(rf"(?:self\.)?\b(?:{objects})(?:\.\w+)*")
        found = {name for name, value in assignments if chain.fullmatch(value) and name != "self"}
        if found <= aliases:
            return frozenset(aliases)
        aliases |= found


def _private_imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``from lightning.x import _y``, ``from lightning._x import y``, ``import lightning._x``."""

    def private(part: str) -> bool:
        return part.startswith("_") and not part.startswith("__")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] in LIGHTNING_PACKAGES:
                names = [a.name for a in node.names if private(a.name)]
                if any(private(p) for p in parts) or names:
                    yield node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIGHTNING_PACKAGES and any(private(p) for p in parts):
                    yield node.lineno, f"import {alias.name}"


def _methods_named(tree: ast.AST, names: frozenset[str]) -> Iterator[tuple[int, str]]:
    """Methods (functions in a class body) named like a declared private: overrides. A module-level
    function of the same name overrides nothing and is left alone."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in names:
                    yield item.lineno, f"{node.name}.{item.name}"


def find_private_uses(
    path: Path,
    declared: list[tuple[str, re.Pattern[str]]] = [],  # noqa: B006
    methods: frozenset[str] = frozenset(),
) -> list[str]:
    """Every place in ``path`` that names a private Lightning attribute, as ``file:line: what: text``:
    the ``declared`` patterns, methods named as in ``methods``, the generic patterns, and private
    Lightning imports."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    hits = []
    aliases = _lightning_aliases(tree)
    for what, regex in declared + _generic_patterns(aliases):
        for match in regex.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            hits.append(f"{rel}:{line}: {what}: {match.group(0)!r}")
    for line, statement in _private_imports(tree):
        hits.append(f"{rel}:{line}: private Lightning import: {statement!r}")
    for line, method in _methods_named(tree, methods):
        hits.append(f"{rel}:{line}: method overriding a declared private: {method!r}")
    return sorted(set(hits), key=lambda h: (h.split(":")[0], int(h.split(":")[1])))


def _all_hits() -> list[str]:
    declared, methods = _declared_patterns(), frozenset(p.name for p in PRIVATES if p.name.startswith("_"))
    return [hit for path in _sources() for hit in find_private_uses(path, declared, methods)]


def _twin_sources() -> list[Path]:
    """The ``pytorch_lightning`` twins (``src/lplugins/_pl``, generated by ``scripts/mirror_pl.py``) but the
    internals module's own (its declarations are checked by ``test_twin_declares_the_same_privates``)."""
    return sorted(p for p in (SRC / "_pl").rglob("*.py") if p.relative_to(SRC / "_pl").parts[0] != INTERNALS.name)


def test_no_private_lightning_name_in_the_twins() -> None:
    """The rewrite for ``pytorch_lightning`` adds no private access the original does not declare."""
    declared, methods = _declared_patterns(), frozenset(p.name for p in PRIVATES if p.name.startswith("_"))
    twins = _twin_sources()
    assert any(t.name == "checkpoint.py" for t in twins)
    for twin in twins:
        assert "lightning.pytorch" not in twin.read_text(), twin
    hits = [hit for twin in twins for hit in find_private_uses(twin, declared, methods)]
    assert not hits, "the pytorch_lightning twins name private Lightning attributes:\n  " + "\n  ".join(hits)


def test_no_private_lightning_name_outside_the_internals_module() -> None:
    hits = _all_hits()
    assert not hits, (
        f"{len(hits)} place(s) outside src/lplugins/_lightning.py name a private Lightning attribute. Move each "
        f"access into a function in _lightning.py (declared with _private()) and call that instead:\n  "
        + "\n  ".join(hits)
    )


def test_the_grep_finds_what_it_should(tmp_path: Path) -> None:
    """The patterns catch the usual shapes of a private access and leave lplugins' own privates alone."""
    sample = tmp_path / "sample.py"
    bad = {
        "trainer._checkpoint_connector.dump_checkpoint()": "trainer",
        "trainer.fit_loop.epoch_loop._batches_that_stepped": "trainer",
        "self.trainer.strategy._lightning_module": "trainer",
        "epoch_loop._num_ready_batches_reached()": "Lightning object",
        "engine._is_gradient_accumulation_boundary = None": "Lightning object",
        "module._trainer": "Lightning object",
        "getattr(trainer, '_ckpt_path')": "trainer",
        "getattr(self.strategy, '_x', None)": "by name",
        "sys.modules['lightning.pytorch.trainer.connectors.callback_connector._CallbackConnector']": "name",
        "from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector": "import",
        "from lightning.fabric.utilities.rank_zero import _get_rank": "import",
        "import lightning.pytorch._graveyard": "import",
        "auto = epoch_loop.automatic_optimization\nauto._skip_backward": "Lightning object",
        "loop = trainer.fit_loop\nx = loop\nx._restarting": "Lightning object",
        "for obj, name in ((epoch_loop, '_accumulated_batches_reached'),): pass": "next to",
        "auto.__dict__['_make_zero_grad_fn'] = f": "__dict__",
        "getattr(getattr(trainer, 'x', None), '_progress_bar_metrics', None)": "by name",
    }
    for code, what in bad.items():
        sample.write_text(code + "\n")
        sample_hits = find_private_uses(sample)
        assert sample_hits and what in " ".join(sample_hits), f"not caught: {code}"
    good = [
        "self._pending = {}",
        "self._trainer_ref = None",
        "lightning.__version__",
        "from lplugins._errors import LPluginsError",
        "from lightning.pytorch import Trainer",
        "sys._getframe(2)",
        "trainer.strategy.barrier()",
        "importlib.import_module(name)",
        "name = self.name\nname._private",
        "getattr(fn, '_lplugins_resolving', False)",
    ]
    for code in good:
        sample.write_text(code + "\n")
        assert find_private_uses(sample) == [], f"false positive: {code}"


def test_every_declared_name_is_caught_by_the_grep(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    patterns, methods = _declared_patterns(), frozenset(p.name for p in PRIVATES if p.name.startswith("_"))
    for entry in (p for p in PRIVATES if p.name.startswith("_")):
        for code in (f"x.{entry.name}", f"getattr(x, {entry.name!r})", f"class C:\n    def {entry.name}(self): ..."):
            sample.write_text(code + "\n")
            assert find_private_uses(sample, patterns, methods), f"not caught: {code}"
        sample.write_text(f"def {entry.name}(trainer): ...\n")  # a module-level helper overrides nothing
        assert not find_private_uses(sample, patterns, methods), f"false positive: def {entry.name}"


def _lplugins_classes() -> Iterator[type]:
    """Every class lplugins defines, and (with ``pytorch_lightning`` installed) every twin class."""
    import lplugins
    from lplugins._lightning import namespace as _namespace

    twins = importlib.util.find_spec("pytorch_lightning") is not None
    for info in pkgutil.walk_packages(lplugins.__path__, "lplugins."):
        if info.name.startswith(("lplugins._lightning", "lplugins._pl")):
            continue
        names = [info.name]
        if twins and _namespace.has_twin(info.name):
            names.append(_namespace.twin_name(info.name, _namespace.PYTORCH_LIGHTNING))
        for name in names:
            module = importlib.import_module(name)
            for obj in vars(module).values():
                if isinstance(obj, type) and obj.__module__ == name:
                    yield obj


def test_no_lplugins_class_overrides_a_private_lightning_method() -> None:
    """A subclass defining ``_name`` that a Lightning base class defines overrides a private (e.g.
    ``LightningCLI._instantiate_trainer``): that belongs in ``_lightning.py`` too."""
    hits = []
    for cls in _lplugins_classes():
        for name, value in vars(cls).items():
            if not name.startswith("_") or name.startswith("__"):
                continue
            if not (inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod))):
                continue  # data such as ABCMeta's _abc_impl: not code lplugins wrote
            for base in cls.__mro__[1:]:
                if base.__module__.split(".")[0] in LIGHTNING_PACKAGES and name in vars(base):
                    hits.append(
                        f"{cls.__module__}.{cls.__qualname__}.{name} overrides {base.__module__}.{base.__qualname__}"
                    )
                    break
    assert not hits, "lplugins classes override private Lightning methods:\n  " + "\n  ".join(hits)
