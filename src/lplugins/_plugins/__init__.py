"""The plugin system: which plugins (discovery), pluggy's manager with lplugins' conventions, and the registry.

* ``discovery``: the built-ins, then the ``lplugins`` entry points, filtered (blocked, allowed);
* ``hooks``: pluggy's manager: the hook-name prefix check, one plugin registered at a time;
* ``manager``: :class:`~lplugins.PluginManager`: a plugin registers all-or-nothing; the process-wide one;
* ``registry``: one registry per kind of component, filled by the registering hooks;
* ``params``: a named component's parameters checked against its factory, before it is built;
* ``mirror``: Lightning's ``StrategyRegistry`` kept in step with lplugins' strategies.

May import: ``lplugins.hookspecs``, the foundation (``_errors``, ``_validate``, ``_log``, ``_env``) and
:mod:`lplugins._lightning` (which namespace a component is built for). Never a component, a built-in or
the composition layer: the built-ins are loaded by module name, through the same path as entry points.
"""
