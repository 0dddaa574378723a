"""The cluster components a simulated fleet (driverd.sim.fleet) plays itself, since no kubelet and
no DaemonSet controller run beside its API server: the nodes' kubelets (pods Running, a deleted
pod's processes ended and its graceful deletion confirmed) and the `nvidia-device-plugin`
DaemonSet's controller. Both act through the API (list + watch), as the real ones do."""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Protocol

PLUGIN_NS = "gpu-operator"
PLUGIN = "nvidia-device-plugin"
HOLD = "example.com/hold"          # a finalizer nobody removes (pods stuck Terminating)
CONFIRM_RETRY_S = 120              # how long a played kubelet keeps confirming a deletion while the API is away
SIM_RETRY_MAX_S = 1.0              # the played kubelets and controller are back within a second of the API server


class FleetView(Protocol):
    """What the stand-ins ask of their fleet (driverd.sim.fleet.Fleet, which imports this module)."""
    nodes: dict
    work: Path

    def running_pod(self, namespace: str, pod: dict, kube=None) -> str: ...

    def _ensure_process(self, node: str, pod_uid: str, comm: str, device: str) -> None: ...

    def _end_processes(self, node: str, pod_uid: str) -> None: ...


def _report_running(kube, namespace: str, name: str) -> None:
    from driverd.cluster.kube import now_rfc3339, pods_path
    now = now_rfc3339()
    kube.patch(pods_path(namespace, name) + "/status", {"status": {
        "phase": "Running", "startTime": now,
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                       {"type": "PodScheduled", "status": "True", "lastTransitionTime": now}]}}, kind="strategic")


class Kubelet:
    """The kubelets of the simulated nodes, as far as the API and the node's /proc see them, from one
    list + watch of all pods: a pod bound to a node is marked Running; a pod that is deleted or got a
    deletionTimestamp (an eviction) has its processes on its node end, and its graceful deletion is
    confirmed (a finalizer still holds it Terminating), retried while the API server is away. After
    a re-list (the watch's history was gone), the processes of every pod that is gone end. With
    `workers`, its API calls go to that many threads (as each node's kubelet acts on its own: a fleet of hundreds of
    nodes changing at once is not served one call after the other); without, in the watch's thread."""

    def __init__(self, fleet: FleetView, kube, workers: int = 0) -> None:
        from driverd.cluster.informer import Informer
        from driverd.cluster.kube import pods_path
        self.fleet, self.kube = fleet, kube
        self.pods = Informer(kube, pods_path(), on_change=self._changed, name="sim-kubelet",
                             retry_max_s=SIM_RETRY_MAX_S)
        self.pool = _pool(workers, "sim-kubelet")
        self.closed = threading.Event()

    def start(self) -> Kubelet:
        self.pods.start()
        return self

    def close(self) -> None:
        self.closed.set()
        self.pods.close()
        if self.pool:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _call(self, fn, *args) -> None:
        if self.pool:
            self.pool.submit(fn, *args)
        else:
            fn(*args)

    def _changed(self, kind: str, pod: dict) -> None:
        if kind == "SYNC":
            self._resync()
            return
        md, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        node = spec.get("nodeName")
        if node not in self.fleet.nodes:
            return
        if kind == "DELETED" or md.get("deletionTimestamp"):
            self.fleet._end_processes(node, md.get("uid", ""))
            if kind != "DELETED" and HOLD not in (md.get("finalizers") or []):
                self._call(self._confirm, md)
        elif (pod.get("status") or {}).get("phase") in (None, "Pending"):
            self._call(self._running, md)

    def _running(self, md: dict) -> None:
        try:
            _report_running(self.kube, md["namespace"], md["name"])
        except Exception:           # gone meanwhile
            pass

    def _confirm(self, md: dict) -> None:
        # retried while the API server is away, at a kubelet's pace rather than a client's backoff: a
        # watch resumed after a restart brings no re-list, so a confirmation lost to the restart would
        # never come again and the pod would stay Terminating past any drain timeout
        from driverd.cluster.kube import ClusterError, KubeError, pods_path
        end = time.monotonic() + CONFIRM_RETRY_S
        while True:
            try:
                self.kube.request("DELETE", pods_path(md["namespace"], md["name"]), retry=False,
                                  body={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                                        "preconditions": {"uid": md.get("uid")}})
                return
            except KubeError as e:
                if e.status < 500:
                    return        # already gone, or a newer pod of that name
            except ClusterError:
                pass
            if time.monotonic() > end or self.closed.wait(0.25):
                return            # away for longer: a re-list (SYNC) comes back to it

    def _resync(self) -> None:
        pods = self.pods.snapshot()
        live = {p["metadata"]["uid"] for p in pods if not p["metadata"].get("deletionTimestamp")}
        for name, sn in list(self.fleet.nodes.items()):     # a node may join meanwhile (the fleet's thread)
            if sn.host is not None:
                for uid in sn.host.pod_uids() - live:
                    sn.host.end_process(uid)
                continue
            for cg in list((self.fleet.work / "nodes" / name / "proc").glob("*/cgroup")):
                try:
                    text = cg.read_text()
                except OSError:
                    continue
                if "kubepods" in text and not any(u.replace("-", "_") in text for u in live):
                    shutil.rmtree(cg.parent, ignore_errors=True)
        for p in pods:
            if p["metadata"].get("deletionTimestamp"):
                self._changed("MODIFIED", p)


