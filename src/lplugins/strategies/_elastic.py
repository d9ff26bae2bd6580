"""Process groups that re-form after every torchrun restart: one store namespace per attempt.

Under torchrun (TorchElastic) with the c10d rendezvous, torch shares one TCPStore across rendezvous
rounds (``TORCHELASTIC_USE_AGENT_STORE=True``: the agent of node 0 hosts it, every worker is a
client), and ``init_process_group`` writes its keys there under the fixed prefix ``default_pg``. After
a restart the new workers find the previous attempt's keys: a rank that starts before its peer has
rewritten them reads the dead peer's address (Gloo: ``connectFullMesh failed ... Connection refused``,
the restart is spent), or the group hangs in ``init_process_group`` until its timeout.
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it, if every user knows to set it.
``TORCHELASTIC_RESTART_COUNT`` is no safe namespace either: it counts restarts per agent, so after a
node's failure two nodes can carry different counts, and a restart for a node joining keeps the old
count.

Every lplugins strategy therefore initialises its default process group through
:func:`init_process_group`: under torchelastic the ranks first agree on a fresh attempt token over
the shared store (:func:`attempt_token`, a handshake that previous attempts' keys cannot confuse),
and the process group, the groups made from it (device meshes, DeepSpeed's groups) and lplugins'
failure board (``lplugins._coord.board``) all use the store under ``lplugins/elastic/<run id>/<token>/``.
Outside torchelastic nothing changes: Lightning initialises the group as usual.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import Any

from lplugins import _lightning
from lplugins._coord import elastic as _coord_elastic
from lplugins._errors import LPluginsError
from lplugins._log import announce

__all__ = ["attempt_prefix", "attempt_token", "init_process_group", "under_torchelastic"]

#: Where the handshake and the per-attempt stores live in the shared store.
KEY_ROOT = "lplugins/elastic"


def under_torchelastic() -> bool:
    """Whether this process is a worker started by torchrun / TorchElastic (it sets ``TORCHELASTIC_RUN_ID``)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def attempt_prefix(run_id: str, token: str) -> str:
    """The store prefix of one attempt of ``run_id``.

    Examples:
        >>> attempt_prefix("job7", "0.ab12")
        'lplugins/elastic/job7/0.ab12/'
    """
    return f"{KEY_ROOT}/{run_id}/{token}/"


def attempt_token(store: Any, rank: int, world_size: int, run_id: str, timeout: timedelta, label: str = "") -> str:
    """Agree with every rank on a token no earlier attempt used; all ranks of the attempt call it.

    Rank 0 makes the token (``label`` + a random part). Every other rank posts a random nonce under
    its rank and waits for the token under a key that names that nonce, so a key left by a previous
    attempt (a dead rank's nonce, an old token) can never be mistaken for this attempt's: rank 0
    answers whatever nonce it reads until the rank confirms under a key that names the new token.
    Returns once every rank has confirmed (rank 0) or has the token (the others).

    Args:
        store: The store shared by all ranks (and by earlier attempts).
        rank: This process's global rank.
        world_size: The number of ranks of this attempt.
        run_id: The job's id (``TORCHELASTIC_RUN_ID``): keys of other jobs on the store are apart.
        timeout: How long to wait for the other ranks.
        label: Readable start of the token (e.g. the restart count).

    Raises:
        LPluginsError: the other ranks did not arrive within ``timeout``.
    """
    root = f"{KEY_ROOT}/{run_id}/handshake"
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{root}/hello/{rank}", nonce)
        try:
            token = store.get(f"{root}/ack/{rank}/{nonce}").decode()  # blocks until rank 0 answers (store timeout)
        except Exception as err:
            raise LPluginsError(
                f"lplugins: rank {rank} waited {timeout.total_seconds():.0f}s for rank 0 to start this torchelastic "
                f"attempt of run {run_id!r} and gave up ({err}); the process-group timeout bounds this wait"
            ) from err
        store.set(f"{root}/confirm/{token}/{rank}", "1")
        return token
    token = f"{label}.{uuid.uuid4().hex[:12]}" if label else uuid.uuid4().hex[:12]
    answered: dict[int, bytes] = {}
    pending = set(range(1, world_size))
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.002
    while pending:
        for r in sorted(pending):
            if store.check([f"{root}/confirm/{token}/{r}"]):
                pending.discard(r)
                continue
            if not store.check([f"{root}/hello/{r}"]):
                continue
            nonce = store.get(f"{root}/hello/{r}")
            if answered.get(r) != nonce:  # a new nonce (or one left by an earlier attempt: harmless to answer)
                store.set(f"{root}/ack/{r}/{nonce.decode()}", token)
                answered[r] = nonce
        if not pending:
            break
        if time.monotonic() > deadline:
            raise LPluginsError(
                f"lplugins: rank 0 waited {timeout.total_seconds():.0f}s for ranks {sorted(pending)} to start this "
                f"torchelastic attempt of run {run_id!r}; the process-group timeout bounds this wait"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return token


def init_process_group(strategy: Any) -> bool:
    """Initialise the default process group for ``strategy`` through a per-attempt store, under torchelastic.

    Call it where the strategy would initialise the group, before Lightning's own call (which then
    finds the group initialised and returns). Outside torchelastic, or when a group exists already,
    it does nothing.

    Args:
        strategy: A Lightning ``ParallelStrategy`` (DDP, ModelParallel/FSDP2, DeepSpeed) with its
            cluster environment and accelerator set.

    Returns:
        Whether it initialised the group.
    """
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    if not under_torchelastic() or not dist.is_available() or dist.is_initialized():
        return False
    strategy.set_world_ranks()
    env = strategy.cluster_environment
    assert env is not None
    rank, world_size = env.global_rank(), env.world_size()
    timeout = _lightning.strategy_timeout(strategy) or timedelta(minutes=30)
    backend = _lightning.process_group_backend(strategy)
    # what Lightning's own initialisation sets, and what torch's env:// store reads
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # torch's own choice of store: a client of the agent's shared store, or one hosted by rank 0
    base, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))
    base.set_timeout(timeout)
    token = attempt_token(base, rank, world_size, run_id, timeout, label=f"r{restart}")
    store = dist.distributed_c10d.PrefixStore(attempt_prefix(run_id, token), base)
    kwargs: dict[str, Any] = {"timeout": timeout, "store": store}
    if strategy.root_device.type != "cpu":
        kwargs["device_id"] = strategy.root_device
    _lightning.init_dist_connection(env, backend, **kwargs)
    _coord_elastic.set_attempt(token)
    announce(
        "lplugins: torchelastic run %r, restart %s: the process group of these %d rank(s) uses its own store keys "
        "(attempt %s), so no key of an earlier attempt (a dead rank's address) is read",
        run_id,
        restart,
        world_size,
        token,
    )
    return True
