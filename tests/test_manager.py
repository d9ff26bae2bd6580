"""The plugin manager: discovery, controls, error isolation, nothing half-registered."""

from __future__ import annotations

import logging
import types
import warnings
from typing import Any

import pytest
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lplugins
from lplugins import LPluginsError, PluginError, PluginManager, PluginWarning
from lplugins._errors import BlockedNameError
from lplugins._plugins.manager import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS, set_manager


def _plugin(**hooks: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**hooks)


def _strategies(*names: str) -> Any:
    def lplugins_register_strategies(register: Any) -> None:
        for name in names:
            register(name, DDPStrategy, description=f"test {name}", defaults={"process_group_backend": "gloo"})

    return lplugins_register_strategies


@pytest.fixture
def manager() -> Any:
    m = PluginManager(strict=True)
    yield m
    m.close()


def test_builtins_are_registered_by_name_through_the_hooks(manager: PluginManager) -> None:
    manager.load(autoload=False, disable=[])
    names = [p.name for p in manager.plugins()]
    assert names == [name for name, _ in BUILTIN_PLUGINS]
    core = manager.plugin("core")
    assert core.builtin and core.status == "loaded" and core.distribution == "lplugins"
    assert "model_checkpoint" in core.registered["callback"]
    assert manager.get("callback", "lr_monitor").plugin == "core"


def test_builtin_can_be_blocked_by_name(manager: PluginManager) -> None:
    manager.load(autoload=False, disable=["checkpoint"])
    assert manager.plugin("checkpoint").status == "blocked"
    assert all(c.plugin != "checkpoint" for c in manager.registry("callback").components())


def test_builtin_blocked_from_environment(monkeypatch: pytest.MonkeyPatch, manager: PluginManager) -> None:
    monkeypatch.setenv("LPLUGINS_DISABLE", "logging, checkpoint")
    manager.load(autoload=False)
    assert manager.plugin("logging").status == "blocked"
    assert manager.plugin("checkpoint").status == "blocked"
    assert manager.plugin("core").status == "loaded"


def test_essential_plugin_refuses_to_be_blocked(manager: PluginManager) -> None:
    assert "core" in ESSENTIAL_PLUGINS
    with pytest.raises(LPluginsError, match="'core' is essential and cannot be blocked"):
        manager.load(autoload=False, disable=["core"])


def test_entry_point_plugins_are_discovered_in_a_stable_order(fake_entry_points: Any, manager: PluginManager) -> None:
    fake_entry_points({"zeta": _plugin(lplugins_register_strategies=_strategies("zeta_ddp"))}, distribution="zeta-dist")
    fake_entry_points({"alpha": _plugin(lplugins_register_strategies=_strategies("alpha_ddp"))}, distribution="a-dist")
    manager.load(autoload=True, disable=[])
    external = [p for p in manager.plugins() if not p.builtin]
    assert [p.name for p in external] == ["alpha", "zeta"]
    assert external[0].distribution == "a-dist" and external[0].version == "1.0"
    assert external[0].entry_point is not None and external[0].entry_point.startswith("alpha = ")
    assert StrategyRegistry["alpha_ddp"]["init_params"] == {"process_group_backend": "gloo"}
    assert isinstance(StrategyRegistry.get("zeta_ddp"), DDPStrategy)


def test_close_removes_strategies_from_lightning(fake_entry_points: Any) -> None:
    fake_entry_points({"p": _plugin(lplugins_register_strategies=_strategies("temp_ddp"))})
    m = PluginManager().load(disable=[])
    assert "temp_ddp" in StrategyRegistry
    m.close()
    assert "temp_ddp" not in StrategyRegistry
    assert "temp_ddp" not in m.registry("strategy")


def test_autoload_disabled_by_environment(
    fake_entry_points: Any, monkeypatch: pytest.MonkeyPatch, manager: PluginManager
) -> None:
    fake_entry_points({"ext": _plugin(lplugins_register_strategies=_strategies("ext_ddp"))})
    monkeypatch.setenv("LPLUGINS_DISABLE_AUTOLOAD", "1")
    manager.load(disable=[])
    assert all(p.builtin for p in manager.plugins())
    assert "ext_ddp" not in StrategyRegistry


