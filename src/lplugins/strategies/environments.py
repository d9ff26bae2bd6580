"""A cluster environment described by the environment variables a scheduler sets.

Most schedulers Lightning does not know differ from ``LightningEnvironment`` only in the names of
their variables. Instead of subclassing ``ClusterEnvironment``, a plugin can register::

    @lplugins.hookimpl
    def lplugins_register_cluster_environments(register):
        from lplugins.strategies.environments import VariablesEnvironment

        register(
            "acme",
            VariablesEnvironment,
            defaults={"main_address": "ACME_HEAD", "main_port": "ACME_PORT", "node_rank": "ACME_NODE_INDEX"},
            detect=lambda: "ACME_NODE_INDEX" in os.environ,
            description="Acme scheduler",
        )

and select it with ``lplugins.compose(plugins=["acme"], ...)`` (or let ``detect`` find it).
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

from lplugins._errors import LPluginsError

__all__ = ["VariablesEnvironment"]


class VariablesEnvironment(ClusterEnvironment):
    """Read the rendezvous and ranks from named environment variables.

    Args:
        main_address: Variable holding the address of the rank-0 node.
        main_port: Variable holding the rendezvous port.
        node_rank: Variable holding this node's index.
        world_size: Variable holding the total number of processes; ``None``: the Trainer's
            ``num_nodes x devices``.
        global_rank: Variable holding this process's rank; ``None``: ``node_rank x devices + local_rank``.
        local_rank: Variable holding this process's rank on its node; ``None``: 0 when the scheduler
            starts the processes, else Lightning's launcher sets ``LOCAL_RANK``.
        creates_processes_externally: Whether the scheduler starts every process (one per device).
            ``False``: it starts one per node and Lightning starts the others.

    Raises:
        LPluginsError: a variable is missing or not an integer, when it is read.

    Examples:
        >>> env = VariablesEnvironment(main_address="ACME_HEAD", main_port="ACME_PORT", node_rank="ACME_NODE")
        >>> env.main_address
        Traceback (most recent call last):
        ...
        lplugins.LPluginsError: Cluster environment VariablesEnvironment needs the environment variable ...
    """

    def __init__(
        self,
        *,
        main_address: str,
        main_port: str,
        node_rank: str,
        world_size: str | None = None,
        global_rank: str | None = None,
        local_rank: str | None = None,
        creates_processes_externally: bool = False,
    ) -> None:
        super().__init__()
        self._vars = {
            "main_address": main_address,
            "main_port": main_port,
            "node_rank": node_rank,
            "world_size": world_size,
            "global_rank": global_rank,
            "local_rank": local_rank,
        }
        self._external = creates_processes_externally
        self._world_size: int | None = None
        self._global_rank: int | None = None

    def _read(self, key: str) -> str:
        var = self._vars[key]
        assert var is not None
        value = os.environ.get(var)
        if value is None or not value.strip():
            raise LPluginsError(
                f"Cluster environment {type(self).__name__} needs the environment variable {var} ({key}), "
                "which is not set."
            )
        return value.strip()

    def _read_int(self, key: str) -> int:
        value = self._read(key)
        try:
            return int(value)
        except ValueError:
            var = self._vars[key]
            raise LPluginsError(f"Environment variable {var}={value!r} ({key}) is not an integer.") from None

    @property
    def creates_processes_externally(self) -> bool:
        """Whether the scheduler starts every process itself."""
        return self._external

    @property
    def main_address(self) -> str:
        """The rank-0 node's address."""
        return self._read("main_address")

    @property
    def main_port(self) -> int:
        """The rendezvous port."""
        return self._read_int("main_port")

    @staticmethod
    def detect() -> bool:
        """Never detected by itself: register it with ``detect=`` to detect it."""
        return False

    def world_size(self) -> int:
        """Total number of processes."""
        if self._vars["world_size"] is not None:
            return self._read_int("world_size")
        if self._world_size is None:
            raise LPluginsError("The world size is not known yet; the strategy sets it when the Trainer starts.")
        return self._world_size

    def set_world_size(self, size: int) -> None:
        """Called by the strategy with ``num_nodes x devices``."""
        self._world_size = size

    def global_rank(self) -> int:
        """This process's rank."""
        if self._vars["global_rank"] is not None:
            return self._read_int("global_rank")
        return self._global_rank if self._global_rank is not None else 0

    def set_global_rank(self, rank: int) -> None:
        """Called by the strategy with ``node_rank x devices + local_rank``."""
        self._global_rank = rank

    def local_rank(self) -> int:
        """This process's rank on its node."""
        if self._vars["local_rank"] is not None:
            return self._read_int("local_rank")
        return int(os.environ.get("LOCAL_RANK", 0))

    def node_rank(self) -> int:
        """This node's index."""
        return self._read_int("node_rank")
