"""Checking a named component's parameters against its factory's signature, before it is built.

``{"name": "durable_checkpoint", "every_n_step": 10}`` must fail when the Trainer is composed,
with the parameter named and the close match suggested, not with a raw ``TypeError`` (or, worse,
after the processes have started, when a strategy hands its keyword arguments on to torch).

What a factory accepts is read from its signature, following ``**kwargs`` where they go:

* a class: its ``__init__``, then, while an ``__init__`` takes ``**kwargs`` and hands them to
  ``super().__init__(**kwargs)``, the next ``__init__`` up the MRO (an ``__init__`` that keeps its
  ``**kwargs`` makes the class open);
* where Lightning hands a strategy's ``**kwargs`` to torch (``DDPStrategy`` to
  ``DistributedDataParallel``, ``FSDPStrategy`` to ``FullyShardedDataParallel``): that signature,
  less the arguments Lightning passes itself (:data:`FORWARDED`);
* a function with ``**kwargs``: the callable named by its ``lplugins_forwards_to`` attribute
  (``"module:attr"``, resolved when checked, so the factory stays lazy) or its ``__wrapped__``;
  otherwise, read from its source, the one callable it calls with ``**kwargs`` (``from m import
  C`` ... ``return C(**kwargs)``, the lazy-factory pattern of the built-ins and of
  ``docs/writing-a-plugin.md``).

Where none of that says where ``**kwargs`` go, unknown names cannot be refused (the factory is
"open") and only the required parameters are checked.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lplugins._errors import ParameterError
from lplugins._validate import did_you_mean

__all__ = ["FORWARDED", "Accepted", "accepted", "check_call"]

#: Classes whose ``**kwargs`` Lightning hands to another callable: ``"module.Class"`` ->
#: (``"module:callable"``, the parameters Lightning passes itself).
FORWARDED: Mapping[str, tuple[str, frozenset[str]]] = {
    "lightning.pytorch.strategies.ddp.DDPStrategy": (
        "torch.nn.parallel:DistributedDataParallel",
        frozenset({"module", "device_ids"}),
    ),
    "lightning.pytorch.strategies.fsdp.FSDPStrategy": (
        "torch.distributed.fsdp:FullyShardedDataParallel",
        frozenset({"module", "process_group", "cpu_offload", "mixed_precision", "sharding_strategy", "device_id"}),
    ),
}
# the same classes of the standalone ``pytorch_lightning`` (a separate class hierarchy, same source)
FORWARDED = {
    **FORWARDED,
    **{"pytorch_lightning." + k[len("lightning.pytorch.") :]: v for k, v in FORWARDED.items()},
}

#: Attribute a function factory sets to say where its ``**kwargs`` go (``"module:attr"`` or a callable).
FORWARDS_TO = "lplugins_forwards_to"

_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@dataclass
class Accepted:
    """What a factory accepts by keyword.

    Attributes:
        owner: What to call it in messages (the class that ends up taking the parameters).
        groups: ``(label, names)``: the parameters by where they go (``label`` is ``""`` for the
            owner's own, else the callable they are handed to).
        required: Parameters without a default that the factory needs.
        open: ``True`` when some ``**kwargs`` go where lplugins cannot see: unknown names are let through.
    """

    owner: str
    groups: list[tuple[str, list[str]]] = field(default_factory=list)
    required: list[str] = field(default_factory=list)
    open: bool = False

    @property
    def names(self) -> set[str]:
        """Every parameter name accepted."""
        return {name for _, names in self.groups for name in names}

    def describe(self, hidden: frozenset[str] = frozenset()) -> str:
        """``"Parameters: a, b; passed on to X: c, d."``, leaving out ``hidden`` names."""
        parts = []
        for label, names in self.groups:
            shown = [n for n in names if n not in hidden]
            if not shown:
                continue
            text = ", ".join(shown)
            parts.append(f"Parameters: {text}" if not label else f"passed on to {label}: {text}")
        return ("; ".join(parts) + ".") if parts else "It takes no parameters."


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def _params(fn: Any) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _add(acc: Accepted, label: str, params: list[inspect.Parameter], skip: frozenset[str] = frozenset()) -> None:
    names = [p.name for p in params if p.kind in _KINDS and p.name not in skip and p.name not in acc.names]
    if names:
        acc.groups.append((label, names))


def _accepted_class(cls: type, acc: Accepted) -> None:
    first = True
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        if klass is object:
            return  # **kwargs that reach object.__init__ are refused by Python too
        params = _params(vars(klass)["__init__"])
        if params is None:
            acc.open = True
            return
        params = params[1:]  # self
        _add(acc, "", params)
        if first:
            acc.required = [p.name for p in params if p.kind in _KINDS and p.default is inspect.Parameter.empty]
            first = False
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return
        forwarded = FORWARDED.get(_qualified(klass))
        if forwarded is not None:
            target, skip = forwarded
            try:
                callee = _resolve(target)
            except (ImportError, AttributeError):
                acc.open = True
                return
            inner = _params(callee)
            if inner is None:
                acc.open = True
                return
            label = getattr(callee, "__name__", target)
            _add(acc, label, inner[1:] if isinstance(callee, type) else inner, skip)
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inner):
                acc.open = True
            return
        if not _passes_to_super(vars(klass)["__init__"]):
            acc.open = True  # it keeps its **kwargs, or hands them where this cannot follow
            return
    acc.open = True  # pragma: no cover - every MRO ends in object


def _forward_target(fn: Any) -> Any:
    """Where a function's ``**kwargs`` go: its declaration, or the one callable its source calls with them."""
    declared = getattr(fn, FORWARDS_TO, None)
    if isinstance(declared, str):
        module, _, attr = declared.partition(":")
        return _resolve(f"{_for_namespace(module, fn)}:{attr}")
    if declared is not None:
        return declared
    return _callee_from_source(fn)


def _callee_from_source(fn: Any) -> Any:
    found = _kwargs_calls(fn)
    if found is None or len(found[0]) != 1:
        return None
    try:
        return _evaluate(found[0][0], fn, found[1])
    except Exception:  # anything unresolvable: the factory stays open
        return None


def _passes_to_super(init: Any) -> bool:
    """Whether an ``__init__`` hands its ``**kwargs`` to ``super().__init__`` (and nowhere else).

    Without source (a compiled class) the cooperative pattern is assumed; an ``__init__`` that keeps
    its ``**kwargs`` or hands them elsewhere makes the class open.
    """
    found = _kwargs_calls(init)
    if found is None:
        return True
    callees = found[0]
    return bool(callees) and all(isinstance(c, ast.Attribute) and c.attr == "__init__" for c in callees)


def _kwargs_calls(
    fn: Any,
) -> tuple[list[ast.expr], dict[str, tuple[str, str | None, int]]] | None:
    """The callees ``fn``'s body calls with its ``**kwargs``, and the names it imports; ``None`` without source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    func = tree.body[0] if tree.body else None
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or func.args.kwarg is None:
        return None
    kwarg = func.args.kwarg.arg
    imports: dict[str, tuple[str, str | None, int]] = {}
    callees: list[ast.expr] = []
    for node in _walk_body(func):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                imports[alias.asname or alias.name] = (node.module or "", alias.name, node.level)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imports[alias.asname or alias.name.split(".")[0]] = (alias.name, None, 0)
        elif isinstance(node, ast.Call) and any(
            k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kwarg for k in node.keywords
        ):
            callees.append(node.func)
    return callees, imports


def _walk_body(func: ast.AST) -> list[ast.AST]:
    """The nodes of a function's body, not descending into nested functions or classes."""
    out: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def _evaluate(expr: ast.expr, fn: Any, imports: Mapping[str, tuple[str, str | None, int]]) -> Any:
    if isinstance(expr, ast.Attribute):
        return getattr(_evaluate(expr.value, fn, imports), expr.attr)
    if not isinstance(expr, ast.Name):
        raise LookupError("not a name")
    name = expr.id
    if name in imports:
        module, attr, level = imports[name]
        if level:
            package = (getattr(fn, "__module__", "") or "").rsplit(".", level)[0]
            module = f"{package}.{module}" if module else package
        mod = importlib.import_module(_for_namespace(module, fn))
        return getattr(mod, attr) if attr else mod
    closure = inspect.getclosurevars(fn)
    for scope in (closure.nonlocals, closure.globals, vars(builtins)):
        if name in scope:
            return scope[name]
    raise LookupError(name)


def _for_namespace(module: str, fn: Any) -> str:
    """``module`` as a built-in's factory imports it for the namespace being built: a twinned
    lplugins module becomes its ``pytorch_lightning`` twin (``scripts/mirror_pl.py``), so a check
    never imports the other namespace."""
    from lplugins._lightning import namespace as _namespace

    owner = getattr(fn, "__module__", "") or ""
    if not owner.startswith("lplugins."):
        return module  # a third party's factory imports what it names
    namespace = _namespace.of_module(owner)
    if namespace == _namespace.LIGHTNING:
        namespace = _namespace.current()
    if namespace == _namespace.LIGHTNING:
        return module
    parts = module.split(".")
    if parts[0] == "lplugins" and _namespace.has_twin(module):
        return _namespace.twin_name(module, namespace)
    if parts[0] == "lightning" and len(parts) > 1 and parts[1] in ("pytorch", "fabric"):
        trainer_pkg, fabric_pkg = _namespace.NAMESPACES[namespace]
        return ".".join([trainer_pkg if parts[1] == "pytorch" else fabric_pkg, *parts[2:]])
    return module


def _accepted(factory: Any, depth: int = 0) -> Accepted:
    if isinstance(factory, type):
        acc = Accepted(owner=factory.__name__)
        _accepted_class(factory, acc)
        return acc
    owner = getattr(factory, "__name__", type(factory).__name__)
    params = _params(factory)
    if params is None:
        return Accepted(owner=owner, open=True)
    acc = Accepted(owner=owner)
    _add(acc, "", params)
    acc.required = [p.name for p in params if p.kind in _KINDS and p.default is inspect.Parameter.empty]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return acc
    try:
        target = _forward_target(factory) if depth < 5 else None
    except (ImportError, AttributeError):
        target = None
    if target is None or target is factory:
        acc.open = True
        return acc
    inner = _accepted(target, depth + 1)
    own = acc.names
    merged = Accepted(owner=inner.owner, open=inner.open)
    merged.groups = [(label, names) for label, names in acc.groups] if own else []
    for label, names in inner.groups:
        names = [n for n in names if n not in own]
        if names:
            if merged.groups and not label and not merged.groups[0][0]:
                merged.groups[0] = ("", merged.groups[0][1] + names)
            else:
                merged.groups.append((label, names))
    merged.required = list(dict.fromkeys(acc.required + [n for n in inner.required if n not in own]))
    return merged


_CACHE: dict[tuple[Any, Any, str], Accepted] = {}


def accepted(factory: Callable[..., Any]) -> Accepted:
    """What ``factory`` accepts by keyword, following ``**kwargs`` (see the module's docstring)."""
    from lplugins._lightning.namespace import current

    key = (factory, getattr(factory, FORWARDS_TO, None), current())
    try:
        return _CACHE[key]
    except (KeyError, TypeError):
        pass
    acc = _accepted(factory)
    try:
        _CACHE[key] = acc
    except TypeError:  # an unhashable callable
        pass
    return acc


def check_call(
    kind: str,
    name: str,
    factory: Callable[..., Any],
    defaults: Mapping[str, Any],
    overrides: Mapping[str, Any],
    *,
    plugin: str = "",
    hidden: frozenset[str] = frozenset(),
) -> None:
    """Check that ``factory(**defaults, **overrides)`` passes only parameters it accepts, and all it needs.

    Args:
        kind: The component's kind, for the message (``"callback"``).
        name: The component's name (``"durable_checkpoint"``).
        factory: Its factory.
        defaults: The defaults its plugin registered.
        overrides: What the user gave (and what ``compose`` injects).
        plugin: The plugin that registered it, named when a default is wrong.
        hidden: Parameter names not to list (``compose``'s injected arguments).

    Raises:
        ParameterError: an unknown parameter (with the closest name and the list of parameters)
            or a missing required one.

    >>> def ramp(start, target, over, unit="samples"): ...
    >>> check_call("schedule", "ramp", ramp, {}, {"start": 4})
    Traceback (most recent call last):
    ...
    lplugins.ParameterError: schedule 'ramp': ramp is missing required parameter(s) 'target', 'over'. \
Parameters: start, target, over, unit.
    """
    acc = accepted(factory)
    given = {**defaults, **overrides}
    if not acc.open:
        names = acc.names
        for key in given:
            if key in names:
                continue
            source = f" (a default registered by plugin {plugin!r})" if key in defaults and key not in overrides else ""
            raise ParameterError(
                f"{kind} {name!r}: {acc.owner} has no parameter {key!r}{source}."
                + did_you_mean(key, names - hidden)
                + " "
                + acc.describe(hidden)
            )
    missing = [p for p in acc.required if p not in given]
    if missing:
        raise ParameterError(
            f"{kind} {name!r}: {acc.owner} is missing required parameter(s) {', '.join(map(repr, missing))}. "
            + acc.describe(hidden)
        )
