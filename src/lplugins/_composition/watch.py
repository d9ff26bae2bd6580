"""The collective watchdog's lifetime: started when a multi-process run begins, stopped and joined when it ends.

``Trainer()`` only records the settings (checked there, so a bad one fails before any process starts);
:class:`CollectiveWatch` starts the thread in ``setup`` (the process group exists by then) and stops and
joins it in ``teardown`` and ``on_exception``, so that a Trainer that is only built, or whose run is over,
leaves no thread behind (Lightning's own test suites fail a test that does).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from lplugins._coord import watchdog as _watchdog


class CollectiveWatch(Callback):
    """Runs lplugins' collective watchdog (:mod:`lplugins._coord.watchdog`) for the length of each run.

    Args:
        timeout: The floor of the collective bound, in seconds (``LPLUGINS_COLLECTIVE_TIMEOUT``).
        heartbeat: The floor of the GIL bound, in seconds (``LPLUGINS_HEARTBEAT_TIMEOUT``).
        log_dir: Where the stack files go (the Trainer's ``default_root_dir``).
    """

    def __init__(self, timeout: float, heartbeat: float, log_dir: str | None) -> None:
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.log_dir = log_dir

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.world_size > 1:
            _watchdog.arm(self.timeout, heartbeat=self.heartbeat, log_dir=self.log_dir)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _watchdog.pause()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # the other ranks are told if it leaves the script (the exception hook, from what pause keeps): an
        # exception the script catches (a refused resume it expected) is not a failure of the job
        _watchdog.pause()
