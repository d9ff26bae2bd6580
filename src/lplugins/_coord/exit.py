"""A clean exit for processes that end with a gloo process group still initialized.

Lightning does not destroy the default process group when training ends (a notebook may fit again),
and most training scripts never call ``torch.distributed.destroy_process_group()``. With the gloo
backend (every CPU run), the group's C++ worker threads then meet the interpreter's finalization and
the process can abort with ``terminate called without an active exception`` (SIGABRT, exit code
-6/134) *after* a successful run -- intermittently, so a scheduler marks good jobs as failed
(pytorch/pytorch#190489). Importing lplugins registers an ``atexit`` handler that destroys a gloo
default group while the interpreter is still whole. Groups of other backends are left alone:
NCCL's shutdown can block on a peer that is gone, and it does not abort at exit.
"""

from __future__ import annotations

import atexit
import sys

_installed = False


def destroy_gloo_process_group() -> bool:
    """Destroy the default process group if it is a gloo group that is still initialized.

    Returns:
        Whether a group was destroyed.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return False  # never imported: nothing was initialized
    try:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
            return False
        dist.destroy_process_group()
    except Exception:  # exiting anyway: a failure here must not replace the run's exit status
        return False
    return True


def install() -> None:
    """Register :func:`destroy_gloo_process_group` to run at interpreter exit (once per process)."""
    global _installed
    if not _installed:
        atexit.register(destroy_gloo_process_group)
        _installed = True
