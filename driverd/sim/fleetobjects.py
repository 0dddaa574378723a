"""What a simulated fleet (driverd.sim.fleet) keeps on the API server: namespaces, the CRDs, the
Nodes as a kubelet reports them, the GPU pods with their ReplicaSets and PodDisruptionBudgets, the
device plugin's DaemonSet; the faults the API shows (budgets, pods without a controller, a pod stuck
Terminating, a node NotReady); waiting for the budgets, and taking it all away again."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from driverd.sim.fleethosts import SimNode
from driverd.sim.scenario import RELEASE
from driverd.sim.standins import HOLD, PLUGIN, PLUGIN_NS, _report_running


class FleetConflict(Exception):
    """An exclusive fleet met an object of one of its names that is not its own (it lacks the fleet's
    labels): taking it over would change, and at the end delete, what somebody else made."""

    def __init__(self, kind: str, name: str, labels: dict) -> None:
        self.kind, self.name = kind, name
        self.selector = ",".join(f"{k}={v}" for k, v in labels.items())
        super().__init__(f"{kind} {name} exists and is not this fleet's (it lacks {self.selector})")


class FleetObjects:
    """Fleet's API side (a mixin: Fleet sets these attributes in its __init__)."""
    admin: Any
    nodes: dict[str, SimNode]
    gpu_pods: int
    gpu_namespaces: list[str]
    gpu_processes: bool
    device_plugin: bool
    labels: dict
    exclusive: bool
    _ensure_process: Callable[[str, str, str, str], None]
    stop: Callable[[], None]

    def gpu_ns(self, node: str) -> str:
        """The namespace of the node's GPU pods."""
        if len(self.gpu_namespaces) == 1:
            return self.gpu_namespaces[0]
        return self.gpu_namespaces[int(node.rsplit("-", 1)[1]) % len(self.gpu_namespaces)]

    # -- the objects -------------------------------------------------------------------------------
    def _own(self) -> dict | None:
        """The labels an existing object must carry to be taken over; None: any is (not exclusive)."""
        return self.labels if self.exclusive else None

    def _node_object(self, name: str, labels: dict) -> None:
        from driverd.cluster.kube import node_path
        k = self.admin
        _ensure(k, node_path(), own=self._own(), obj={
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true",
                                                  "feature.node.kubernetes.io/pci-10de.present": "true",
                                                  **self.labels, **labels}},
            "spec": {}})
        # what the kubelet reports (a create drops status: it is written through the subresource)
        k.patch(node_path(name) + "/status", {"status": {
            "conditions": [_ready_condition(True)],
            "nodeInfo": {"kernelVersion": RELEASE, "kubeletVersion": "v1.31.0", "machineID": "", "systemUUID": "",
                         "bootID": "", "osImage": "", "containerRuntimeVersion": "", "kubeProxyVersion": "",
                         "operatingSystem": "linux", "architecture": "amd64"},
            "capacity": {"nvidia.com/gpu": "8", "cpu": "64", "memory": "512Gi", "pods": "110"},
            "allocatable": {"nvidia.com/gpu": "8", "cpu": "64", "memory": "512Gi", "pods": "110"}}},
            kind="strategic")

    def _api_objects(self) -> dict[tuple[str, str], str]:
        """Namespaces, the CRD, Nodes (their status as a kubelet reports it), the GPU pods with their
        ReplicaSets and PDBs, the device plugin's DaemonSet. Returns {(node, pod): pod uid}."""
        from driverd.cluster.kube import node_path
        k = self.admin
        namespaces = (*self.gpu_namespaces, "driverd", "default") + ((PLUGIN_NS,) if self.device_plugin else ())
        for ns in namespaces:
            _ensure(k, "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        for crd in ("driverrollouts", "driverpools"):
            _ensure(k, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", _crd(crd))
            _wait_crd(k, crd)
        for ns in (*self.gpu_namespaces, PLUGIN_NS) if self.device_plugin else self.gpu_namespaces:
            # the pods' account (a cluster's ServiceAccount controller creates it; made here so as not to wait)
            _ensure(k, f"/api/v1/namespaces/{ns}/serviceaccounts",
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})
        if self.exclusive:
            # every name checked before anything is made: a refused fleet leaves nothing of its own behind
            # (the check at each create still catches a Node made in between)
            for name in self.nodes:
                have = k.find(node_path(name))
                if have is not None and not _carries(have, self.labels):
                    raise FleetConflict("Node", name, self.labels)
        uids: dict[tuple[str, str], str] = {}
        for name in self.nodes:
            self._node_object(name, {})
            for j in range(self.gpu_pods):
                pod = f"train-{name}-{j}"
                uids[(name, pod)] = self._gpu_pod(name, j)
                ns = self.gpu_ns(name)
                _ensure(k, f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", own=self._own(), obj={
                    "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": {"name": f"{pod}-pdb", "namespace": ns, "labels": dict(self.labels)},
                    "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": pod}}}})
        if self.device_plugin:
            _ensure(k, f"/apis/apps/v1/namespaces/{PLUGIN_NS}/daemonsets", own=self._own(), obj={
                "apiVersion": "apps/v1", "kind": "DaemonSet",
                "metadata": {"name": PLUGIN, "namespace": PLUGIN_NS, "labels": dict(self.labels)},
                "spec": {"selector": {"matchLabels": {"app": PLUGIN}},
                         "template": {"metadata": {"labels": {"app": PLUGIN}},
                                      "spec": {"nodeSelector": {"driverd.io/driver-ready": "true"},
                                               "containers": [{"name": "plugin", "image": "device-plugin:1"}]}}}})
        return uids

    def _gpu_pod(self, node: str, j: int) -> str:
        """The node's j-th GPU pod, a ReplicaSet's, Running (created unless it exists): its uid."""
        pod, ns = f"train-{node}-{j}", self.gpu_ns(node)
        rs = _ensure(self.admin, f"/apis/apps/v1/namespaces/{ns}/replicasets", own=self._own(), obj={
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": pod, "namespace": ns, "labels": dict(self.labels)},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": pod}},
                     "template": {"metadata": {"labels": {"app": pod, **self.labels}},
                                  "spec": {"containers": [{"name": "main", "image": "train:1"}]}}}})
        return self.running_pod(ns, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": ns, "labels": {"app": pod, **self.labels},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": pod,
                                              "uid": rs["metadata"]["uid"], "controller": True}]},
            "spec": {"nodeName": node, "automountServiceAccountToken": False,
                     "containers": [{"name": "main", "image": "train:1",
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})

    def workloads_back(self, nodes=None) -> int:
        """Every GPU pod a drain took away comes back on its node, with its process (what the
        ReplicaSet controller and the scheduler do once the nodes are schedulable again; neither runs
        here, so an evicted pod stays gone until this). The number of pods made again."""
        from driverd.cluster.kube import pods_path
        have = {p["metadata"]["name"] for ns in self.gpu_namespaces
                for p in self.admin.list(pods_path(ns)).get("items") or [] if not p["metadata"].get("deletionTimestamp")}
        made = 0
        for name in nodes or self.nodes:
            for j in range(self.gpu_pods):
                if f"train-{name}-{j}" not in have:
                    uid = self._gpu_pod(name, j)
                    if self.gpu_processes:
                        self._ensure_process(name, uid, "python", "/dev/nvidia0")
                    made += 1
        return made

    def running_pod(self, namespace: str, pod: dict, kube=None) -> str:
        """Create `pod` (bound to its node) unless it exists, and report it Running and Ready as the
        kubelet would once its containers run (the disruption controller counts Ready pods). Its uid."""
        from driverd.cluster.kube import pods_path
        k = kube or self.admin
        obj = _ensure(k, pods_path(namespace), pod, own=self._own())
        if (obj.get("status") or {}).get("phase") != "Running":
            _report_running(k, namespace, pod["metadata"]["name"])
        return obj["metadata"]["uid"]

    # -- faults ------------------------------------------------------------------------------------
    def set_pdb(self, name: str, max_unavailable: int) -> None:
        """Let the PDBs guarding the node's GPU pods (one pod each) allow `max_unavailable` disruptions."""
        for j in range(self.gpu_pods):
            self.admin.patch(f"/apis/policy/v1/namespaces/{self.gpu_ns(name)}/poddisruptionbudgets/train-{name}-{j}-pdb",
                             {"spec": {"maxUnavailable": max_unavailable}})

    def pdb_never(self, name: str) -> None:
        """Every PDB of the node's GPU pods forbids any disruption."""
        self.set_pdb(name, 0)

    def no_controller(self, name: str, process: bool = True) -> str:
        """A GPU pod on the node that nothing would recreate (no ownerReferences), with its process
        unless `process` is false (a pod that holds no device right now)."""
        pod = f"solo-{name}"
        ns = self.gpu_ns(name)
        uid = self.running_pod(ns, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": ns, "labels": {"app": pod}},
            "spec": {"nodeName": name, "automountServiceAccountToken": False,
                     "containers": [{"name": "main", "image": "notebook:1",
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
        if self.gpu_processes and process:
            self._ensure_process(name, uid, "jupyter", "/dev/nvidia0")
        return pod

    def two_pdbs(self, name: str) -> None:
        """A second PodDisruptionBudget over the node's first GPU pod: the Eviction API answers 500."""
        pod = f"train-{name}-0"
        ns = self.gpu_ns(name)
        _ensure(self.admin, f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": f"{pod}-pdb2", "namespace": ns},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": pod}}}})

    def stuck_terminating(self, name: str) -> None:
        """The node's first GPU pod carries a finalizer nobody removes: once deleted it stays Terminating."""
        from driverd.cluster.kube import pods_path
        self.admin.patch(pods_path(self.gpu_ns(name), f"train-{name}-0"), {"metadata": {"finalizers": [HOLD]}})

    def set_ready(self, name: str, ready: bool, since: float | None = None) -> None:
        """The node's Ready condition (what the kubelet / node lifecycle controller write), changed
        at `since` (default now)."""
        from driverd.cluster.kube import node_path
        self.admin.patch(node_path(name) + "/status", {"status": {"conditions": [_ready_condition(ready, since)]}},
                         kind="strategic")

    # -- waiting, and taking it away --------------------------------------------------------------
    def remove(self, rollouts: tuple[str, ...] = ()) -> list[str]:
        """Delete what the fleet made on the API server: `rollouts` first (while the daemons still run, so
        that the coordinator gives their nodes back and drops the finalizer), then, with the daemons
        stopped, the GPU pods, their ReplicaSets and PodDisruptionBudgets, the device plugin's DaemonSet
        and the Nodes. Namespaces and CRDs stay (a cluster may have had them before). An exclusive
        fleet deletes only what carries its labels (a rollout too: its maker labels it once it made it),
        each object by its uid, so that an object of the same name someone else made is never deleted.
        What could not be deleted, in words."""
        from driverd.cluster.kube import KubeError, node_path, rollout_path
        k, left = self.admin, []

        def delete(path: str, now: bool = False) -> bool:
            opts: dict = {}
            if now:     # a pod on a node no kubelet serves would stay Terminating: deleted at once
                opts["gracePeriodSeconds"] = 0
            try:
                if self.exclusive:
                    have = k.find(path)
                    if have is None or not _carries(have, self.labels):
                        return False
                    opts["preconditions"] = {"uid": have["metadata"]["uid"]}
                if opts:
                    k.request("DELETE", path, body={"apiVersion": "v1", "kind": "DeleteOptions", **opts})
                else:
                    k.delete(path)
                return True
            except KubeError as e:
                if not e.not_found:
                    left.append(f"{path}: {e.one_line()}")
                return False
        deleted = [name for name in rollouts if delete(rollout_path(name))]
        for name in deleted:
            if not self.wait(lambda: not _exists(k, rollout_path(name)), 30):
                try:        # no coordinator finished it: the finalizer goes with the demo
                    k.patch(rollout_path(name), {"metadata": {"finalizers": None}})
                except KubeError as e:
                    if not e.not_found:
                        left.append(f"rollout {name}: {e.one_line()}")
        self.stop()
        for node in self.nodes:
            ns = self.gpu_ns(node)
            for j in range(self.gpu_pods):
                pod = f"train-{node}-{j}"
                delete(f"/apis/apps/v1/namespaces/{ns}/replicasets/{pod}")
                delete(f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{pod}-pdb")
                delete(f"/api/v1/namespaces/{ns}/pods/{pod}", now=True)
        if self.device_plugin:
            delete(f"/apis/apps/v1/namespaces/{PLUGIN_NS}/daemonsets/{PLUGIN}")
        for node in self.nodes:
            delete(node_path(node))
        return left

    def wait(self, predicate, timeout: float, step: float = 0.2) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(step)
        return predicate()

    def wait_budgets(self, timeout: float = 600, skip: set[str] = frozenset()) -> bool:
        """Whether every GPU pod's PodDisruptionBudget came to allow its eviction within `timeout`: the
        disruption controller has counted the pods created or come back (until then the Eviction API
        answers 429, as after a restart of the API server, whose controllers re-list). The budgets of
        the nodes in `skip` (a fault's: pdb-never allows nothing) are not waited for."""
        def ours(p: dict) -> bool:
            return not any(f"-{node}-" in p["metadata"]["name"] for node in skip)

        def allowed() -> bool:
            pdbs = [p for ns in self.gpu_namespaces
                    for p in self.admin.list(f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets").get("items") or []]
            return all(((p.get("status") or {}).get("disruptionsAllowed") or 0) >= 1 for p in pdbs if ours(p))
        return self.wait(allowed, timeout=timeout, step=1.0)


def _ready_condition(ready: bool, since: float | None = None) -> dict:
    from driverd.cluster.kube import now_rfc3339
    when = now_rfc3339(time.time() if since is None else since)
    return {"type": "Ready", "status": "True" if ready else "False",
            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
            "lastHeartbeatTime": now_rfc3339(), "lastTransitionTime": when}


def _ensure(kube, collection: str, obj: dict, own: dict | None = None) -> dict:
    """Create obj unless it exists (a rebuilt fleet on the same server): the object as stored. With
    `own`, an existing object is taken only if it carries those labels, else FleetConflict. A
    namespace's `default` ServiceAccount may appear a moment after the namespace: retried until it does."""
    from driverd.cluster.kube import KubeError
    end = time.monotonic() + 30
    while True:
        try:
            return kube.create(collection, obj)
        except KubeError as e:
            if e.status == 409:
                have = kube.get(f"{collection}/{obj['metadata']['name']}")
                if own is not None and not _carries(have, own):
                    raise FleetConflict(obj["kind"], obj["metadata"]["name"], own) from None
                return have
            if e.status == 403 and "serviceaccount" in e.api_message.lower() and time.monotonic() < end:
                time.sleep(0.2)
                continue
            raise


def _carries(obj: dict, labels: dict) -> bool:
    have = obj["metadata"].get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def _wait_crd(kube, plural: str = "driverrollouts", timeout: float = 30) -> None:
    """A driverd CRD serves once Established."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        crd = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{plural}.driverd.io")
        if any(c.get("type") == "Established" and c.get("status") == "True"
               for c in (crd.get("status") or {}).get("conditions") or []):
            return
        time.sleep(0.1)


def _crd(plural: str = "driverrollouts") -> dict:
    # Package data (the same bytes as deploy/base/crd-<kind>.yaml, kept so by tests/test_deploy.py):
    # an installed wheel has no deploy/ directory.
    from importlib import resources

    import yaml
    return yaml.safe_load(resources.files("driverd.data").joinpath(f"crd-{plural[:-1]}.yaml").read_text())


def _exists(k, path: str) -> bool:
    from driverd.cluster.kube import KubeError
    try:
        k.get(path)
        return True
    except KubeError as e:
        if e.not_found:
            return False
        raise
