"""The host under a node's cluster agent: everything the agent asks of the machine it runs on — which
driver is loaded, which pods' processes hold a GPU, the answer to a rollout's preflight, the node
transaction, the boot — in one place, so that the agent itself only decides and speaks Kubernetes.

`LocalHost` is the daemon's: the step context of its root and the reconcile pass (the node
transaction path, lock, journal and rollback). The simulated fleet gives its nodes another host with
the same methods (driverd.sim.timedhost: a node's work as wall-clock time), so the agent's decisions
and API traffic are the daemon's own either way.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class NodeHost(Protocol):
    def loaded(self, cfg) -> dict | None:
        """{"version", "flavor"} of the driver loaded now, None without one."""

    def gpu_users(self, cfg) -> dict[str, str]:
        """pod UID -> why it counts (one of its processes holds /dev/nvidia*)."""

    def preflight(self, cfg, key: str, driver: str, flavor: str, *, leaving: set[str],
                  staying: dict[str, str]) -> dict:
        """This node's answer to rollout `key` (driverd.apply.preflight.preflight's shape)."""

    def transact(self, cfg):
        """The node transaction to `cfg`'s driver: a driverd.apply.reconcile.Result."""

    def boot_id(self, cfg) -> str:
        """This boot's id ("" when the host cannot tell)."""


class LocalHost:
    """The host driverd runs on, through `make_context` (cfg -> StepContext of its root)."""

    def __init__(self, make_context: Callable, reconciler) -> None:
        self.make_context, self.reconciler = make_context, reconciler

    def loaded(self, cfg) -> dict | None:
        from driverd.driver.state import DriverState
        got = DriverState.of(self.make_context(cfg)).loaded()
        return got.as_dict() if got else None

    def gpu_users(self, cfg) -> dict[str, str]:
        from driverd.cluster.gpuusers import host_users
        return host_users(self.make_context(cfg).root)

    def preflight(self, cfg, key: str, driver: str, flavor: str, *, leaving: set[str],
                  staying: dict[str, str]) -> dict:
        from driverd.apply.preflight import preflight
        return preflight(self.make_context, cfg, key, driver, flavor, leaving=leaving, staying=staying)

    def transact(self, cfg):
        return self.reconciler.reconcile(cfg)

    def boot_id(self, cfg) -> str:
        from driverd.apply.hostview import boot_id
        return boot_id(self.make_context(cfg)) or ""