def test_allow_list_loads_only_named_plugins(
    fake_entry_points: Any, monkeypatch: pytest.MonkeyPatch, manager: PluginManager
) -> None:
    fake_entry_points({"one": _plugin(lplugins_register_strategies=_strategies("one_ddp"))}, distribution="one-dist")
    fake_entry_points({"two": _plugin(lplugins_register_strategies=_strategies("two_ddp"))}, distribution="two-dist")
    monkeypatch.setenv("LPLUGINS_PLUGINS", "two-dist")  # a distribution name works as well as a plugin name
    manager.load(disable=[])
    assert [p.name for p in manager.plugins() if not p.builtin] == ["two"]
    assert "one_ddp" not in StrategyRegistry


def test_allow_list_works_with_autoload_disabled(fake_entry_points: Any, manager: PluginManager) -> None:
    fake_entry_points({"one": _plugin(lplugins_register_strategies=_strategies("one_ddp"))})
    fake_entry_points({"two": _plugin(lplugins_register_strategies=_strategies("two_ddp"))})
    manager.load(autoload=False, allow=["one"], disable=[])
    assert [p.name for p in manager.plugins() if not p.builtin] == ["one"]


def test_allow_list_with_unknown_name_is_an_error(fake_entry_points: Any, manager: PluginManager) -> None:
    fake_entry_points({"acme": _plugin()}, distribution="acme-lplugins")
    with pytest.raises(LPluginsError, match=r"'acmee'.*Did you mean 'acme'"):
        manager.load(allow=["acmee"], disable=[])


def test_block_list_blocks_an_entry_point_plugin(fake_entry_points: Any, manager: PluginManager) -> None:
    fake_entry_points({"ext": _plugin(lplugins_register_strategies=_strategies("ext_ddp"))})
    manager.load(disable=["ext"])
    assert manager.plugin("ext").status == "blocked"
    assert "ext_ddp" not in StrategyRegistry


def test_block_list_with_unknown_name_warns(manager: PluginManager) -> None:
    with pytest.warns(UserWarning, match="'nosuch', which matches no plugin"):
        manager.load(autoload=False, disable=["nosuch"])


def test_broken_import_names_plugin_distribution_version_and_entry_point(
    fake_entry_points: Any, manager: PluginManager
) -> None:
    fake_entry_points({"good": _plugin(lplugins_register_strategies=_strategies("good_ddp"))}, distribution="a-good")
    fake_entry_points({"broken": "no_such_module_xyz:plugin"}, distribution="broken-dist", version="3.1")
    with pytest.raises(PluginError) as info:
        manager.load(disable=[])
    err = info.value
    text = str(err)
    assert 'plugin "broken"' in text and "broken-dist 3.1" in text and "broken = no_such_module_xyz:plugin" in text
    assert err.stage == "import"
    assert isinstance(err.__cause__, ModuleNotFoundError)
    assert "broken" not in [p.name for p in manager.plugins()]


def test_wrong_hook_signature_is_rejected(fake_entry_points: Any, manager: PluginManager) -> None:
    def lplugins_register_strategies(register: Any, nonsense: Any) -> None:
        raise AssertionError("must not be called")

    fake_entry_points({"bad": _plugin(lplugins_register_strategies=lplugins_register_strategies)}, distribution="bd")
    with pytest.raises(PluginError, match=r'(?s)plugin "bad" \(bd 1.0.*invalid hook implementation.*nonsense') as info:
        manager.load(disable=[])
    assert info.value.stage == "validate"
    assert info.value.__cause__ is not None


def test_misspelled_hook_is_rejected_with_a_suggestion(fake_entry_points: Any, manager: PluginManager) -> None:
    fake_entry_points({"typo": _plugin(lplugins_register_strategy=_strategies("x"))})
    with pytest.raises(PluginError, match=r"unknown hook 'lplugins_register_strategy'.*Did you mean"):
        manager.load(disable=[])


