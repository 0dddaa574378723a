"""A simulated GPU cluster for tests, the demo and bench/fleet.py: N nodes, each a simulated host
tree (its own root, simulated kernel, journal and host lock) running the real node code — the
cluster agent (state machine, drain, node transaction) and a coordinator candidate — against the
loopback API server, plus GPU pods guarded by PodDisruptionBudgets.

Every node starts on driver OLD (loaded, validated, labelled); the package repository has NEW for
the same kernel. Faults (by name) make chosen nodes misbehave in the ways a real fleet does.

The GPU pods have a controller (a ReplicaSet) and, with `gpu_processes`, a process on their node
holding /dev/nvidia0 (its cgroup names the pod UID, as the kubelet's does). Two small stand-ins for
what a cluster's own components do, both reading and writing the API store directly:
- a kubelet: when a pod is deleted (or gets a deletionTimestamp) its processes on the node end;
- with `device_plugin`, a DaemonSet controller for `nvidia-device-plugin`, which selects nodes
  labelled driverd.io/driver-ready=true: its pod (holding /dev/nvidiactl) is created on a node that
  has the label and deleted from one that lost it.
"""
from __future__ import annotations

import itertools
import os
import shutil
import threading
import uuid
import time
from dataclasses import dataclass, field
from pathlib import Path

from driverd.sim.scenario import RELEASE

OLD, NEW = "535.261.03", "550.127.05"
FAULTS = ("apiserver-restart", "daemon-kill", "pdb-never", "node-notready", "reload-fails", "no-controller",
          "two-pdbs", "stuck-terminating")
GPU_NS = "gpu-jobs"
PLUGIN_NS = "gpu-operator"
PLUGIN = "nvidia-device-plugin"
CONFIG = """[driver]
version = "{version}"
flavor = "open"
[packages]
repositories = ["file://{repo}"]
[runtime]
runtimes = ["containerd"]
restart = "none"
"""


def _quiet(msg: str) -> None:
    pass


@dataclass
class SimNode:
    name: str
    root: Path
    cfg: object = None
    kube: object = None
    agent: object = None
    coordinator: object = None
    threads: list = field(default_factory=list)

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)


