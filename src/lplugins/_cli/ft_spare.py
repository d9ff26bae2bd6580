"""A warm spare for ``lplugins ft run``: import the heavy modules now, run the script when told which replica.

``python -m lplugins._cli.ft_spare script.py args...`` imports torch, Lightning and torchft,
then waits for one line on stdin: the replica group id it replaces. It sets ``REPLICA_GROUP_ID`` and
runs ``script.py`` as ``__main__`` with ``args``, exactly as ``python script.py args`` would. An empty
stdin (the launcher finished) exits at once.
"""

from __future__ import annotations

import os
import runpy
import sys

from lplugins.strategies._ft_env import REPLICA_ID_VAR


def main() -> None:
    """Warm up, wait for the replica id, run the script."""
    import lightning.pytorch  # noqa: F401 - the point is to import them before they are needed
    import torch  # noqa: F401
    import torchft  # noqa: F401

    import lplugins
    import lplugins.strategies.ft

    lplugins.load()  # the plugins, once: compose() in the script finds them loaded

    line = sys.stdin.readline().strip()
    if not line:
        return
    os.environ[REPLICA_ID_VAR] = line
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