def test_hook_that_raises_leaves_nothing_half_registered(fake_entry_points: Any, manager: PluginManager) -> None:
    def lplugins_register_strategies(register: Any) -> None:
        register("half_ddp", DDPStrategy)
        raise RuntimeError("boom after registering one")

    def lplugins_register_callbacks(register: Any) -> None:
        register("half_cb", lambda: None)

    fake_entry_points(
        {
            "half": _plugin(
                lplugins_register_strategies=lplugins_register_strategies,
                lplugins_register_callbacks=lplugins_register_callbacks,
            )
        }
    )
    with pytest.raises(PluginError, match="raised RuntimeError: boom after registering one") as info:
        manager.load(disable=[])
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "half_ddp" not in StrategyRegistry
    assert "half_ddp" not in manager.registry("strategy")
    assert "half_cb" not in manager.registry("callback")
    assert not any(impl.plugin_name == "half" for impl in manager.hook.lplugins_register_callbacks.get_hookimpls())


def test_two_plugins_registering_the_same_name(fake_entry_points: Any, manager: PluginManager) -> None:
    fake_entry_points({"first": _plugin(lplugins_register_strategies=_strategies("shared_ddp"))}, distribution="d1")
    fake_entry_points(
        {"second": _plugin(lplugins_register_strategies=_strategies("own_ddp", "shared_ddp"))},
        distribution="d2",
        version="2.0",
    )
    with pytest.raises(
        PluginError,
        match=r"plugin \"second\" \(d2 2.0.*'shared_ddp' is already registered by plugin "
        r"'first'.*LPLUGINS_DISABLE",
    ):
        manager.load(disable=[])
    assert manager.get("strategy", "shared_ddp").plugin == "first"
    assert "own_ddp" not in StrategyRegistry  # nothing of the failing plugin remains


def test_name_that_lightning_already_has_is_refused(manager: PluginManager) -> None:
    manager.load(autoload=False, disable=[])
    with pytest.raises(PluginError, match="'ddp' is already in Lightning's StrategyRegistry"):
        manager.register(_plugin(lplugins_register_strategies=_strategies("ddp")), "clash")
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy and "init_params" in StrategyRegistry["ddp"]


def test_lenient_mode_reports_and_carries_on(fake_entry_points: Any) -> None:
    fake_entry_points({"broken": "no_such_module_xyz:plugin"}, distribution="broken-dist")
    fake_entry_points({"fine": _plugin(lplugins_register_strategies=_strategies("fine_ddp"))}, distribution="fine")
    m = PluginManager(strict=False)
    try:
        with pytest.warns(PluginWarning, match='plugin "broken" \\(broken-dist'):
            m.load(disable=[])
        assert [f.name for f in m.failures] == ["broken"]
        assert "No module named 'no_such_module_xyz'" in (m.failures[0].error or "")
        assert m.plugin("fine").status == "loaded" and "fine_ddp" in StrategyRegistry
    finally:
        m.close()


def test_lenient_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LPLUGINS_STRICT", "0")
    assert PluginManager().strict is False
    monkeypatch.setenv("LPLUGINS_STRICT", "maybe")
    with pytest.raises(LPluginsError, match="LPLUGINS_STRICT='maybe' is not a boolean"):
        PluginManager()


def test_prefixed_functions_need_no_marker(manager: PluginManager) -> None:
    manager.load(autoload=False, disable=[])
    module = types.ModuleType("plain_plugin")

    def lplugins_register_callbacks(register: Any) -> None:
        register("plain_cb", lambda: None, description="no marker")

    module.lplugins_register_callbacks = lplugins_register_callbacks  # type: ignore[attr-defined]
    module.helper = lambda: None  # type: ignore[attr-defined]  # not a hook: ignored
    info = manager.register(module)
    assert info.name == "plain_plugin" and info.registered == {"callback": ["plain_cb"]}


def test_register_validates_names_and_metadata(manager: PluginManager) -> None:
    manager.load(autoload=False, disable=[])

    def bad_name(register: Any) -> None:
        register("has space", DDPStrategy)

    with pytest.raises(PluginError, match="Invalid strategy name 'has space'"):
        manager.register(_plugin(lplugins_register_strategies=bad_name), "p1")

    def bad_meta(register: Any) -> None:
        register("x", DDPStrategy, colour="red")

    with pytest.raises(PluginError, match=r"unexpected keyword\(s\) \['colour'\]"):
        manager.register(_plugin(lplugins_register_strategies=bad_meta), "p2")


