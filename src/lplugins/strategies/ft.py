"""``ft_ddp``: data parallelism across torchft replica groups; a lost replica does not stop the others.

Each replica group is one process (one CPU, gloo) with its own Trainer. torchft's lighthouse decides,
at every step, which replica groups take part (the quorum); gradients are averaged over them through
torchft's fault-tolerant process group (``Manager.allreduce``); a replica group that was restarted
receives the model and optimizer state from a healthy peer over the network (torchft's checkpoint
transport, HTTP) and takes part again from its first step: nothing is read from disk. See
``docs/ft.md``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from typing_extensions import override

from lplugins.strategies import _ft_env, _ft_loop
from lplugins.strategies._ft_env import FTConfigError, ReplicaConfig
from lplugins.strategies._ft_limit import AllreduceLimit, bounded_gloo

__all__ = ["FTDDPStrategy"]


def _seconds(name: str, value: float | timedelta) -> timedelta:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise FTConfigError(f"{name}={value!r} must be a positive number of seconds (or a timedelta).")
    return timedelta(seconds=float(seconds))


class FTDDPStrategy(SingleDeviceStrategy):
    """Fault-tolerant data parallelism with torchft: one process per replica group, CPU (gloo).

    Every optimizer step: the quorum is started before the step's forward pass (torchft computes it in
    the background), the gradients are averaged over the replica groups in the quorum, then torchft
    decides whether the step commits (``should_commit``). A step that does not commit (a peer died
    during the all-reduce, fewer than ``min_replicas`` groups) leaves the parameters and the optimizer
    state untouched on every group. A replica group joining (or rejoining after a restart) is sent the
    model's and the optimizers' state by a healthy peer and applies it before its first step.

    The job's step count is torchft's (``ft_step``), shared by every group: ``max_steps`` stops every
    group after that many committed steps, wherever each one joined. Lightning's own ``global_step``
    counts this process's steps since it (re)started.

    Lightning's rank-zero utilities (its loggers, ``rank_zero_info``...) follow the leader: the
    replica group of rank 0 in the current quorum, so a metric is logged once per step by one group.
    Each group is a world of one process for Lightning (``world_size == 1``, ``is_global_zero``), so a
    ``DurableCheckpoint`` writes each group's own checkpoints: give each group its own ``dirpath``
    (``f"ckpts/replica_{replica_id}"``). They are the fallback when every group is lost: restart every
    group from the same checkpoint (``ckpt_path=`` one group's newest); the job's step then goes on
    from that checkpoint's ``global_step``.

    Args:
        lighthouse: The torchft lighthouse, ``http://host:port``; default ``TORCHFT_LIGHTHOUSE``.
        replica_id: This group's id, ``0 .. num_replica_groups - 1``; default ``REPLICA_GROUP_ID``.
        num_replica_groups: The number of replica groups; default ``NUM_REPLICA_GROUPS``.
        min_replicas: The fewest groups a step commits with; default ``LPLUGINS_FT_MIN_REPLICAS``, else 1.
        max_steps: Stop after this many steps committed by the job (``None``: Lightning's limits only).
        timeout: Seconds for torchft's collectives, state transfer and commit calls.
        quorum_timeout: Seconds to wait for a quorum.
        heartbeat_interval: Seconds between this group's heartbeats to the lighthouse (torchft's
            ``heartbeat_interval``); keep it a fraction of the lighthouse's heartbeat timeout, which is
            how long a lost group holds up the others. Default ``LPLUGINS_FT_HEARTBEAT_MS`` (``lplugins
            ft run`` sets a quarter of ``--heartbeat-timeout-ms``), else 0.1.
        step_retries: How many times a step whose all-reduce failed (a peer lost during it) is tried
            again at once, with the same gradients, in a new quorum without the lost peer, before it is
            dropped: the survivors do not recompute the step's forward and backward passes.
        reduce_dtype: The dtype the gradients are summed in (``None``: their own). ``"float64"`` makes
            the mean of float32 gradients independent of the order the replica groups are summed in
            (gloo's ring order depends on who takes part), so a run matches a one-process replay of
            the same steps; it doubles the bytes of the all-reduce.
        init_sync: Whether every group starts from the state of one group (torchft's ``init_sync``);
            ``False`` only when every group initialises its model identically (a fixed seed).
        start_timeout: Seconds the job's first step waits for all ``num_replica_groups`` groups to be in
            its quorum (a group that starts later than the others would otherwise leave the first steps
            to a smaller quorum, or, with ``min_replicas=1``, to each group alone). A group that
            rejoins a running job does not wait. ``0``: no wait (the first step commits with whoever
            is there, at least ``min_replicas``).
        allreduce_timeout: How long one all-reduce may take before it fails (and is retried in a new
            quorum): ``"auto"`` adapts to the all-reduces seen (``max(2 s, 10 x their median)``, at most
            ``timeout``), so a survivor never waits out the whole ``timeout`` for a peer lost during it;
            or a fixed number of seconds.
        host: The address other groups reach this one at (its store); default ``socket.gethostname()``.
        check_lighthouse: Connect to the lighthouse when built, so an unreachable one fails at once.
        **kwargs: Passed to Lightning's ``SingleDeviceStrategy`` (``accelerator``, ``checkpoint_io``,
            ``precision_plugin``).

    Raises:
        FTUnavailableError: torchft is not installed.
        FTConfigError: the lighthouse is missing or unreachable, or a replica setting is out of range;
            at the first step: fewer than ``num_replica_groups`` groups joined within ``start_timeout``.
    """

    strategy_name = "ft_ddp"

    def __init__(
        self,
        *,
        lighthouse: str | None = None,
        replica_id: int | None = None,
        num_replica_groups: int | None = None,
        min_replicas: int | None = None,
        max_steps: int | None = None,
        timeout: float | timedelta = 60.0,
        quorum_timeout: float | timedelta = 60.0,
        heartbeat_interval: float | timedelta | None = None,
        step_retries: int = 3,
        reduce_dtype: str | torch.dtype | None = None,
        init_sync: bool = True,
        start_timeout: float | timedelta = 120.0,
        allreduce_timeout: float | str = "auto",
        host: str | None = None,
        check_lighthouse: bool = True,
        **kwargs: Any,
    ) -> None:
        _ft_env.require("ft_ddp")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise FTConfigError(f"max_steps={max_steps!r} must be a positive int (or None).")
        if isinstance(step_retries, bool) or not isinstance(step_retries, int) or step_retries < 0:
            raise FTConfigError(f"step_retries={step_retries!r} must be an int >= 0.")
        self.step_retries = step_retries
        self.reduce_dtype = _ft_env.reduce_dtype(reduce_dtype)
        self._heartbeat = _seconds("heartbeat_interval", _ft_env.heartbeat_interval(heartbeat_interval))
        self._ft_timeout = _seconds("timeout", timeout)
        self.allreduce_limit = AllreduceLimit(allreduce_timeout, cap_s=self._ft_timeout.total_seconds())
        self.config: ReplicaConfig = _ft_env.replica_config(
            lighthouse=lighthouse,
            replica_id=replica_id,
            num_replica_groups=num_replica_groups,
            min_replicas=min_replicas,
            check_reachable=check_lighthouse,
        )
        self.max_steps = max_steps
        self._quorum_timeout = _seconds("quorum_timeout", quorum_timeout)
        self._init_sync = bool(init_sync)
        wait = start_timeout.total_seconds() if isinstance(start_timeout, timedelta) else start_timeout
        no_wait = not isinstance(wait, bool) and wait in (0, 0.0)
        self._start_timeout = None if no_wait else _seconds("start_timeout", start_timeout)
        self._started = False
        self._host = host or socket.gethostname()
        self._manager: Any = None
        self._store: Any = None
        self._pg: Any = None
        self._last_step = 0
        self._leader: bool | None = None
        #: steps that committed on a retry (their first all-reduce failed: a peer was lost during it)
        self.retried_steps = 0
        #: (torchft step, wall time) of each state this group received from a peer
        self.recoveries: list[tuple[int, float]] = []
        #: the last step: (the job's step it was, whether it committed, whether this group's gradients
        #: counted, how many groups' gradients the mean was over)
        self.last_step: tuple[int, bool, bool, int] | None = None
        kwargs.setdefault("device", "cpu")
        super().__init__(**kwargs)

    # ----------------------------------------------------------------------------------- identity
    @property
    def replica_id(self) -> int:
        """This replica group's id."""
        return self.config.replica_id

    @property
    def num_replica_groups(self) -> int:
        """The number of replica groups in the job."""
        return self.config.num_replica_groups

    @property
    def manager(self) -> Any:
        """The ``torchft.Manager`` of this group (``None`` before ``setup``)."""
        return self._manager

    @property
    def ft_step(self) -> int:
        """The job's committed steps (torchft's step), the same in every group of the quorum."""
        return self._last_step if self._manager is None else int(self._manager.current_step())

    @property
    def is_leader(self) -> bool:
        """Whether this group is rank 0 of the current quorum (it logs for the job)."""
        return int(getattr(rank_zero_only, "rank", 0)) == 0

    @property
    def _module(self) -> Any:
        module = self.lightning_module
        if module is None:  # pragma: no cover - set by Lightning before any hook here runs
            raise RuntimeError("ft_ddp: no LightningModule attached")
        return module

    # ------------------------------------------------------------------------------------ set up
    @override
    def setup(self, trainer: Any) -> None:
        if self.root_device.type != "cpu":
            raise FTConfigError(
                f"ft_ddp runs on CPU (gloo) in this release; got the device {self.root_device}. Use accelerator='cpu'."
            )
        super().setup(trainer)
        for optimizer in self.optimizers:
            if isinstance(optimizer, torch.optim.LBFGS):
                raise FTConfigError(
                    "ft_ddp does not support torch.optim.LBFGS: it evaluates its closure several times per "
                    "step, and each evaluation would need its own fault-tolerant all-reduce."
                )
        self._set_leader(self.replica_id == 0)  # until the first quorum says otherwise
        self._start_manager()

    def _start_manager(self) -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]
        from torchft import Manager

        # the group's store: its manager server registers there, and peers meet in it for the
        # process group when this group is the quorum's first
        self._store = TCPStore(self._host, 0, is_master=True, wait_for_workers=False)
        self._pg = bounded_gloo(self._ft_timeout.total_seconds(), self.allreduce_limit)
        self._manager = Manager(
            pg=self._pg,
            load_state_dict=self._load_state,
            state_dict=self._state,
            min_replica_size=self.config.min_replicas,
            use_async_quorum=True,
            timeout=self._ft_timeout,
            quorum_timeout=self._quorum_timeout,
            connect_timeout=self._ft_timeout,
            rank=0,
            world_size=1,
            store_addr=self._host,
            store_port=int(self._store.port),
            lighthouse_addr=self.config.lighthouse,
            replica_id=f"replica_{self.replica_id}",
            hostname=self._host,
            heartbeat_interval=self._heartbeat,
            init_sync=self._init_sync,
        )

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # resumed from disk (every group lost): the job's step goes on from the checkpoint's
        step = int(self._module.trainer.global_step)
        if step > 0 and self._manager is not None and self._manager.current_step() == 0:
            self._manager.load_state_dict({"step": step, "batches_committed": 0})

    def _state(self) -> dict[str, Any]:
        """What a recovering peer receives: the model's and the optimizers' state (tensors are sent, not saved),
        and where the loop stands (Lightning's optimizer steps, the accumulation schedule's counters)."""
        return {
            "model": self._module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "loop": _ft_loop.progress(self._module.trainer),
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        self._module.load_state_dict(state["model"])
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        if "loop" in state:
            _ft_loop.restore(self._module.trainer, state["loop"])
        self.recoveries.append((int(self._manager.current_step()), time.time()))

    # ------------------------------------------------------------------------------------ a step
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        manager = self._manager
        if manager is None:  # pragma: no cover - Lightning steps only after setup
            raise RuntimeError("ft_ddp: optimizer_step before setup")
        # the job's step before this group's first quorum: a rejoining group's first quorum moves it on (the
        # peer's step), which the start barrier must see; read after the quorum it could already have moved
        start = int(manager.current_step())
        manager.start_quorum()  # computed in the background while the closure runs forward/backward

        def ft_closure() -> Any:
            result = closure()
            if not self._started:
                self._await_groups(manager, start)
            grads = self._gradients(optimizer)
            local = torch.cat([grad.reshape(-1) for grad in grads]).to(self.reduce_dtype or grads[0].dtype)
            for attempt in range(self.step_retries + 1):
                if attempt:
                    # the all-reduce failed (a peer was lost during it): the same gradients, in a new quorum
                    manager.start_quorum()
                flat = local.clone() if attempt < self.step_retries else local
                committed, participating = self._reduce_and_commit(flat)
                # retry only with gradients computed from the parameters the quorum has (not while recovering)
                if committed or manager.errored() is None or not participating:
                    break
            self.retried_steps += int(committed and attempt > 0)
            step = int(manager.current_step()) - int(committed)
            self.last_step = (step, bool(committed), participating, int(manager.num_participants()))
            self._set_leader(manager.participating_rank() == 0)
            if committed:
                offset = 0
                for grad in grads:
                    grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
            else:
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        param.grad = None  # torch optimizers skip a parameter without a gradient
            return result

        output = super().optimizer_step(optimizer, ft_closure, model, **kwargs)
        if self.max_steps is not None and manager.current_step() >= self.max_steps:
            self._module.trainer.should_stop = True
        return output

    def _await_groups(self, manager: Any, start: int) -> None:
        """The job's first step: ask for quorums until every replica group is in one (or ``start_timeout``).

        A group that is restarted into a running job receives a peer's state in its first quorum (its step
        moves on): it does not wait. Every group at the job's first step leaves with the same quorum.
        """
        self._started = True
        began = time.monotonic()
        expected = self.num_replica_groups
        while self._start_timeout is not None:
            present = int(manager.num_participants())  # waits for this step's quorum
            if present >= expected or int(manager.current_step()) != start:
                break
            waited = time.monotonic() - began
            if waited > self._start_timeout.total_seconds():
                raise FTConfigError(
                    f"ft_ddp: only {present} of num_replica_groups={expected} replica groups joined the job's first "
                    f"quorum within start_timeout={self._start_timeout.total_seconds():g} s. Start the missing "
                    f"groups (`{_ft_env.RUN_HINT}`), lower num_replica_groups ({_ft_env.NUM_REPLICAS_VAR}), or pass "
                    "start_timeout=0 to start with the groups present."
                )
            time.sleep(0.02)
            manager.start_quorum()  # the same gradients; the lighthouse adds the groups that joined meanwhile
        if int(manager.current_step()) == start:
            self._set_leader(manager.participating_rank() == 0)
            rank_zero_info(
                f"ft_ddp: the job's step {start} starts with {manager.num_participants()} of {expected} replica "
                f"groups (waited {time.monotonic() - began:.1f} s for them; start_timeout="
                f"{0 if self._start_timeout is None else self._start_timeout.total_seconds():g} s)."
            )

    @staticmethod
    def _gradients(optimizer: Any) -> list[torch.Tensor]:
        """The gradient of every parameter the optimizer steps (zeros where none: every group sends one layout)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        return [param.grad for param in params]

    def _reduce_and_commit(self, flat: torch.Tensor) -> tuple[bool, bool]:
        """One fault-tolerant all-reduce (the mean over the quorum), then torchft's commit decision.

        Returns whether the step commits, and whether this group's gradients counted (``False`` while it
        recovers: torchft zeroes them, and the peer's state is applied in ``should_commit``).
        """
        manager = self._manager
        if manager.errored() is None:
            manager.wait_quorum()  # as allreduce does first: the limit learns from the all-reduce alone
        began = time.monotonic()
        done = manager.allreduce(flat).wait()  # on an error torchft reports it and the step does not commit
        if done and manager.errored() is None:  # not torchft's stand-in for an all-reduce it did not issue
            self.allreduce_limit.observe(time.monotonic() - began)
        if manager.errored() is not None and self._pg is not None:
            # A peer died mid-collective. Only its neighbours in gloo's ring see the error; the others
            # would wait in the collective until the timeout. Aborting closes this group's connections,
            # so every survivor fails the step now and meets at the next quorum (which reconfigures).
            self._pg.abort()
        participating = bool(manager.is_participating())
        return bool(manager.should_commit()), participating

    def _set_leader(self, leader: bool) -> None:
        if self._leader and not leader:
            # Leadership moves to another group: what this group's loggers hold in memory (a CSVLogger
            # writes every 100 steps) is written now, while they still act (``save`` is rank-zero only),
            # so no logged step is lost and none is logged twice.
            try:
                loggers = list(self._module.trainer.loggers)
            except RuntimeError:  # pragma: no cover - no Trainer attached
                loggers = []
            for logger in loggers:
                logger.save()
        self._leader = leader
        # what Lightning's own strategies set at setup (DDPStrategy.set_world_ranks), here at every quorum
        for function in (rank_zero_only, fabric_rank_zero_only):
            setattr(function, "rank", 0 if leader else 1)  # noqa: B010 - a function attribute mypy does not know

    # --------------------------------------------------------------------------------- tear down
    @override
    def teardown(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            self._last_step = int(manager.current_step())
            manager.shutdown(wait=False)
        self._store = None
        super().teardown()
