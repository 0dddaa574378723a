"""The daemon inside a cluster: it runs this node's rollout agent and is a candidate coordinator
(driverd.cluster), and once cluster mode is on it never changes the node's driver outside admission:

- while the node is in a rollout (admitted … done) the wanted driver is the rollout's target;
- after a failed upgrade it is the driver that ran when it failed (`driverd.io/pinned-driver`: what
  the rollback restored, or the new driver when it loaded but the node did not become Ready);
- otherwise it is the driver the host has (loaded, or last converged to before a reboot): a changed
  desired driver — its pool's, or `driver.version` of the configuration — waits for a rollout;
- only a joining node (no driver loaded, none ever converged to, none installed) installs its
  desired driver directly (driverd/cluster/desired.py says why that is safe).

The same holds for every other driver setting (config.DRIVER_SETTINGS: module parameters, the module
set, the user-space, the GPU daemons, the unload policy): a node keeps the settings it last converged
with (recorded with each converge, apply/fingerprint.py), and the daemon's own passes never reload for
a parameter that differs. A changed desired setting waits for a rollout (preflight answers `needed`,
the node's transaction applies it, drained); the node says what waits (`driverd.io/waiting`, `driverd
status`).

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


def api_target(cfg, root, target=None):
    """Where the API is: `target`, else cluster.kubeconfig (a host path under the root), else the pod's
    service account. The daemon runs as root: its kubeconfig's exec plugin, auth-provider or tokenFile
    only when the configuration says so (the kubeconfig and the files it names are checked by
    cluster/kube.py)."""
    from driverd.cluster.kube import Target
    if target is None:
        kc = cfg["cluster.kubeconfig"]
        target = Target(kubeconfig=str(root.real(kc)) if kc and not root.is_slash else kc,
                        in_cluster=None if kc else bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or None)
    return dataclasses.replace(target, allow_exec=bool(cfg["cluster.allow_exec_credentials"]))


def lease_namespace(cfg, namespace: str | None = None) -> str:
    """The coordination Lease's namespace: `namespace` given, $POD_NAMESPACE (the pod's own), else
    cluster.namespace."""
    return namespace or os.environ.get("POD_NAMESPACE") or cfg["cluster.namespace"]


def until_terminated(start: Callable[[], object], close: Callable[[], object]) -> int:
    """Run a cluster part (`driverd cluster agent`, `driverd cluster coordinator`) until SIGTERM or
    SIGINT, then close it; 0."""
    import signal
    done = threading.Event()

    def stop(signum, frame):
        done.set()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    start()
    while not done.wait(1.0):
        pass
    close()
    return 0


def node_name(cfg, root=None) -> str:
    """This node's Kubernetes name: cluster.node_name, $NODE_NAME, what the host's cluster-mode daemon
    calls it, the hostname."""
    if cfg["cluster.node_name"] or os.environ.get("NODE_NAME"):
        return cfg["cluster.node_name"] or os.environ["NODE_NAME"]
    if root is not None:
        from driverd.apply import statefile
        node = ((statefile.read(root) or {}).get("cluster") or {}).get("node")
        if isinstance(node, str) and node:
            return node
    return socket.gethostname()


def owner(cfg, root) -> str | None:
    """Why the cluster owns this host's driver — then only a DriverRollout changes it — or None: the
    configuration puts driverd in cluster mode, or the host's daemon (a systemd service, the driver
    container) runs in cluster mode now."""
    if wanted(cfg, root):
        how = "cluster.kubeconfig is set" if cfg["cluster.kubeconfig"] else "it runs in a pod" \
            if cfg["cluster.enabled"] == "auto" else "cluster.enabled = true"
        return f"this configuration puts driverd in cluster mode ({how})"
    from driverd.apply import statefile
    st = statefile.read(root) or {}
    cl = st.get("cluster")
    if isinstance(cl, dict) and cl.get("node") and not st.get("stopped"):
        return f"driverd's {st.get('mode') or 'daemon'} on this host runs in cluster mode as node {cl['node']} " \
               f"({statefile.PATH})"
    return None


def refuse_outside_rollout(cfg, root, command: str, *, force: bool, reason: str | None) -> str | None:
    """`driverd <command>` on a host whose driver the cluster owns: refused (ClusterError, one line with
    the rollout that does it) unless forced with a reason; the forced reason back (None: not owned)."""
    from driverd.errors import ClusterError, UsageError
    why = owner(cfg, root)
    if why is None:
        return None
    node = node_name(cfg, root)
    if force and reason and reason.strip():
        return reason.strip()
    if force:
        raise UsageError(f"driverd {command} --force needs --reason", cause="a change made outside a DriverRollout "
                         "on a cluster node is recorded with its reason (an Event on the Node)",
                         fix=f"driverd {command} --force --reason 'WHY'")
    raise ClusterError(f"driverd {command}: the cluster owns node {node}'s driver: {why}",
                       cause="a change outside a DriverRollout skips its cordon, drain, canary and failure budget, "
                       "and the daemon's next pass would undo it",
                       fix=f"kubectl driverd rollout start --driver VERSION --selector kubernetes.io/hostname={node} "
                       f"(or, knowingly: driverd {command} --force --reason 'WHY', recorded as an Event on the Node)")


def record_forced(cfg, root, command: str, reason: str, outcome: str) -> str | None:
    """An Event on the Node for a change forced outside a rollout; a warning back when it could not be
    written (the change is made either way: the operator asked for it)."""
    from driverd.errors import DriverdError
    node = node_name(cfg, root)
    try:
        from driverd.cluster import events
        from driverd.cluster.kube import Kube, node_path
        kube = Kube(api_target(cfg, root), retry_for_s=5, fail_fast=True)
        # a node's daemon lists its Node (RBAC grants list and watch of nodes, not get)
        items = kube.list(node_path(), fields=f"metadata.name={node}").get("items") or []
        uid = ((items[0] if items else {}).get("metadata") or {}).get("uid")
        said: list[str] = []
        events.record(kube, {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}, "ManualDriverChange",
                      f"driverd {command} --force outside a DriverRollout ({outcome}): {reason}", warning=True,
                      instance=node, log=said.append)
        return said[0] if said else None
    except (DriverdError, OSError) as e:
        return f"the forced change could not be recorded as an Event on node {node}: " + \
            (e.one_line() if isinstance(e, DriverdError) else str(e))


class ClusterMode:
    def __init__(self, cfg, root, make_context: Callable, log: Callable[[str], None], *, target=None,
                 node: str | None = None, namespace: str | None = None) -> None:
        """target: where the API is (default: cluster.kubeconfig, a host path under the root, else the
        pod's service account); node, namespace: override the configuration and environment."""
        from driverd.cluster.agent import NodeAgent
        from driverd.cluster.coordinator import Coordinator
        from driverd.cluster.kube import Kube
        target = api_target(cfg, root, target)
        self.node = node or node_name(cfg)
        ns = lease_namespace(cfg, namespace)
        self.kube = Kube(target)
        self.make_context = make_context
        self.agent = NodeAgent(self.kube, self.node, make_context=make_context, cfg=cfg, log=log, namespace=ns)
        # what the last pass kept, for the daemon's state file (driverd status) and the node's annotation
        self.pinned: dict | None = None
        # cluster.coordinate = false: a `driverd cluster coordinator` of its own identity coordinates (issue 44)
        self.coordinator = Coordinator(self.kube, self.node, ns, rollouts=self.agent.rollouts, pools=self.agent.pools,
                                       log=log) if cfg["cluster.coordinate"] else None
        self.log = log
        self._said_behind = ""
        self._said_waiting = ""
        self._said: set[str] = set()
        self.threads = [threading.Thread(target=self.agent.run, name="cluster-agent", daemon=True)]
        if self.coordinator is not None:
            self.threads.append(threading.Thread(target=self.coordinator.run, name="cluster-coordinator", daemon=True))
        log(f"driverd: cluster mode: node {self.node}, API {self.kube.host}, " +
            (f"Lease {ns}/driverd-rollout" if self.coordinator is not None else
             "this node's side of rollouts only (cluster.coordinate = false: `driverd cluster coordinator` coordinates)"))

    def start(self) -> ClusterMode:
        for t in self.threads:
            t.start()
        return self

    def use(self, cfg) -> None:
        """A re-read configuration reaches the agent's next transaction."""
        self.agent.cfg = cfg

    def keep(self, cfg):
        """(the configuration this pass reconciles to, why it holds instead): the driver as rollouts
        left it, the one the host has, or — joining — its desired one (cluster/desired.py); with the
        driver settings of the node's last converge, unless it is joining."""
        from driverd.apply import fingerprint as fpr
        from driverd.apply.preflight import driver_config
        from driverd.cluster import desired as dz
        from driverd.cluster.model import WAITING_SETTINGS
        from driverd.config import keep_settings
        from driverd.errors import DriverdError
        node = self.agent.nodes.get(self.node)
        ann = ((node or {}).get("metadata") or {}).get("annotations") or {}
        want = self.desired(cfg, node) if node is not None else dz.Desired(
            None, "", "the cluster", why=f"node {self.node} is not known to the API server yet (or not read yet)")
        k = dz.pinned(ann) or dz.keep(ann, self.have(cfg), want)
        if k.hold:
            self.pinned = {"node": self.node, "hold": k.hold}
            return cfg, k.hold
        said = f"{k.version}:{k.behind}:{k.joining}"
        if (k.behind or k.joining) and said != self._said_behind:      # said once per decision, not every pass
            self._said_behind = said
            self.log(f"driverd: node {self.node} installs {k.version} at once, {k.source}" if k.joining else
                     f"driverd: node {self.node} keeps its driver {k.version}: {k.source}")
        behind = want.driver if want.version and k.version and want.version != k.version else ""
        kept, waiting = cfg, [f"driver {behind} ({want.source})"] if behind else []
        recorded = None if k.joining else fpr.recorded_settings(fpr.read(self.make_context(cfg).root, cfg))
        if recorded:
            try:
                kept, changed = keep_settings(cfg, recorded, f"node {self.node}: its last converge")
                if changed:
                    waiting.append(WAITING_SETTINGS + "; ".join(changed))
            except DriverdError as e:         # a damaged record: the configuration as it is, said once
                self._say_once(f"driverd: node {self.node}: the recorded settings of its last converge are "
                               f"unusable ({e.one_line()}); the configuration's apply")
        if k.version:
            kept = driver_config(kept, k.version, k.flavor, source=f"node {self.node}: {k.source}")
        said = "; ".join(waiting)
        if said and said != self._said_waiting:
            self.log(f"driverd: node {self.node} waits for a DriverRollout to apply: {said}")
        self._said_waiting = said
        self.pinned = {"node": self.node, "driver": f"{kept['driver.version']}/{kept['driver.flavor']}"
                       if kept["driver.version"] else None, "source": k.source, "joining": k.joining,
                       "settings": kept.driver_settings(), "waiting": waiting}
        self.agent.set_waiting(said)
        return kept, ""

    def _say_once(self, msg: str) -> None:
        if msg not in self._said:
            self._said.add(msg)
            self.log(msg)

    def have(self, cfg) -> dict | None:
        """The driver the host has: loaded, last converged to, or installed (desired.present)."""
        from driverd.driver.state import DriverState
        sctx = self.make_context(cfg)
        has = DriverState.from_config(sctx.root, cfg, sctx.kernel.release).has()
        return has.as_dict() if has else None

    def desired(self, cfg, node: dict):
        """The driver the cluster declares for this node: its DriverPool's; in no pool, `driver.version`
        of its configuration (cluster/pools.py). Unknown until the pools have been read."""
        from driverd.cluster import desired as dz
        from driverd.cluster import pools as pl
        if not self.agent.pools.synced.is_set():
            return dz.Desired(None, "", "the cluster", why="the DriverPools are not read yet")
        labels = (node.get("metadata") or {}).get("labels") or {}
        return pl.desired_for(labels, self.agent.pool_list(), cfg["driver.version"], cfg["driver.flavor"] or "auto")

    def busy(self) -> bool:
        """The node is mid-upgrade: the agent's transaction owns the host; the daemon waits."""
        from driverd.cluster import model as m
        node = self.agent.nodes.get(self.node)
        return ((node or {}).get("metadata", {}).get("annotations") or {}).get(m.A_STATE) in m.ACTIVE

    def close(self) -> None:
        self.agent.close()
        if self.coordinator is not None:
            self.coordinator.close()
        for t in self.threads:
            t.join(timeout=3)


class PinnedReconciler:
    """The daemon's reconciler in cluster mode: the driver as rollouts left it, and no reconcile of
    its own while the agent is upgrading the node."""

    def __init__(self, inner, cluster: ClusterMode) -> None:
        self.inner, self.cluster = inner, cluster
        inner.reload_drift = False          # only a rollout (drained) reloads a driver in a cluster

    def reconcile(self, cfg):
        import time

        from driverd.apply.reconcile import Result
        self.cluster.use(cfg)
        now = time.time()
        if self.cluster.busy():
            return Result("blocked", "the node is being upgraded by a DriverRollout (see `kubectl driverd nodes`)",
                          failure="rollout", started=now, finished=now, pinned=self.cluster.pinned)
        kept, hold = self.cluster.keep(cfg)
        if hold:
            return Result("blocked", hold, failure="cluster", started=now, finished=now,
                          pinned=self.cluster.pinned)
        res = self.inner.reconcile(kept)
        res.pinned = self.cluster.pinned
        if res.converged and res.loaded and res.changed:
            self.cluster.agent.relabel()
        self.cluster.agent.set_kernels(getattr(res, "kernels", None))
        if res.workload is not None:            # GPUDriverReady follows it without waiting for a Node event
            self.cluster.agent.set_workload(bool(res.workload.get("ok")), res.reason if not res.converged else "")
        return res
