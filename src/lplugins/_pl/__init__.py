"""The ``pytorch_lightning`` twins of lplugins' Lightning-facing modules (see :mod:`lplugins._namespace`).

``lplugins._pl.X`` is ``lplugins.X`` rewritten for ``pytorch_lightning`` + ``lightning_fabric``.
Importing this package installs the finder that materialises them, so a twin class pickled in
one process is found again by name in another (a spawned DDP worker, a DataLoader worker).
"""

from lplugins._namespace import install

install()