def test_unknown_name_lists_available_and_closest(manager: PluginManager) -> None:
    manager.load(autoload=False, disable=[])
    with pytest.raises(lplugins.UnknownNameError, match=r"Unknown callback 'lr_monitr'.*Did you mean 'lr_monitor'"):
        manager.get("callback", "lr_monitr")


def test_default_manager_is_loaded_once() -> None:
    first = lplugins.load()
    assert lplugins.load() is first and lplugins.get_manager() is first


def test_third_party_plugin_does_not_warn_when_healthy(fake_entry_points: Any, manager: PluginManager) -> None:
    fake_entry_points({"ok": _plugin(lplugins_register_strategies=_strategies("ok_ddp"))})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager.load(disable=[])


def test_fresh_manager_shadows_and_restores_the_default_managers_strategies(fake_entry_points: Any) -> None:
    outer = PluginManager().load(disable=[])
    try:
        outer.register(_plugin(lplugins_register_strategies=_strategies("shadow_ddp")), "outer")
        before = StrategyRegistry["shadow_ddp"]
        inner = PluginManager().load(autoload=False, disable=[])
        inner.register(_plugin(lplugins_register_strategies=_strategies("shadow_ddp")), "inner")
        assert StrategyRegistry["shadow_ddp"] is not before
        inner.close()
        assert StrategyRegistry["shadow_ddp"] is before  # the outer manager's entry is back
    finally:
        outer.close()
    assert "shadow_ddp" not in StrategyRegistry


def test_the_kinds_table_is_the_contract(manager: PluginManager) -> None:
    """Each row of hookspecs.KINDS: its hook exists with the row's Register type, whose keywords are the row's."""
    import inspect

    from lplugins import hookspecs

    base = {"self", "name", "factory", "description", "defaults"}
    for kind in hookspecs.KINDS:
        spec = getattr(hookspecs, kind.hook)
        assert inspect.signature(spec).parameters["register"].annotation == kind.register.__name__, kind.hook
        keywords = set(inspect.signature(kind.register.__call__).parameters) - base
        assert keywords == kind.keywords, kind.name
        assert manager.registry(kind.name).kind == kind.name
    assert {k.hook for k in hookspecs.KINDS} == {n for n in dir(hookspecs) if n.startswith("lplugins_register_")}, (
        "every registering hook has a row in KINDS"
    )


def test_register_errors_are_lplugins_errors() -> None:
    from lplugins._errors import RegistrationError
    from lplugins._plugins.registry import KIND_BY_NAME, Registrar

    register = Registrar(KIND_BY_NAME["precision"], "p", [])
    register("ok", DDPStrategy, accelerators=("cpu",))
    for args, kwargs, match in [
        (("has space", DDPStrategy), {}, "Invalid precision name"),
        (("x", 42), {}, "must be callable"),
        (("x", DDPStrategy), {"defaults": [1]}, "must be a mapping"),
        (("x", DDPStrategy), {"detect": bool}, r"unexpected keyword\(s\) \['detect'\]"),
        (("ok", DDPStrategy), {}, "registered twice"),
    ]:
        with pytest.raises(RegistrationError, match=match) as info:
            register(*args, **kwargs)
        assert isinstance(info.value, LPluginsError) and isinstance(info.value, (TypeError, ValueError))


def test_one_plugin_may_use_a_name_in_two_kinds(manager: PluginManager) -> None:
    manager.load(autoload=False, disable=[])

    def lplugins_register_callbacks(register: Any) -> None:
        register("twin", lambda: None)

    def lplugins_register_schedules(register: Any) -> None:
        register("twin", lambda: None)

    info = manager.register(
        _plugin(
            lplugins_register_callbacks=lplugins_register_callbacks,
            lplugins_register_schedules=lplugins_register_schedules,
        ),
        "twins",
    )
    assert info.registered == {"schedule": ["twin"], "callback": ["twin"]}


def test_unknown_kind_is_named(manager: PluginManager) -> None:
    with pytest.raises(
        lplugins.UnknownNameError, match=r"Unknown component kind 'strategies'.*Did you mean 'strategy'"
    ):
        manager.registry("strategies")


