"""The ``lplugins`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lplugins._plugins.manager import PluginManager, load


def _format_plugins(manager: PluginManager) -> str:
    lines: list[str] = []
    for info in manager.plugins():
        origin = "built-in" if info.builtin else "external"
        dist = f"{info.distribution} {info.version}" if info.distribution else "(in-process)"
        lines.append(f"{info.name}  [{info.status}]  {origin}, {dist}")
        if info.entry_point:
            lines.append(f"    entry point: {info.entry_point}")
        for kind, names in info.registered.items():
            if not names:
                continue
            lines.append(f"    {kind}:")
            registry = manager.registry(kind)
            for name in names:
                desc = registry.get(name).description if name in registry else ""
                served = _served(manager, kind, name)
                lines.append(f"      {name}" + (f" - {desc}" if desc else "") + (f"  [{served}]" if served else ""))
        if info.contributes_callbacks:
            lines.append("    contributes callbacks to every composed Trainer")
        if info.error:
            lines.append(f"    error: {info.error}")
    return "\n".join(lines)


def _namespaces(manager: PluginManager, kind: str, name: str) -> list[str] | None:
    """The Lightning namespaces ``name`` serves; ``None``: a plugin's function, checked when it builds."""
    from lplugins._lightning.namespace import served_by

    registry = manager.registry(kind)
    served = served_by(registry.get(name).factory) if name in registry else None
    return None if served is None else list(served)


def _served(manager: PluginManager, kind: str, name: str) -> str:
    """Which Lightning namespaces ``name`` serves, as ``lplugins list`` prints it."""
    served = _namespaces(manager, kind, name)
    return "namespace checked when built" if served is None else ", ".join(served)


def _cmd_list(args: argparse.Namespace) -> int:
    manager = load(strict=not args.lenient)
    if args.json:
        plugins = []
        for info in manager.plugins():
            entry = info.as_dict()
            entry["namespaces"] = {
                name: _namespaces(manager, kind, name) for kind, names in info.registered.items() for name in names
            }
            plugins.append(entry)
        print(json.dumps({"plugins": plugins}, indent=2))
    else:
        print(_format_plugins(manager))
    return 0


def _version() -> str:
    """The installed distribution's version (the package's own when run from a source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lplugins")
    except PackageNotFoundError:  # pragma: no cover - a source tree on sys.path without an install
        import lplugins

        return lplugins.__version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lplugins`` command."""
    parser = argparse.ArgumentParser(prog="lplugins", description="pytest-style plugins for PyTorch Lightning.")
    parser.add_argument("--version", action="version", version=f"lplugins {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_list = sub.add_parser(
        "list",
        help="list plugins and what they registered",
        description="List every plugin (built-in and installed): its distribution and version, what it "
        "registered, and whether it is blocked or failed. Honours LPLUGINS_DISABLE_AUTOLOAD, "
        "LPLUGINS_PLUGINS and LPLUGINS_DISABLE.",
    )
    p_list.add_argument("--json", action="store_true", help="print JSON")
    p_list.add_argument(
        "--lenient", action="store_true", help="report failing plugins instead of stopping at the first"
    )
    p_list.set_defaults(func=_cmd_list)

    from lplugins._cli.demo import add_parser as add_demo
    from lplugins._cli.export import add_parser as add_checkpoint
    from lplugins._cli.ft import add_parser as add_ft
    from lplugins._cli.scaffold import add_parser as add_scaffold
    from lplugins.strategies.advisor import register_cli as add_advise

    add_demo(sub)
    add_scaffold(sub)
    add_advise(sub)
    add_checkpoint(sub)
    add_ft(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lplugins`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `lplugins`: what it can do, like `git` or `pip`
        parser.print_help()
        return 0
    try:
        return int(args.func(args))
    except Exception as exc:  # a clean message for the CLI; the traceback is for Python callers
        from lplugins._errors import LPluginsError

        if isinstance(exc, LPluginsError):
            print(f"lplugins: error: {exc}", file=sys.stderr)
            return 2
        raise
