"""The coordinator on its own (`driverd cluster coordinator`): the rollout Lease, the admissions and
the rollouts' and pools' status, in a process that runs no node's driver and holds no GPU node's
identity (issue 44). A GPU node's daemon runs only its own node's side (cluster.coordinate = false);
the coordinator runs in the cluster as its own Deployment and ServiceAccount (deploy/base/
coordinator.yaml), so that a compromised GPU node cannot become the one writer that admits nodes.

It watches what a node daemon's coordinator watches — every Node (while it holds the Lease), every
DriverRollout and DriverPool — and wakes on each change of them."""
from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

from driverd.cluster.coordinator import Coordinator
from driverd.cluster.informer import Informer
from driverd.cluster.kube import Kube, pool_path, rollout_path
from driverd.cluster.lease import LEASE_DURATION_S


def identity() -> str:
    """Who holds the Lease: the pod's name (the Deployment's, from the downward API), else the host's."""
    return os.environ.get("POD_NAME") or socket.gethostname()


class CoordinatorProcess:
    def __init__(self, kube: Kube, name: str, namespace: str, log: Callable[[str], None], *,
                 lease_s: int = LEASE_DURATION_S) -> None:
        self.coordinator: Coordinator | None = None
        self.rollouts = Informer(kube, rollout_path(), name="rollouts", on_change=self._changed, log=log)
        # a cluster without the DriverPool CRD has no pools
        self.pools = Informer(kube, pool_path(), name="pools", on_change=self._changed, log=log, missing_ok=True)
        self.coordinator = Coordinator(kube, name, namespace, rollouts=self.rollouts, pools=self.pools, log=log,
                                       lease_s=lease_s)
        self.thread = threading.Thread(target=self.coordinator.run, name="cluster-coordinator", daemon=True)

    def _changed(self, kind: str, obj: dict) -> None:
        if self.coordinator is not None:
            self.coordinator.wake.set()

    def start(self) -> CoordinatorProcess:
        self.rollouts.start()
        self.pools.start()
        self.thread.start()
        return self

    def close(self) -> None:
        """Give the Lease up (after the pass in flight) so that another replica takes over at once."""
        assert self.coordinator is not None
        self.coordinator.close()
        self.rollouts.close()
        self.pools.close()
        self.thread.join(timeout=5)

    def kill(self) -> None:
        """As a SIGKILL leaves it (tests, the demo): no Lease release, no last writes."""
        assert self.coordinator is not None
        c = self.coordinator
        c.stop.set()
        c.lease.held_until = 0.0
        c.wake.set()
        c.lease_watch.close()
        if c.nodes:
            c.nodes.close()
        self.rollouts.close()
        self.pools.close()
