"""The daemon inside a cluster: it runs this node's rollout agent and is a candidate coordinator
(driverd.cluster), and it lets rollouts — not the config file — decide which driver the node runs
once the node has taken part in one:

- while the node is in a rollout (admitted … done) the wanted driver is the rollout's target;
- after a failed upgrade it is the driver that ran when it failed (`driverd.io/pinned-driver`: what
  the rollback restored, or the new driver when it loaded but the node did not become Ready);
- otherwise (never in a rollout, or given back by an abort) it is `driver.version` from the config.

So the daemon's periodic reconcile never undoes a rollout, nor races one into a downgrade. The
Kubernetes client is imported only here, and only when cluster mode is on.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import threading
from collections.abc import Callable


def wanted(cfg, root) -> bool:
    mode = cfg["cluster.enabled"]
    if mode == "auto":
        return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or bool(cfg["cluster.kubeconfig"])
    return mode == "true"


class ClusterMode:
    def __init__(self, cfg, root, make_context: Callable, log: Callable[[str], None], *, target=None,
                 node: str | None = None, namespace: str | None = None) -> None:
        """target: where the API is (default: cluster.kubeconfig, a host path under the root, else the
        pod's service account); node, namespace: override the configuration and environment."""
        from driverd.cluster.agent import NodeAgent
        from driverd.cluster.coordinator import Coordinator
        from driverd.cluster.kube import Kube, Target
        if target is None:
            kc = cfg["cluster.kubeconfig"]
            target = Target(kubeconfig=str(root.real(kc)) if kc and not root.is_slash else kc,
                            in_cluster=None if kc else bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or None)
        # The daemon runs as root: its kubeconfig's exec plugin, auth-provider or tokenFile only when the
        # configuration says so (the kubeconfig and the files it names are checked by cluster/kube.py).
        target = dataclasses.replace(target, allow_exec=bool(cfg["cluster.allow_exec_credentials"]))
        self.node = node or cfg["cluster.node_name"] or os.environ.get("NODE_NAME") or socket.gethostname()
        ns = namespace or os.environ.get("POD_NAMESPACE") or cfg["cluster.namespace"]
        self.kube = Kube(target)
        self.agent = NodeAgent(self.kube, self.node, make_context=make_context, cfg=cfg, log=log)
        self.coordinator = Coordinator(self.kube, self.node, ns, rollouts=self.agent.rollouts, log=log)
        self.threads = [threading.Thread(target=self.agent.run, name="cluster-agent", daemon=True),
                        threading.Thread(target=self.coordinator.run, name="cluster-coordinator", daemon=True)]
        log(f"driverd: cluster mode: node {self.node}, API {self.kube.host}, Lease {ns}/driverd-rollout")

    def start(self) -> ClusterMode:
        for t in self.threads:
            t.start()
        return self

    def use(self, cfg) -> None:
        """A re-read configuration reaches the agent's next transaction."""
        self.agent.cfg = cfg

    def pin(self, cfg):
        """The configuration the daemon's own reconciles use: driver.version as rollouts left it
        (the state table's `pin`: the rollout's target while it runs and after it is done; after a
        failure what ran then — the rollback's driver, or a new one that loaded but left the node
        NotReady — which only an admitted retry or a new rollout changes)."""
        from driverd.apply.preflight import driver_config
        from driverd.cluster import model as m
        from driverd.cluster import states
        node = self.agent.nodes.get(self.node)
        if node is None:
            return cfg
        ann = node["metadata"].get("annotations") or {}
        state = states.node_state(ann.get(m.A_STATE))
        if state is None or state.pin is None:
            return cfg
        version, flavor = m.split_driver(ann.get(m.A_TARGET) if state.pin == states.PIN_TARGET
                                         else ann.get(m.A_PINNED) or ann.get(m.A_PREVIOUS))
        if not version:
            return cfg
        return driver_config(cfg, version, flavor, source=f"node {self.node}'s rollout record ({state.name})")

    def busy(self) -> bool:
        """The node is mid-upgrade: the agent's transaction owns the host; the daemon waits."""
        from driverd.cluster import model as m
        node = self.agent.nodes.get(self.node)
        return ((node or {}).get("metadata", {}).get("annotations") or {}).get(m.A_STATE) in m.ACTIVE

    def close(self) -> None:
        self.agent.close()
        self.coordinator.close()
        for t in self.threads:
            t.join(timeout=3)


class PinnedReconciler:
    """The daemon's reconciler in cluster mode: the driver as rollouts left it, and no reconcile of
    its own while the agent is upgrading the node."""

    def __init__(self, inner, cluster: ClusterMode) -> None:
        self.inner, self.cluster = inner, cluster

    def reconcile(self, cfg):
        import time

        from driverd.apply.reconcile import Result
        self.cluster.use(cfg)
        if self.cluster.busy():
            now = time.time()
            return Result("blocked", "the node is being upgraded by a DriverRollout (see `kubectl driverd nodes`)",
                          failure="rollout", started=now, finished=now)
        res = self.inner.reconcile(self.cluster.pin(cfg))
        if res.workload is not None:            # GPUDriverReady follows it without waiting for a Node event
            self.cluster.agent.set_workload(bool(res.workload.get("ok")), res.reason if not res.converged else "")
        return res
