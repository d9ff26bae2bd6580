"""Composition: names turned into objects for a stock Lightning Trainer, and the ways a Trainer gets them.

* ``compose``: :func:`~lplugins.compose`, :func:`~lplugins.compose_trainer`, :func:`~lplugins.attach`;
* ``resolve``: one argument at a time (strategy, precision, plugins, accumulation, callbacks) -> objects;
* ``pairs``: pairs of Trainer arguments that do not fit together, refused at compose time;
* ``factory``: zero-code mode, Lightning's ``callbacks_factory`` entry point;
* ``autoload``: ``LPLUGINS_AUTO_NAMES``: the plugins loaded when Lightning is first imported.

May import: the plugin system (:mod:`lplugins._plugins`), the Lightning boundary, the foundation, and the
components it composes by rule (the ``precision="auto"`` choice, the accumulation callback of a schedule).
Lightning-facing: ``compose``, ``pairs`` and ``factory`` have ``pytorch_lightning`` twins.
"""