class Fleet:
    def __init__(self, workdir: str | os.PathLike, nodes: int, *, server, log=_quiet, gpu_pods: int = 1,
                 lease_s: int = 15, kubeconfig: str | None = None, module_unload: bool = True,
                 gpu_processes: bool = True, device_plugin: bool = False) -> None:
        self.work = Path(workdir)
        self.n, self.srv, self.log, self.gpu_pods, self.lease_s = nodes, server, log, gpu_pods, lease_s
        self.module_unload = module_unload         # False: a kernel built without CONFIG_MODULE_UNLOAD
        self.kubeconfig = kubeconfig or str(self.work / "kubeconfig")
        self.nodes: dict[str, SimNode] = {}
        self.repo = self.work / "repo"
        self.bad_repo = self.work / "repo-broken"
        self.gpu_processes, self.device_plugin = gpu_processes, device_plugin
        self._pids = itertools.count(50000)
        self._sim_stop = threading.Event()
        self._sim_threads: list[threading.Thread] = []
        self._retired_requests = 0         # API requests of daemons that were killed and started again

    # -- building --------------------------------------------------------------------------------
    def build(self) -> Fleet:
        from driverd.packages.repo import write_index
        from driverd.sim import install_backends
        from driverd.sim.fakepkg import make_fake_package
        install_backends()
        self.work.mkdir(parents=True, exist_ok=True)
        self.srv.write_kubeconfig(self.kubeconfig)
        if not (self.repo / "index.json").exists():
            make_fake_package(self.repo, OLD, RELEASE)
            make_fake_package(self.repo, NEW, RELEASE)
            write_index(self.repo)
            make_fake_package(self.bad_repo, OLD, RELEASE)
            make_fake_package(self.bad_repo, NEW, RELEASE, with_firmware=False)   # loads fail: NVRM GSP error
            write_index(self.bad_repo)
        template = self.work / "template"
        if not template.exists():
            self._template(template)
        self._api_objects()
        for i in range(self.n):
            name = self.node_name(i)
            root = self.work / "nodes" / name
            if not root.exists():
                shutil.copytree(template, root, symlinks=True)
            self.nodes[name] = SimNode(name, root)
        if self.gpu_processes:
            for i in range(self.n):
                for j in range(self.gpu_pods):
                    pod = self.srv.store.get("pods", f"train-{self.node_name(i)}-{j}", GPU_NS)
                    self._ensure_process(self.node_name(i), pod["metadata"]["uid"], "python", "/dev/nvidia0")
        self._start_sim()
        return self

    @staticmethod
    def node_name(i: int) -> str:
        return f"gpu-{i:04d}"

    def _template(self, root: Path) -> None:
        """One host on driver OLD, converged through the real transaction path; every node is a copy."""
        from driverd.apply import lifecycle as lc
        from driverd.config import load
        from driverd.root import Root
        from driverd.runner import Runner
        from driverd.sim.hosttree import HostSpec, h100, write_host
        from driverd.sim.scenario import CONTAINERD_CONFIG
        spec = HostSpec(release=RELEASE, pci=[h100("0000:18:00.0", None, 0)], hostname="gpu",
                        module_unload=self.module_unload,
                        files={"/etc/containerd/config.toml": CONTAINERD_CONFIG, "/usr/bin/containerd": ""})
        write_host(root, spec)
        (root / "etc/driverd").mkdir(parents=True, exist_ok=True)
        (root / "etc/driverd/config.toml").write_text(CONFIG.format(version=OLD, repo=self.repo))
        r = Root(str(root))
        cfg = load(r, None, environ={})
        sctx = lc.make_context(r, Runner(), cfg, "sim", log=_quiet)
        out = lc.transact(sctx, lc.apply_request(cfg))
        if out["state"] not in ("done", "nothing-to-do"):
            raise RuntimeError(f"the template host did not converge: {out}")

    def _api_objects(self) -> None:
        st = self.srv.store
        _ensure(st, "namespaces", None, {"metadata": {"name": GPU_NS}})
        _ensure(st, "namespaces", None, {"metadata": {"name": "driverd"}})
        _ensure(st, "namespaces", None, {"metadata": {"name": "default"}})
        crd = _crd()
        _ensure(st, "customresourcedefinitions", None, crd)
        for i in range(self.n):
            name = self.node_name(i)
            _ensure(st, "nodes", None, {
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true",
                                                      "feature.node.kubernetes.io/pci-10de.present": "true"}},
                "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                                       "nodeInfo": {"kernelVersion": RELEASE, "kubeletVersion": "v1.31.0"},
                                       "capacity": {"nvidia.com/gpu": "8"}}})
            for j in range(self.gpu_pods):
                pod = f"train-{name}-{j}"
                _ensure(st, "replicasets", GPU_NS, {
                    "apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": pod, "namespace": GPU_NS},
                    "spec": {"replicas": 1, "selector": {"matchLabels": {"app": pod}},
                             "template": {"metadata": {"labels": {"app": pod}},
                                          "spec": {"containers": [{"name": "main", "image": "train:1"}]}}}})
                rs = st.get("replicasets", pod, GPU_NS)
                _ensure(st, "pods", GPU_NS, {
                    "metadata": {"name": pod, "namespace": GPU_NS, "labels": {"app": pod},
                                 "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": pod,
                                                      "uid": rs["metadata"]["uid"], "controller": True}]},
                    "spec": {"nodeName": name, "containers": [{"name": "main", "image": "train:1",
                                                                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
                    "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
                _ensure(st, "poddisruptionbudgets", GPU_NS, {
                    "metadata": {"name": f"{pod}-pdb", "namespace": GPU_NS},
                    "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": pod}}}})
        if self.device_plugin:
            _ensure(st, "namespaces", None, {"metadata": {"name": PLUGIN_NS}})
            _ensure(st, "daemonsets", PLUGIN_NS, {
                "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": PLUGIN, "namespace": PLUGIN_NS},
                "spec": {"selector": {"matchLabels": {"app": PLUGIN}},
                         "template": {"metadata": {"labels": {"app": PLUGIN}},
                                      "spec": {"nodeSelector": {"driverd.io/driver-ready": "true"},
                                               "containers": [{"name": "plugin", "image": "device-plugin:1"}]}}}})

    # -- the cluster's own components, simulated ---------------------------------------------------
    def _ensure_process(self, node: str, pod_uid: str, comm: str, device: str) -> None:
        """A process of the pod on the node's host, holding `device` (what the kubelet starts)."""
        root = self.work / "nodes" / node
        for cg in (root / "proc").glob("*/cgroup"):
            if pod_uid.replace("-", "_") in cg.read_text():
                return
        while (root / "proc" / str(pid := next(self._pids))).exists():
            pass
        base = root / "proc" / str(pid)
        (base / "fd").mkdir(parents=True)
        (base / "comm").write_text(comm + "\n")
        (base / "cmdline").write_text(comm + "\0")
        (base / "cgroup").write_text(f"0::/kubepods.slice/kubepods-pod{pod_uid.replace('-', '_')}.slice/"
                                     f"cri-containerd-{uuid.uuid4().hex}{uuid.uuid4().hex}.scope\n")
        os.symlink(device, base / "fd" / "3")

    def _end_processes(self, node: str, pod_uid: str) -> None:
        root = self.work / "nodes" / node
        for cg in list((root / "proc").glob("*/cgroup")):
            try:
                if pod_uid.replace("-", "_") in cg.read_text():
                    shutil.rmtree(cg.parent, ignore_errors=True)
            except OSError:
                pass

    def _start_sim(self) -> None:
        if self._sim_threads:
            return
        self._sim_stop.clear()
        self._sim_threads = [threading.Thread(target=self._kubelet, name="sim-kubelet", daemon=True)]
        if self.device_plugin:
            self._sim_threads.append(threading.Thread(target=self._daemonset_controller, name="sim-ds", daemon=True))
        for t in self._sim_threads:
            t.start()

    def _kubelet_resync(self) -> None:
        """End the processes of pods that are gone or terminating (after a watch was cut)."""
        live = {p["metadata"]["uid"] for p in self.srv.store.list("pods")
                if not p["metadata"].get("deletionTimestamp")}
        for name in self.nodes:
            for cg in list((self.work / "nodes" / name / "proc").glob("*/cgroup")):
                try:
                    text = cg.read_text()
                except OSError:
                    continue
                if "kubepods" in text and not any(u.replace("-", "_") in text for u in live):
                    shutil.rmtree(cg.parent, ignore_errors=True)

    def _kubelet(self) -> None:
        w = self.srv.store.watch("pods", send_initial=False)
        try:
            while not self._sim_stop.is_set():
                ev = w.next(timeout=0.5)
                if ev is None:
                    continue
                if ev[0] == "CLOSED":           # the API server restarted: watch again, catch up
                    self._sim_stop.wait(0.2)
                    w = self.srv.store.watch("pods", send_initial=False)
                    self._kubelet_resync()
                    continue
                kind, pod = ev
                if pod and (kind == "DELETED" or pod["metadata"].get("deletionTimestamp")):
                    node = (pod.get("spec") or {}).get("nodeName")
                    if node in self.nodes:
                        self._end_processes(node, pod["metadata"]["uid"])
        finally:
            w.stop()

    def _daemonset_controller(self) -> None:
        """Acts on the latest state of each changed node (a burst of node events is one pass), so
        that it keeps up with hundreds of daemons patching their nodes."""
        st = self.srv.store
        w = st.watch("nodes", send_initial=True)
        try:
            while not self._sim_stop.is_set():
                ev = w.next(timeout=0.5)
                latest: dict[str, bool] = {}
                while ev is not None:
                    if ev[0] == "CLOSED":           # the API server restarted: watch again from a full list
                        self._sim_stop.wait(0.2)
                        w = st.watch("nodes", send_initial=True)
                    elif ev[0] != "DELETED" and ev[1] and ev[1]["metadata"]["name"] in self.nodes:
                        labels = ev[1]["metadata"].get("labels") or {}
                        latest[ev[1]["metadata"]["name"]] = labels.get("driverd.io/driver-ready") == "true"
                    ev = w.next(timeout=0)
                for name, ready in latest.items():
                    self._place_plugin(name, ready)
        finally:
            w.stop()

    def _place_plugin(self, name: str, ready: bool) -> None:
        st = self.srv.store
        pod_name = f"{PLUGIN}-{name}"
        cur = st.list("pods", PLUGIN_NS, field_selector=f"metadata.name={pod_name}")
        if ready and not cur:
            ds = st.get("daemonsets", PLUGIN, PLUGIN_NS)
            pod = st.create("pods", {
                "metadata": {"name": pod_name, "namespace": PLUGIN_NS, "labels": {"app": PLUGIN},
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": PLUGIN,
                                                  "uid": ds["metadata"]["uid"], "controller": True}]},
                "spec": {"nodeName": name, "containers": [{"name": "plugin", "image": "device-plugin:1"}]},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
                PLUGIN_NS, keep_status=True)
            self._ensure_process(name, pod["metadata"]["uid"], "nvidia-device-p", "/dev/nvidiactl")
        elif not ready and cur:
            try:
                st.delete("pods", pod_name, PLUGIN_NS)
            except Exception:       # already gone
                pass

    # -- faults ------------------------------------------------------------------------------------
    def pdb_never(self, name: str) -> None:
        """Every PDB of the node's GPU pods forbids any disruption."""
        for j in range(self.gpu_pods):
            pod = f"train-{name}-{j}"
            self.srv.store.patch("poddisruptionbudgets", f"{pod}-pdb", {"spec": {"maxUnavailable": 0}},
                                 namespace=GPU_NS)

    def no_controller(self, name: str, process: bool = True) -> str:
        """A GPU pod on the node that nothing would recreate (no ownerReferences), with its process
        unless `process` is false (a pod that holds no device right now)."""
        pod = self.srv.store.create("pods", {
            "metadata": {"name": f"solo-{name}", "namespace": GPU_NS, "labels": {"app": f"solo-{name}"}},
            "spec": {"nodeName": name, "containers": [{"name": "main", "image": "notebook:1",
                                                        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}, GPU_NS,
            keep_status=True)
        if self.gpu_processes and process:
            self._ensure_process(name, pod["metadata"]["uid"], "jupyter", "/dev/nvidia0")
        return f"solo-{name}"

    def two_pdbs(self, name: str) -> None:
        """A second PodDisruptionBudget over the node's first GPU pod: the Eviction API answers 500."""
        pod = f"train-{name}-0"
        _ensure(self.srv.store, "poddisruptionbudgets", GPU_NS, {
            "metadata": {"name": f"{pod}-pdb2", "namespace": GPU_NS},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": pod}}}})

    def stuck_terminating(self, name: str) -> None:
        """The node's first GPU pod carries a finalizer nobody removes: once deleted it stays Terminating."""
        self.srv.store.patch("pods", f"train-{name}-0", {"metadata": {"finalizers": ["example.com/hold"]}},
                             namespace=GPU_NS)

    def reload_fails(self, name: str) -> None:
        """The node's repository serves a NEW package without its GSP firmware: the load fails."""
        p = self.nodes[name].root / "etc/driverd/config.toml"
        p.write_text(CONFIG.format(version=OLD, repo=self.bad_repo))

    def set_ready(self, name: str, ready: bool, since: float | None = None) -> None:
        """The node's Ready condition (what the kubelet / node lifecycle controller write), changed
        at `since` (default now)."""
        from driverd.cluster.kube import now_rfc3339
        cond = {"type": "Ready", "status": "True" if ready else "False",
                "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                "lastTransitionTime": now_rfc3339(time.time() if since is None else since)}
        self.srv.store.patch("nodes", name, {"status": {"conditions": [cond]}}, "strategic", subresource="status")

    # -- running -----------------------------------------------------------------------------------
    def start_node(self, name: str) -> SimNode:
        from driverd.apply import lifecycle as lc
        from driverd.cluster.agent import NodeAgent
        from driverd.cluster.coordinator import Coordinator
        from driverd.cluster.kube import Kube, Target
        from driverd.config import load
        from driverd.root import Root
        from driverd.runner import Runner
        sn = self.nodes[name]
        if sn.kube is not None:
            self._retired_requests += sn.kube.requests
        root = Root(str(sn.root))
        sn.cfg = load(root, None, environ={})
        sn.kube = Kube(Target(kubeconfig=self.kubeconfig))

        def make_context(cfg, _root=root):
            return lc.make_context(_root, Runner(), cfg, "sim", log=_quiet)
        sn.agent = NodeAgent(sn.kube, name, make_context=make_context, cfg=sn.cfg, log=self.log)
        sn.coordinator = Coordinator(sn.kube, name, "driverd", rollouts=sn.agent.rollouts, log=self.log,
                                     lease_s=self.lease_s)
        sn.threads = [threading.Thread(target=sn.agent.run, name=f"agent-{name}", daemon=True),
                      threading.Thread(target=sn.coordinator.run, name=f"coord-{name}", daemon=True)]
        for t in sn.threads:
            t.start()
        return sn

    def reboot_node(self, name: str) -> None:
        """The node reboots (what kured does on /var/run/reboot-required): its daemon dies, the
        simulated kernel boots without the driver, and the daemon starts again."""
        from driverd.apply import lifecycle as lc
        from driverd.root import Root
        from driverd.runner import Runner
        self.kill_node(name)
        sn = self.nodes[name]
        lc.make_context(Root(str(sn.root)), Runner(), sn.cfg, "sim", log=_quiet).kernel.reboot()
        self.start_node(name)

    def kill_node(self, name: str) -> None:
        """The daemon dies (as a SIGKILL would leave it: no Lease release, no cleanup)."""
        sn = self.nodes[name]
        sn.coordinator.lease.held_until = 0.0   # a dead process renews nothing and releases nothing
        sn.agent.close()
        sn.coordinator.stop.set()
        sn.coordinator.wake.set()
        sn.coordinator.lease_watch.close()
        if sn.coordinator.nodes:
            sn.coordinator.nodes.close()

    def start(self) -> None:
        for name in self.nodes:
            self.start_node(name)

    def stop(self) -> None:
        self._sim_stop.set()
        for t in self._sim_threads:
            t.join(timeout=2)
        self._sim_threads = []
        for sn in self.nodes.values():
            if sn.agent:
                sn.agent.close()
            if sn.coordinator:
                sn.coordinator.close()
        for sn in self.nodes.values():
            for t in sn.threads:
                t.join(timeout=5)

    def requests(self) -> int:
        """API requests of every node daemon so far, daemons killed and started again included."""
        return self._retired_requests + sum(sn.kube.requests for sn in self.nodes.values() if sn.kube)

    def wait(self, predicate, timeout: float, step: float = 0.2) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(step)
        return predicate()


def _ensure(store, resource: str, namespace: str | None, obj: dict) -> None:
    try:
        store.create(resource, obj, namespace, keep_status=True)
    except Exception as e:      # already there (a rebuilt fleet on the same server)
        if "exists" not in str(e).lower():
            raise


def _crd() -> dict:
    # Package data (the same bytes as deploy/base/crd-driverrollout.yaml, kept so by tests/test_deploy.py):
    # an installed wheel has no deploy/ directory.
    from importlib import resources

    import yaml
    return yaml.safe_load(resources.files("driverd.data").joinpath("crd-driverrollout.yaml").read_text())