class DaemonSetController:
    """The `nvidia-device-plugin` DaemonSet's controller: one plugin pod (holding /dev/nvidiactl) on
    each node labelled driverd.io/driver-ready=true, none elsewhere. Watches nodes through the API and
    acts on the latest state of each changed node in its own thread (a burst of node events is one
    pass), so that it keeps up with hundreds of daemons patching their nodes; with `workers`, nodes
    are placed by that many threads at once (one node by one thread at a time)."""

    def __init__(self, fleet: FleetView, kube, workers: int = 0) -> None:
        from driverd.cluster.informer import Informer
        from driverd.cluster.kube import node_path, pods_path
        self.fleet, self.kube = fleet, kube
        self.pool = _pool(workers, "sim-ds")
        self.busy: set[str] = set()              # nodes a worker is placing now
        self.lock = threading.Lock()
        self.dirty: set[str] = set()
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.placed: dict[str, str] = {}          # node -> its plugin pod's uid
        self.pods = Informer(kube, pods_path(PLUGIN_NS), name="sim-ds-pods", retry_max_s=SIM_RETRY_MAX_S)
        self.nodes = Informer(kube, node_path(), on_change=self._changed, name="sim-ds-nodes",
                              retry_max_s=SIM_RETRY_MAX_S)
        self.thread = threading.Thread(target=self._run, name="sim-ds", daemon=True)

    def start(self) -> DaemonSetController:
        self.pods.start()
        self.pods.synced.wait(30)
        for p in self.pods.snapshot():
            node = (p.get("spec") or {}).get("nodeName")
            if node in self.fleet.nodes and not p["metadata"].get("deletionTimestamp"):
                self.placed[node] = p["metadata"]["uid"]
        self.nodes.start()
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.wake.set()
        self.nodes.close()
        self.pods.close()
        self.thread.join(5)
        if self.pool:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _changed(self, kind: str, node: dict) -> None:
        names = list(self.fleet.nodes) if kind == "SYNC" else [(node.get("metadata") or {}).get("name")]
        self._dirty(n for n in names if n in self.fleet.nodes)

    def _dirty(self, names) -> None:
        with self.lock:
            self.dirty.update(names)
        self.wake.set()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.wake.wait(0.5)
            self.wake.clear()
            with self.lock:
                dirty, self.dirty = self.dirty - self.busy, self.dirty & self.busy
                self.busy |= dirty if self.pool else set()
            for name in sorted(dirty):
                if self.stop.is_set():
                    return
                if self.pool:
                    self.pool.submit(self._place_one, name)
                else:
                    self._place_one(name)

    def _place_one(self, name: str) -> None:
        """The latest state of the node decides (a later event while a worker placed it is picked up
        when the worker is done)."""
        node = self.nodes.get(name)
        ready = bool(node) and ((node["metadata"].get("labels") or {}).get("driverd.io/driver-ready") == "true")
        try:
            self._place(name, ready)
        except Exception:           # the API server restarting: the next event or re-list retries
            self._dirty([name])
        finally:
            with self.lock:
                self.busy.discard(name)
            self.wake.set()

    def _place(self, name: str, ready: bool) -> None:
        from driverd.cluster.kube import KubeError, pods_path
        pod_name = f"{PLUGIN}-{name}"
        if ready and name not in self.placed:
            cur = self.kube.find(pods_path(PLUGIN_NS, pod_name))
            if cur and cur["metadata"].get("deletionTimestamp"):
                # the node's previous plugin pod is still terminating: a pod of that name comes after it
                self.stop.wait(0.2)
                self._dirty([name])
                return
            ds = self.kube.get(f"/apis/apps/v1/namespaces/{PLUGIN_NS}/daemonsets/{PLUGIN}")
            uid = self.fleet.running_pod(PLUGIN_NS, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": PLUGIN_NS, "labels": {"app": PLUGIN},
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": PLUGIN,
                                                  "uid": ds["metadata"]["uid"], "controller": True}]},
                "spec": {"nodeName": name, "automountServiceAccountToken": False,
                         "containers": [{"name": "plugin", "image": "device-plugin:1"}]}}, kube=self.kube)
            self.placed[name] = uid
            self.fleet._ensure_process(name, uid, "nvidia-device-p", "/dev/nvidiactl")
        elif not ready and name in self.placed:
            try:
                self.kube.request("DELETE", pods_path(PLUGIN_NS, pod_name),
                                  body={"apiVersion": "v1", "kind": "DeleteOptions",
                                        "preconditions": {"uid": self.placed[name]}})
            except KubeError as e:
                if e.status not in (404, 409):
                    raise
            self.placed.pop(name, None)


def _pool(workers: int, name: str):
    from concurrent.futures import ThreadPoolExecutor
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) if workers else None
