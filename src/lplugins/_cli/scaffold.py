"""``lplugins new-plugin``: scaffold a plugin package (pyproject with the entry point, hooks, a test)."""

from __future__ import annotations

import argparse
import re
import textwrap
from pathlib import Path
from typing import Any

from lplugins._errors import LPluginsError

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")


def _files(dist: str, package: str, plugin: str) -> dict[str, str]:
    prefix = plugin.replace("-", "_")
    return {
        "pyproject.toml": f"""\
            [build-system]
            requires = ["hatchling>=1.21"]
            build-backend = "hatchling.build"

            [project]
            name = "{dist}"
            version = "0.1.0"
            description = "An lplugins plugin"
            requires-python = ">=3.10"
            dependencies = ["lplugins"]

            [project.optional-dependencies]
            test = ["pytest>=8"]

            [project.entry-points.lplugins]
            {plugin} = "{package}.plugin"

            [tool.hatch.build.targets.wheel]
            packages = ["src/{package}"]
            """,
        "README.md": f"""\
            # {dist}

            An lplugins plugin. Installing it registers, under the
            plugin name `{plugin}`:

            * the strategy `{prefix}_ddp` (DDP over gloo);
            * the callback `{prefix}_hello` (prints one line on global rank 0 when fit starts).

            It depends on `lplugins`, which is not on PyPI yet: install lplugins first (see its getting
            started page: from a clone, a git URL or a wheel), then this package finds it installed.

            ```bash
            pip install -e .
            lplugins list
            pytest
            ```
            """,
        f"src/{package}/__init__.py": f'"""{dist}: an lplugins plugin."""\n',
        f"src/{package}/plugin.py": f'''\
            """The hooks of the `{plugin}` plugin (entry point group `lplugins`)."""

            from __future__ import annotations

            from typing import Any

            import lplugins
            from lplugins.hookspecs import Register


            def _ddp(**kwargs: Any) -> Any:
                from lightning.pytorch.strategies import DDPStrategy  # import heavy modules only when used

                return DDPStrategy(**kwargs)


            def _hello(**kwargs: Any) -> Any:
                from {package}.callbacks import Hello

                return Hello(**kwargs)


            @lplugins.hookimpl
            def lplugins_register_strategies(register: Register) -> None:
                register(
                    "{prefix}_ddp", _ddp, description="DDP over gloo", defaults={{"process_group_backend": "gloo"}}
                )


            @lplugins.hookimpl
            def lplugins_register_callbacks(register: Register) -> None:
                register("{prefix}_hello", _hello, description="say hello once, on global rank 0")
            ''',
        f"src/{package}/callbacks.py": '''\
            """Callbacks of this plugin."""

            from __future__ import annotations

            from lightning.pytorch import Callback, LightningModule, Trainer


            class Hello(Callback):
                """Prints one line when fit starts, on global rank 0 only."""

                def __init__(self, message: str = "hello from a plugin") -> None:
                    self.message = message

                def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
                    if trainer.is_global_zero:
                        print(self.message)
            ''',
        "tests/test_plugin.py": f'''\
            """Tests that use the fixtures of `lplugins.testing` (a pytest plugin installed with lplugins)."""

            from __future__ import annotations

            from typing import Any

            import lplugins
            from lightning.pytorch.strategies import DDPStrategy

            import {package}.plugin


            def test_registers_its_names(lplugins_manager: Any, lplugins_register: Any) -> None:
                info = lplugins_register({package}.plugin, "{plugin}")
                assert info.registered == {{"strategy": ["{prefix}_ddp"], "callback": ["{prefix}_hello"]}}
                kwargs = lplugins.compose(strategy="{prefix}_ddp", callbacks=["{prefix}_hello"])
                assert isinstance(kwargs["strategy"], DDPStrategy)
                assert kwargs["strategy"].process_group_backend == "gloo"


            def test_discovered_through_its_entry_point(fake_entry_points: Any) -> None:
                fake_entry_points({{"{plugin}": "{package}.plugin"}}, distribution="{dist}", version="0.1.0")
                manager = lplugins.PluginManager().load()
                try:
                    assert manager.plugin("{plugin}").registered["strategy"] == ["{prefix}_ddp"]
                finally:
                    manager.close()
            ''',
    }


def scaffold(name: str, directory: str | Path | None = None) -> Path:
    """Create a plugin package called ``name`` (a distribution name such as ``acme-lplugins``).

    Args:
        name: The distribution name; the import package is the same with ``_``; the plugin (entry-point)
            name drops a trailing ``-lplugins``.
        directory: Where to create it (default: ``./<name>``); must not exist or be empty.

    Returns:
        The package directory.

    Raises:
        LPluginsError: an invalid name, or a non-empty target directory (nothing is overwritten).
    """
    if not _NAME.match(name):
        raise LPluginsError(
            f"Invalid plugin package name {name!r}: use lowercase letters, digits and single '-' or '_' "
            f"between them, starting with a letter (e.g. 'acme-lplugins')."
        )
    target = Path(directory) if directory is not None else Path(name)
    if target.exists() and any(target.iterdir()):
        raise LPluginsError(f"{target} exists and is not empty; choose another --dir (nothing was written).")
    package = name.replace("-", "_")
    plugin = re.sub(r"[-_]lplugins$", "", name) or name
    for rel, text in _files(name, package, plugin).items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return target


def add_parser(sub: Any) -> None:
    """Add the ``new-plugin`` subcommand."""
    p = sub.add_parser(
        "new-plugin",
        help="scaffold a plugin package",
        description="Create a plugin package: pyproject.toml with the `lplugins` entry point, a hooks module "
        "registering a strategy and a callback, and tests that use the lplugins.testing fixtures.",
    )
    p.add_argument("name", help="distribution name, e.g. acme-lplugins")
    p.add_argument("--dir", default=None, help="target directory (default: ./NAME)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    target = scaffold(args.name, args.dir)
    print(f"created {target}: pip install -e {target} && lplugins list && pytest {target}")
    return 0
