"""torchelastic (torchrun) and the failure board: per-attempt store keys, and stop signals.

Under torchrun a stop signal (SIGTERM) reaches every worker when the whole job stops, and only the
survivors when a worker died: :func:`end_if_peers_gone` tells the two apart for a rank waiting in an
agreement (:mod:`lplugins._coord.board`), so it ends at once instead of at torchrun's SIGKILL.
:func:`store_prefix` keeps the board's keys apart from an earlier attempt's.

Imports only the logger; the board is passed in.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from lplugins._log import announce, log

__all__ = [
    "STALE_HEARTBEAT_S", "STOP_GRACE_S", "end_if_peers_gone", "note_stop", "set_attempt", "stopped_for", "store_prefix",
]  # fmt: skip

#: A rank that waits in an agreement when a stop signal arrives gives the ranks that have not answered
#: this many seconds to show they got the signal too (a whole-group stop) before it ends itself.
STOP_GRACE_S = 2.0
#: How old (seconds) the heartbeat of a rank on another node must be to count it gone (two heartbeats missed).
STALE_HEARTBEAT_S = 2 * 5 + 2.0  # two heartbeats (each at most 5 samples of 1 s apart) and a margin

#: The torchelastic attempt whose store keys the default group uses (set by lplugins' strategies).
_attempt: str | None = None
#: ``(signal, monotonic time)`` of the first stop signal this process received under torchelastic.
_stop: tuple[int, float] | None = None


def set_attempt(token: str | None) -> None:
    """Say that the default group was made through a per-attempt store (``token``: the attempt's).

    lplugins' strategies call it after initialising the group under torchelastic; the failure board
    then knows its keys cannot meet an earlier attempt's.
    """
    global _attempt
    _attempt = token


def note_stop(signum: int | None) -> bool:
    """Remember torchrun's stop signal (``None``: forget it, a new fit); whether it is one (under torchelastic)."""
    global _stop
    if signum is None:
        _stop = None
        return False
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return False
    if _stop is None:
        _stop = (signum, time.monotonic())
    return True


def stopped_for() -> float | None:
    """Seconds since the stop signal, ``None`` without one."""
    return None if _stop is None else time.monotonic() - _stop[1]


def end_if_peers_gone(board: Any, answers: dict[int, dict[str, Any]]) -> None:
    """Under a torchelastic stop signal: end this process now if a rank that has not answered ``board``'s agreement
    did not get the signal.

    torchrun sends its stop signal to every worker of the group when it stops them all (the whole
    job ends: each rank posts ``signalled/<rank>``, the agreement goes on and the preemption save
    follows, as everywhere) and to the survivors only when a worker died: a rank that neither
    answered nor got the signal is then gone, and this rank cannot get past the agreement without
    it. It ends the way the signal would end a process without lplugins' handler, at once instead
    of at torchrun's SIGKILL (30 s later). Nothing committed is touched; the save it waited in was
    not committed by this rank (rank 0 commits after the agreement, or before it, whole).
    """
    assert _stop is not None
    gone = [
        r for r in range(board.world) if r not in answers and not board.store.check([f"signalled/{r}"])
    ]  # fmt: skip
    # a rank on another node gets the signal from its own agent, maybe seconds later: gone only once its
    # heartbeat is stale too (this node's agent signals all its workers at once)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or board.world)
    gone = [r for r in gone if r // local == board.rank // local or board.heartbeat_age(r) > STALE_HEARTBEAT_S]
    if not gone:
        return
    import signal

    signum = _stop[0]
    name = signal.Signals(signum).name
    sys.stderr.write(
        f"lplugins [rank {board.rank}]: {name} from torchelastic while waiting in {board.waiting or 'an agreement'}"
        f" for rank(s) {', '.join(map(str, gone))}, which neither answered nor got the signal (their process"
        f" ended): ending this worker now for torchrun's restart (committed checkpoints are intact)\n"
    )
    for handler in [*log.handlers, *logging.getLogger().handlers]:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # the status torchrun sees for a worker its signal ended
    time.sleep(5)
    os._exit(128 + signum)


def store_prefix() -> str:
    """The failure board's keys in the default group's store, apart from any earlier torchelastic attempt's.

    A group lplugins made under torchelastic already uses a store of its own attempt. Any other group
    under torchelastic (a stock Lightning strategy) shares torch's store with earlier attempts: the
    board's keys then carry the run id and this agent's restart count, and one warning names the fix.
    """
    if _attempt is not None or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return "lplugins/"
    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    announce(
        "lplugins: this process group was not made by an lplugins strategy; under torchrun its store keys are "
        "shared with the previous attempt's, so after a restart a rank can read a dead rank's address (Gloo "
        "'connectFullMesh failed ... Connection refused') or hang in init_process_group. Use "
        "strategy='ddp_timeout' (or 'fsdp2', 'deepspeed_*') instead of 'ddp', or set "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun; see docs/scaling-out.md"
    )
    return f"lplugins/{run_id}/r{restart}/"
