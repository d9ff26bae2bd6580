"""A fork server: import torch, Lightning and lplugins once, then fork real processes from that warm state.

:mod:`~lplugins._fork.server` runs in its own process (``python -m lplugins._fork.server``) and
:mod:`~lplugins._fork.client` starts it, asks it for processes and hears of their exits. Used by
``lplugins ft run`` (each replica group) and by :func:`lplugins.testing.lplugins_launch` (each rank of a test).
"""