def test_the_kinds_table_in_the_docs_matches_hookspecs() -> None:
    from pathlib import Path

    from lplugins import hookspecs

    text = (Path(__file__).resolve().parents[1] / "docs" / "hooks.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]

    def cell(names: Any) -> str:
        return ", ".join(f"`{n}`" for n in sorted(names)) or "—"

    expected = [f"| `{k.name}` | `{k.hook}` | {cell(k.keywords)} | {cell(k.injected)} |" for k in hookspecs.KINDS]
    assert rows == expected


def test_a_blocked_name_says_blocked_and_by_what(monkeypatch: pytest.MonkeyPatch, manager: PluginManager) -> None:
    monkeypatch.setenv("LPLUGINS_DISABLE", "strategies,checkpoint")
    manager.load(autoload=False)
    previous = set_manager(manager)
    try:
        with pytest.raises(BlockedNameError) as info:
            lplugins.compose(strategy="deepspeed_stage_2_cpu", accelerator="cpu")
        assert str(info.value) == (
            "Strategy 'deepspeed_stage_2_cpu' is provided by plugin 'strategies', which is blocked by "
            "LPLUGINS_DISABLE=strategies,checkpoint. Unblock the plugin to use it, or choose another strategy."
        )
        assert "Did you mean" not in str(info.value)
        assert isinstance(info.value, lplugins.UnknownNameError)  # callers catching the old error still do
        with pytest.raises(BlockedNameError, match="'durable_checkpoint' is provided by plugin 'checkpoint'"):
            lplugins.compose(callbacks=["durable_checkpoint"])
        with pytest.raises(lplugins.UnknownNameError, match="Did you mean 'lr_monitor'"):  # unknown stays unknown
            manager.get("callback", "lr_monitr")
    finally:
        set_manager(previous)


def test_a_name_blocked_in_code_names_the_argument(manager: PluginManager) -> None:
    manager.load(autoload=False, disable=["accumulation"])
    with pytest.raises(BlockedNameError, match=r"blocked by disable=\['accumulation'\]"):
        manager.get("schedule", "ramp")


def test_loaded_plugins_are_announced_once(caplog: pytest.LogCaptureFixture) -> None:
    previous = set_manager(None)
    try:
        with caplog.at_level(logging.INFO, logger="lplugins"):
            loaded = lplugins.load(autoload=False, disable=["checkpoint"])
            assert lplugins.load() is loaded  # a second call loads nothing and says nothing
        lines = [r.getMessage() for r in caplog.records if r.name == "lplugins"]
        assert lines == [
            "lplugins: loaded 6 plugins: core, strategies, precision, accumulation, logging, ray (blocked: checkpoint)"
        ]
        loaded.close()
    finally:
        set_manager(previous)


def test_strict_mode_error_says_how_to_go_on(fake_entry_points: Any) -> None:
    fake_entry_points({"broken": "no_such_module_xyz:plugin"}, distribution="broken-dist", version="3.1")
    previous = set_manager(None)
    try:
        for _ in range(2):  # strict mode raises at every load until something is done about it
            with pytest.raises(PluginError) as info:
                lplugins.load(disable=[])
            message = str(info.value)
            assert "No module named 'no_such_module_xyz'" in message
            assert "block it with LPLUGINS_DISABLE=broken" in message
            assert "set LPLUGINS_STRICT=0 to skip failing plugins with a warning" in message
            assert "pip uninstall broken-dist" in message
        lplugins.load(disable=["broken"]).close()  # what the message says works
    finally:
        set_manager(previous)


def test_strict_zero_code_trainer_error_says_how_to_go_on(
    lplugins_manager: PluginManager, lplugins_register: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lplugins._composition.factory import callbacks_factory

    def lplugins_trainer_callbacks(trainer_kwargs: Any) -> None:
        raise RuntimeError("cannot reach audit server")

    lplugins_register(_plugin(lplugins_trainer_callbacks=lplugins_trainer_callbacks), "audit", distribution="audit-d")
    monkeypatch.setenv("LPLUGINS_AUTO_CALLBACKS", "1")
    with pytest.raises(PluginError, match=r"block it with LPLUGINS_DISABLE=audit.*LPLUGINS_STRICT=0"):
        callbacks_factory()
