"""The daemon inside a cluster: it runs this node's rollout agent and is a candidate coordinator
(driverd.cluster), and once cluster mode is on it never changes the node's driver outside admission:

- while the node is in a rollout (admitted … done) the wanted driver is the rollout's target;
- after a failed upgrade it is the driver that ran when it failed (`driverd.io/pinned-driver`: what
  the rollback restored, or the new driver when it loaded but the node did not become Ready);
- otherwise it is the driver the host has (loaded, or last converged to before a reboot): a changed
  desired driver — its pool's, or `driver.version` of the configuration — waits for a rollout;
- only a joining node (no driver loaded, none ever converged to, none installed) installs its
  desired driver directly (driverd/cluster/desired.py says why that is safe).

So the daemon's periodic reconcile never undoes a rollout, nor races one into a downgrade, nor
re-converges the fleet when the ConfigMap is edited. The Kubernetes client is imported only here,
and only when cluster mode is on.
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
        self.make_context = make_context
        self.agent = NodeAgent(self.kube, self.node, make_context=make_context, cfg=cfg, log=log)
        self.coordinator = Coordinator(self.kube, self.node, ns, rollouts=self.agent.rollouts, pools=self.agent.pools,
                                       log=log)
        self.log = log
        self._said_behind = ""
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

    def keep(self, cfg):
        """(the configuration this pass reconciles to, why it holds instead): the driver as rollouts
        left it, the one the host has, or — joining — its desired one (cluster/desired.py)."""
        from driverd.apply.preflight import driver_config
        from driverd.cluster import desired as dz
        node = self.agent.nodes.get(self.node)
        ann = ((node or {}).get("metadata") or {}).get("annotations") or {}
        k = dz.pinned(ann)
        if k is None:
            want = self.desired(cfg, node) if node is not None else dz.Desired(
                None, "", "the cluster", why=f"node {self.node} is not known to the API server yet (or not read yet)")
            k = dz.keep(ann, self.have(cfg), want)
        if k.hold:
            return cfg, k.hold
        said = f"{k.version}:{k.behind}:{k.joining}"
        if (k.behind or k.joining) and said != self._said_behind:      # said once per decision, not every pass
            self._said_behind = said
            self.log(f"driverd: node {self.node} installs {k.version} at once, {k.source}" if k.joining else
                     f"driverd: node {self.node} keeps its driver {k.version}: {k.source}")
        if not k.version:
            return cfg, ""
        return driver_config(cfg, k.version, k.flavor, source=f"node {self.node}: {k.source}"), ""

    def have(self, cfg) -> dict | None:
        """The driver the host has: loaded, last converged to, or installed (desired.present)."""
        from driverd.apply import lastdriver
        from driverd.apply import steps as st
        from driverd.cluster import desired as dz
        sctx = self.make_context(cfg)
        loaded = st.loaded(sctx)
        if loaded:
            return dz.present(loaded, None, None)
        return dz.present(None, lastdriver.read(sctx.root, cfg["state.dir"]), st.installed(sctx))

    def desired(self, cfg, node: dict):
        """The driver the cluster declares for this node: its DriverPool's; in no pool, `driver.version`
        of its configuration (cluster/pools.py). Unknown until the pools have been read."""
        from driverd.cluster import desired as dz
        from driverd.cluster import pools as pl
        if not self.agent.pools.synced.is_set():
            return dz.Desired(None, "", "the cluster", why="the DriverPools are not read yet")
        labels = (node.get("metadata") or {}).get("labels") or {}
        return pl.desired_for(labels, self.agent.pool_list(), cfg["driver.version"], cfg["driver.flavor"] or "auto")

    def converged(self, cfg, loaded: dict) -> None:
        """A pass converged with `loaded`: the host now has a driver driverd manages (lastdriver)."""
        from driverd.apply import lastdriver
        try:
            lastdriver.write(self.make_context(cfg).root, cfg["state.dir"], loaded)
        except OSError as e:         # the record only decides a later joining install; say it, go on
            self.log(f"driverd: cannot record the converged driver: {e}")

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
        now = time.time()
        if self.cluster.busy():
            return Result("blocked", "the node is being upgraded by a DriverRollout (see `kubectl driverd nodes`)",
                          failure="rollout", started=now, finished=now)
        kept, hold = self.cluster.keep(cfg)
        if hold:
            return Result("blocked", hold, failure="cluster", started=now, finished=now)
        res = self.inner.reconcile(kept)
        if res.converged and res.loaded:
            self.cluster.converged(cfg, res.loaded)
            if res.changed:
                self.cluster.agent.relabel()
        self.cluster.agent.set_kernels(getattr(res, "kernels", None))
        if res.workload is not None:            # GPUDriverReady follows it without waiting for a Node event
            self.cluster.agent.set_workload(bool(res.workload.get("ok")), res.reason if not res.converged else "")
        return res
