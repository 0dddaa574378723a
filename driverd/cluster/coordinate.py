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
from driverd.cluster.kube import Kube, lease_path, pool_path, rollout_path
from driverd.cluster.lease import LEASE_DURATION_S, LEASE_NAME
from driverd.errors import ClusterError


def identity() -> str:
    """Who holds the Lease: the pod's name (the Deployment's, from the downward API), else the host's."""
    return os.environ.get("POD_NAME") or socket.gethostname()


def check_access(kube: Kube, namespace: str) -> None:
    """One read of the Lease, failing fast (kube: fail_fast, a short retry): an API it cannot reach or an
    identity without the coordinator's rights is said at once, not after the informers' silent retries.
    Raises ClusterError naming the cause and its fix."""
    try:
        kube.find(lease_path(namespace, LEASE_NAME))
    except ClusterError as e:
        fix = "run it as the ServiceAccount driverd-coordinator with deploy/'s RBAC (deploy/base/rbac-coordinator.yaml)" \
            if getattr(e, "status", None) in (401, 403) else None
        raise ClusterError(f"cannot read the Lease {namespace}/{LEASE_NAME}: {e.one_line()}", fix=fix) from None


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
