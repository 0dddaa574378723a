"""A simulated GPU cluster for tests, the demo and bench/fleet.py: N nodes, each a simulated host
tree (its own root, simulated kernel, journal and host lock) running the real node code — the
cluster agent (state machine, drain, node transaction) and a coordinator candidate — against an API
server, plus GPU pods guarded by PodDisruptionBudgets.

The API server is whatever `server` names (anything with `write_kubeconfig(path)`): the tests pass
the real control plane (tests/controlplane.py: kube-apiserver, etcd, kube-controller-manager), the
demo a kubeconfig the user gave. Everything here goes through the API with that administrator's
kubeconfig; each node daemon uses `server.node_kubeconfig(node, path)` where the server offers one (a
ServiceAccount token bound to its Node: the identity deploy/'s RBAC and admission policy judge).

Every node starts on driver OLD (loaded, validated, labelled); the package repository has NEW for
the same kernel. Faults (by name) make chosen nodes misbehave in the ways a real fleet does.

The GPU pods have a controller (a ReplicaSet) and, with `gpu_processes`, a process on their node
holding /dev/nvidia0 (its cgroup names the pod UID, as the kubelet's does). No kubelet and no
DaemonSet controller run: two small stand-ins play them, through the API (list + watch):
- a kubelet: a pod bound to a node is marked Running; when a pod is deleted (or gets a
  deletionTimestamp) its processes on the node end and its graceful deletion is confirmed;
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
SIM_WORKERS = 8                    # threads of the played kubelets and DaemonSet controller (timed hosts)
HOLD = "example.com/hold"          # a finalizer nobody removes (pods stuck Terminating)
CONFIRM_RETRY_S = 120              # how long a played kubelet keeps confirming a deletion while the API is away
SIM_RETRY_MAX_S = 1.0              # the played kubelets and controller are back within a second of the API server
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
    host: object = None              # a TimedHost (hosts="timed"); None: the host tree at `root`
    proc: object = None              # the daemon's own process (spawn_node), else None: a thread here

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads) or (self.proc is not None and self.proc.poll() is None)


class Fleet:
    def __init__(self, workdir: str | os.PathLike, nodes: int, *, server, log=_quiet, gpu_pods: int = 1,
                 lease_s: int | None = None, kubeconfig: str | None = None, module_unload: bool = True,
                 gpu_processes: bool = True, device_plugin: bool = False, first: int = 0, hosts: str = "files",
                 costs=None, namespaces: int = 1, labels: dict | None = None, coordinator: str | None = None) -> None:
        """hosts: "files", every node a simulated host tree (its own root, simulated kernel, journal),
        the node transaction the real one; "timed", every node a driverd.sim.timedhost.TimedHost
        (the node's work is wall-clock time of `costs`, a NodeCosts; no host tree), for fleets of
        hundreds of nodes whose agents must not spend this machine's CPU on the hosts' work.
        namespaces: the GPU pods' namespaces (GPU_NS for 1; else GPU_NS-0 …, the nodes' pods dealt
        round-robin): how many pods each eviction's admission policy takes as its parameters.
        labels: on every Node the fleet makes (the demo marks its own so that its rollout selects them
        and its clean-up finds them).
        coordinator: who coordinates. "own": a coordinator of its own identity (deploy/'s Deployment
        driverd-coordinator: start_coordinator, started with the first node), the nodes' daemons run their
        own side only (cluster.coordinate = false); "nodes": every node's daemon is also a coordinator
        candidate (a server without per-node identities: the simulated API server, the demo); "none": the
        test starts its coordinator itself. Default: "own" where the server gives each daemon its own
        identity (the real control plane with deploy/ applied), else "nodes"."""
        self.work = Path(workdir)
        if coordinator is None:
            coordinator = "own" if getattr(server, "node_kubeconfig", None) is not None else "nodes"
        if coordinator not in ("own", "nodes", "none"):
            raise ValueError(f"coordinator: own, nodes or none, not {coordinator!r}")
        self.coordinator_mode = coordinator
        self.coordinators: dict = {}               # name -> cluster.coordinate.CoordinatorProcess (own)
        from driverd.cluster.lease import LEASE_DURATION_S
        self.n, self.srv, self.log, self.gpu_pods = nodes, server, log, gpu_pods
        self.lease_s = LEASE_DURATION_S if lease_s is None else lease_s    # None: the product's default
        self.first = first                         # node names start at gpu-<first> (fleets side by side)
        self.module_unload = module_unload         # False: a kernel built without CONFIG_MODULE_UNLOAD
        self.kubeconfig = kubeconfig or str(self.work / "kubeconfig")
        self.nodes: dict[str, SimNode] = {}
        self.repo = self.work / "repo"
        self.bad_repo = self.work / "repo-broken"
        self.gpu_processes, self.device_plugin = gpu_processes, device_plugin
        self._pids = itertools.count(50000)
        self._retired_requests = 0         # API requests of daemons that were killed and started again
        self.admin = None                  # the harness's own client (its requests are not driverd's)
        self.kubelet: Kubelet | None = None
        self.plugins: DaemonSetController | None = None
        if hosts not in ("files", "timed"):
            raise ValueError(f"hosts={hosts!r}: files or timed")
        self.timed = hosts == "timed"
        from driverd.sim.timedhost import NodeCosts
        self.costs = costs or NodeCosts()
        self.cfg = None                    # the configuration every timed node's daemon reads
        self.gpu_namespaces = [GPU_NS] if namespaces <= 1 else [f"{GPU_NS}-{i}" for i in range(namespaces)]
        self.labels = dict(labels or {})

    # -- building --------------------------------------------------------------------------------
    def build(self) -> Fleet:
        from driverd.cluster.kube import Kube, Target
        self.work.mkdir(parents=True, exist_ok=True)
        self.srv.write_kubeconfig(self.kubeconfig)
        self.admin = Kube(Target(kubeconfig=self.kubeconfig))
        if self.timed:
            self._timed_hosts()
        else:
            self._host_trees()
        uids = self._api_objects()
        if self.gpu_processes:
            for (node, _pod), uid in uids.items():
                self._ensure_process(node, uid, "python", "/dev/nvidia0")
        self._start_sim()
        return self

    def _timed_hosts(self) -> None:
        """One configuration for every node (a root holding only /etc/driverd/config.toml), and a
        TimedHost per node running driver OLD."""
        from driverd.config import load
        from driverd.root import Root
        from driverd.sim.timedhost import TimedHost
        croot = self.work / "config-root"
        (croot / "etc/driverd").mkdir(parents=True, exist_ok=True)
        (croot / "etc/driverd/config.toml").write_text(CONFIG.format(version=OLD, repo=self.repo))
        self.cfg = load(Root(str(croot)), None, environ={})
        for i in range(self.first, self.first + self.n):
            name = self.node_name(i)
            self.nodes[name] = SimNode(name, croot, host=TimedHost(name, self.costs, loaded=(OLD, "open"),
                                                                   kernel=RELEASE))

    def _host_trees(self) -> None:
        from driverd.packages.repo import write_index
        from driverd.sim import install_backends
        from driverd.sim.fakepkg import make_fake_package
        install_backends()
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
        for i in range(self.first, self.first + self.n):
            name = self.node_name(i)
            root = self.work / "nodes" / name
            if not root.exists():
                shutil.copytree(template, root, symlinks=True)
            self.nodes[name] = SimNode(name, root)

    @staticmethod
    def node_name(i: int) -> str:
        return f"gpu-{i:04d}"

    def gpu_ns(self, node: str) -> str:
        """The namespace of the node's GPU pods."""
        if len(self.gpu_namespaces) == 1:
            return self.gpu_namespaces[0]
        return self.gpu_namespaces[int(node.rsplit("-", 1)[1]) % len(self.gpu_namespaces)]

    def _template(self, root: Path, converge: bool = True) -> None:
        """One host on driver OLD, converged through the real transaction path; every node is a copy.
        Without `converge`: a host driverd has never run on (no driver, no journal) — a joining node."""
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
        if not converge:
            return
        r = Root(str(root))
        cfg = load(r, None, environ={})
        sctx = lc.make_context(r, Runner(), cfg, "sim", log=_quiet)
        out = lc.transact(sctx, lc.apply_request(cfg))
        if out["state"] not in ("done", "nothing-to-do"):
            raise RuntimeError(f"the template host did not converge: {out}")

    def join(self, name: str, labels: dict | None = None, *, start: bool = True) -> SimNode:
        """A node that joins the cluster (autoscaling, a replaced machine): a new host driverd never ran
        on — no driver loaded, none installed — registered as a Ready Node with `labels`, without GPU
        pods (nothing can run on its GPUs yet); its agent and coordinator candidate start unless
        `start` is false."""
        if self.timed:
            from driverd.sim.timedhost import TimedHost
            self.nodes[name] = sn = SimNode(name, self.work / "config-root",
                                            host=TimedHost(name, self.costs, loaded=None, kernel=RELEASE))
        else:
            root = self.work / "nodes" / name
            if not root.exists():
                self._template(root, converge=False)
            self.nodes[name] = sn = SimNode(name, root)
        self._node_object(name, labels or {})
        if start:
            self.start_node(name)
        return sn

    def _node_object(self, name: str, labels: dict) -> None:
        from driverd.cluster.kube import node_path
        k = self.admin
        _ensure(k, node_path(), {
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
        uids: dict[tuple[str, str], str] = {}
        for name in self.nodes:
            self._node_object(name, {})
            for j in range(self.gpu_pods):
                pod = f"train-{name}-{j}"
                uids[(name, pod)] = self._gpu_pod(name, j)
                ns = self.gpu_ns(name)
                _ensure(k, f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", {
                    "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": {"name": f"{pod}-pdb", "namespace": ns},
                    "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": pod}}}})
        if self.device_plugin:
            _ensure(k, f"/apis/apps/v1/namespaces/{PLUGIN_NS}/daemonsets", {
                "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": PLUGIN, "namespace": PLUGIN_NS},
                "spec": {"selector": {"matchLabels": {"app": PLUGIN}},
                         "template": {"metadata": {"labels": {"app": PLUGIN}},
                                      "spec": {"nodeSelector": {"driverd.io/driver-ready": "true"},
                                               "containers": [{"name": "plugin", "image": "device-plugin:1"}]}}}})
        return uids

    def _gpu_pod(self, node: str, j: int) -> str:
        """The node's j-th GPU pod, a ReplicaSet's, Running (created unless it exists): its uid."""
        pod, ns = f"train-{node}-{j}", self.gpu_ns(node)
        rs = _ensure(self.admin, f"/apis/apps/v1/namespaces/{ns}/replicasets", {
            "apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": pod, "namespace": ns},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": pod}},
                     "template": {"metadata": {"labels": {"app": pod}},
                                  "spec": {"containers": [{"name": "main", "image": "train:1"}]}}}})
        return self.running_pod(ns, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": ns, "labels": {"app": pod},
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
        obj = _ensure(k, pods_path(namespace), pod)
        if (obj.get("status") or {}).get("phase") != "Running":
            _report_running(k, namespace, pod["metadata"]["name"])
        return obj["metadata"]["uid"]

    # -- the cluster's own components, simulated ---------------------------------------------------
    def _ensure_process(self, node: str, pod_uid: str, comm: str, device: str) -> None:
        """A process of the pod on the node's host, holding `device` (what the kubelet starts)."""
        if self.timed:
            self.nodes[node].host.start_process(pod_uid, comm, device)
            return
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
        if self.timed:
            self.nodes[node].host.end_process(pod_uid)
            return
        root = self.work / "nodes" / node
        for cg in list((root / "proc").glob("*/cgroup")):
            try:
                if pod_uid.replace("-", "_") in cg.read_text():
                    shutil.rmtree(cg.parent, ignore_errors=True)
            except OSError:
                pass

    def _start_sim(self) -> None:
        from driverd.cluster.kube import Kube, Target
        # a fleet of timed hosts is hundreds of nodes changing at once: their kubelets and the DaemonSet
        # controller act in parallel there, as in a cluster (the host-tree fleets of the tests: in order)
        workers = SIM_WORKERS if self.timed else 0
        if self.kubelet is None:
            self.kubelet = Kubelet(self, Kube(Target(kubeconfig=self.kubeconfig)), workers).start()
        if self.device_plugin and self.plugins is None:
            self.plugins = DaemonSetController(self, Kube(Target(kubeconfig=self.kubeconfig)), workers).start()

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

    def reload_fails(self, name: str) -> None:
        """The node's repository serves a NEW package without its GSP firmware: the load fails."""
        if self.timed:
            self.nodes[name].host.fail_reload = True
            return
        p = self.nodes[name].root / "etc/driverd/config.toml"
        p.write_text(CONFIG.format(version=OLD, repo=self.bad_repo))

    def reload_works(self, name: str) -> None:
        """Undo `reload_fails`: the node's repository serves NEW with its firmware again, and its daemon
        re-reads its configuration (as the daemon does when the file changes)."""
        from driverd.config import load
        from driverd.root import Root
        if self.timed:
            self.nodes[name].host.fail_reload = False
            return
        p = self.nodes[name].root / "etc/driverd/config.toml"
        p.write_text(CONFIG.format(version=OLD, repo=self.repo))
        sn = self.nodes[name]
        if sn.agent is not None:
            sn.cfg = load(Root(str(sn.root)), None, environ={})
            sn.agent.cfg = sn.cfg

    def set_ready(self, name: str, ready: bool, since: float | None = None) -> None:
        """The node's Ready condition (what the kubelet / node lifecycle controller write), changed
        at `since` (default now)."""
        from driverd.cluster.kube import node_path
        self.admin.patch(node_path(name) + "/status", {"status": {"conditions": [_ready_condition(ready, since)]}},
                         kind="strategic")

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
        sn.kube = Kube(Target(kubeconfig=self.node_kubeconfig(name)))
        if sn.host is not None:
            sn.cfg = self.cfg
            sn.agent = NodeAgent(sn.kube, name, host=sn.host, cfg=sn.cfg, log=self.log)
        else:
            root = Root(str(sn.root))
            sn.cfg = load(root, None, environ={})

            def make_context(cfg, _root=root):
                return lc.make_context(_root, Runner(), cfg, "sim", log=_quiet)
            sn.agent = NodeAgent(sn.kube, name, make_context=make_context, cfg=sn.cfg, log=self.log)
        sn.threads = [threading.Thread(target=sn.agent.run, name=f"agent-{name}", daemon=True)]
        sn.coordinator = None
        if self.coordinator_mode == "own" and not self.coordinators:
            self.start_coordinator()
        if self.coordinator_mode == "nodes":
            sn.coordinator = Coordinator(sn.kube, name, "driverd", rollouts=sn.agent.rollouts, pools=sn.agent.pools,
                                         log=self.log, lease_s=self.lease_s)
            sn.threads.append(threading.Thread(target=sn.coordinator.run, name=f"coord-{name}", daemon=True))
        for t in sn.threads:
            t.start()
        return sn

    COORDINATOR = "driverd-coordinator-0"

    def coordinator_kubeconfig(self, name: str = COORDINATOR) -> str:
        """The kubeconfig of coordinator `name`: its own identity where the server gives one (a token of
        deploy/'s ServiceAccount driverd-coordinator bound to its pod), else the fleet's."""
        own = getattr(self.srv, "coordinator_kubeconfig", None)
        if own is None:
            return self.kubeconfig
        path = self.work / "kubeconfigs" / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            own(name, str(path))
        return str(path)

    def start_coordinator(self, name: str = COORDINATOR):
        """A coordinator of its own identity in this process (`driverd cluster coordinator`'s
        CoordinatorProcess), as deploy/'s Deployment runs it; several names are several replicas."""
        from driverd.cluster.coordinate import CoordinatorProcess
        from driverd.cluster.kube import Kube, Target
        old = self.coordinators.get(name)
        if old is not None and hasattr(old, "coordinator"):
            self._retired_requests += old.coordinator.kube.requests
        cp = CoordinatorProcess(Kube(Target(kubeconfig=self.coordinator_kubeconfig(name))), name, "driverd", self.log,
                                lease_s=self.lease_s)
        self.coordinators[name] = cp.start()
        return cp

    def spawn_coordinator(self, name: str = COORDINATOR):
        """Coordinator `name` as deploy/'s Deployment runs it (spawn_coordinator), in a process of its own
        (its CPU its own); its log in <work>/daemons/<name>.log."""
        proc, _ = spawn_coordinator(self.coordinator_kubeconfig(name), name, self.work / "daemons")
        self.coordinators[name] = proc
        return proc

    def kill_coordinator(self, name: str = COORDINATOR) -> None:
        """Coordinator `name` dies as a SIGKILL leaves it (no Lease release)."""
        c = self.coordinators[name]
        if hasattr(c, "poll"):                  # a spawned `driverd cluster coordinator`
            c.kill()
            c.wait()
            return
        _killed(c.coordinator)
        c.rollouts.close()
        c.pools.close()

    def reboot_node(self, name: str) -> None:
        """The node reboots (what kured does on /var/run/reboot-required): its daemon dies, the
        simulated kernel boots without the driver, and the daemon starts again."""
        from driverd.apply import lifecycle as lc
        from driverd.root import Root
        from driverd.runner import Runner
        self.kill_node(name)
        sn = self.nodes[name]
        if sn.host is not None:
            sn.host.reboot()
        else:
            lc.make_context(Root(str(sn.root)), Runner(), sn.cfg, "sim", log=_quiet).kernel.reboot()
        self.start_node(name)

    def spawn_node(self, name: str) -> SimNode:
        """Node `name`'s daemon (agent and coordinator candidate) in a process of its own
        (driverd.sim.fleetnode) on a timed host running OLD, instead of a thread of this process: the
        coordinator's CPU is then its own process's, as on a fleet, and it competes with nobody's
        interpreter lock. Its host's GPU processes are the ones the kubelet stand-in (here) keeps, read
        from a file (timedhost.TimedHost.share)."""
        self.spawn_group([name])
        return self.nodes[name]

    def spawn_group(self, names: list[str], *, switch_interval: float | None = None) -> None:
        """The daemons of `names` in one process of their own (driverd.sim.fleetnode), as spawn_node
        does for one: a large fleet's daemons spread over a few processes share no interpreter lock
        with this harness nor with all the others. Killing one kills its group (kill_node)."""
        import json
        import subprocess
        import sys
        if not self.timed:
            raise ValueError("spawning daemons needs hosts='timed'")
        out = self.work / "daemons"
        out.mkdir(exist_ok=True)
        c = self.costs
        spec = out / f"{names[0]}.nodes.json"
        for n in names:             # the played kubelet (here) keeps the host's GPU processes in a file
            self.nodes[n].host.share(str(out / f"{n}.processes.json"))
        spec.write_text(json.dumps([{"node": n, "kubeconfig": self.node_kubeconfig(n),
                                     "config_root": str(self.nodes[n].root),
                                     "processes": self.nodes[n].host.processes_file} for n in names]))
        with open(out / f"{names[0]}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "driverd.sim.fleetnode", "--nodes-file", str(spec), "--driver", OLD,
                 "--flavor", "open", "--kernel", RELEASE, "--lease-s", str(self.lease_s),
                 "--reload-s", str(c.reload_s), "--validate-s", str(c.validate_s),
                 "--preflight-s", str(c.preflight_s), "--status", str(out / f"{names[0]}.json")]
                + (["--switch-interval", str(switch_interval)] if switch_interval else [])
                + (["--no-coordinator"] if self.coordinator_mode != "nodes" else []),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=str(Path(__file__).resolve().parents[2]))
        for n in names:
            self.nodes[n].proc = proc

    def spawned_requests(self) -> int:
        """The API requests the spawned daemons' clients counted (their last report)."""
        import json
        n = 0
        for name, sn in self.nodes.items():
            p = self.work / "daemons" / f"{name}.json"
            if sn.proc is not None and p.exists():
                try:
                    n += int(json.loads(p.read_text()).get("requests") or 0)
                except (OSError, ValueError):
                    pass
        return n

    def kill_node(self, name: str) -> None:
        """The daemon dies (as a SIGKILL would leave it: no Lease release, no cleanup)."""
        sn = self.nodes[name]
        if sn.proc is not None:
            sn.proc.kill()
            sn.proc.wait()
            return
        sn.agent.close()
        if sn.coordinator is not None:
            _killed(sn.coordinator)

    def node_kubeconfig(self, name: str) -> str:
        """The kubeconfig node `name`'s daemon uses: its own identity where the server gives one."""
        per_node = getattr(self.srv, "node_kubeconfig", None)
        if per_node is None:
            return self.kubeconfig
        path = self.work / "kubeconfigs" / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            per_node(name, str(path))
        return str(path)

    def start(self, spawned: tuple[str, ...] = ()) -> None:
        """Every node's daemon: those named in `spawned` first, each in its own process
        (spawn_node), the others as threads here."""
        self._start_sim()
        for name in spawned:
            self.spawn_node(name)
        for name in self.nodes:
            if name not in spawned:
                self.start_node(name)

    def harness_requests(self) -> int:
        """API calls the harness made (setup, faults, the played kubelet and DaemonSet controller)."""
        return sum(k.requests for k in (self.admin, self.kubelet and self.kubelet.kube,
                                        self.plugins and self.plugins.kube) if k)

    def stop(self) -> None:
        for sim in (self.kubelet, self.plugins):
            if sim:
                sim.close()
        self.kubelet = self.plugins = None
        for c in self.coordinators.values():
            if hasattr(c, "poll"):              # a spawned `driverd cluster coordinator`: SIGTERM gives the Lease up
                if c.poll() is None:
                    c.terminate()
                try:
                    c.wait(15)
                except Exception:
                    c.kill()
                    c.wait()
            else:
                c.close()
        for sn in self.nodes.values():
            if sn.agent:
                sn.agent.close()
            if sn.coordinator:
                sn.coordinator.close()
        for sn in self.nodes.values():
            if sn.proc is not None and sn.proc.poll() is None:
                sn.proc.terminate()         # it gives the Lease up and reports its requests
        for sn in self.nodes.values():
            for t in sn.threads:
                t.join(timeout=5)
            if sn.proc is not None:
                try:
                    sn.proc.wait(15)
                except Exception:
                    sn.proc.kill()
                    sn.proc.wait()

    def remove(self, rollouts: tuple[str, ...] = ()) -> list[str]:
        """Delete what the fleet made on the API server: `rollouts` first (while the daemons still run, so
        that the coordinator gives their nodes back and drops the finalizer), then, with the daemons
        stopped, the GPU pods, their ReplicaSets and PodDisruptionBudgets, the device plugin's DaemonSet
        and the Nodes. Namespaces and CRDs stay (a cluster may have had them before). What could not be
        deleted, in words."""
        from driverd.cluster.kube import KubeError, node_path, rollout_path
        k, left = self.admin, []

        def delete(path: str, now: bool = False) -> None:
            try:
                # a pod on a node no kubelet serves would stay Terminating: deleted at once
                k.request("DELETE", path, query={"gracePeriodSeconds": "0"}) if now else k.delete(path)
            except KubeError as e:
                if not e.not_found:
                    left.append(f"{path}: {e.one_line()}")
        for name in rollouts:
            delete(rollout_path(name))
        for name in rollouts:
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

    def requests(self) -> int:
        """API requests of every node daemon and coordinator so far, as their clients counted them: daemons killed and
        started again included, spawned ones as they last reported."""
        return self._retired_requests + sum(sn.kube.requests for sn in self.nodes.values() if sn.kube) + \
            sum(c.coordinator.kube.requests for c in self.coordinators.values() if hasattr(c, "coordinator")) + \
            self.spawned_requests()

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


def spawn_coordinator(kubeconfig: str, name: str, work: Path, listen: str | None = None, env: dict | None = None):
    """`driverd cluster coordinator`, the real command, as deploy/'s Deployment runs it, holding the Lease
    as `name` with the identity of `kubeconfig`; no host (an empty root: the configuration's defaults).
    `env`: more environment (none of this process's DRIVERD_* settings goes along). Returns (the process,
    its log: <work>/<name>.log)."""
    import subprocess
    import sys
    work = Path(work)
    root = work / f"{name}-root"
    root.mkdir(parents=True, exist_ok=True)
    log_path = work / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "driverd", "cluster", "coordinator", "--root", str(root),
                                 "--kubeconfig", kubeconfig, "--identity", name, "-n", "driverd"]
                                + (["--listen", listen] if listen else []),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(Path(__file__).resolve().parents[2]),
                                env={**{k: v for k, v in os.environ.items() if not k.startswith("DRIVERD_")},
                                     **(env or {})})
    return proc, log_path


def _killed(c) -> None:
    """A coordinator (cluster.coordinator.Coordinator) in this process stops as a SIGKILL leaves one: no
    last writes, no Lease release (a dead process renews nothing and gives nothing back)."""
    c.stop.set()
    c.lease.held_until = 0.0
    c.wake.set()
    c.lease_watch.close()
    if c.nodes:
        c.nodes.close()


def _ready_condition(ready: bool, since: float | None = None) -> dict:
    from driverd.cluster.kube import now_rfc3339
    when = now_rfc3339(time.time() if since is None else since)
    return {"type": "Ready", "status": "True" if ready else "False",
            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
            "lastHeartbeatTime": now_rfc3339(), "lastTransitionTime": when}


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

    def __init__(self, fleet: Fleet, kube, workers: int = 0) -> None:
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
        for name, sn in self.fleet.nodes.items():
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

    def __init__(self, fleet: Fleet, kube, workers: int = 0) -> None:
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


def _ensure(kube, collection: str, obj: dict) -> dict:
    """Create obj unless it exists (a rebuilt fleet on the same server): the object as stored. A
    namespace's `default` ServiceAccount may appear a moment after the namespace: retried until it does."""
    from driverd.cluster.kube import KubeError
    end = time.monotonic() + 30
    while True:
        try:
            return kube.create(collection, obj)
        except KubeError as e:
            if e.status == 409:
                return kube.get(f"{collection}/{obj['metadata']['name']}")
            if e.status == 403 and "serviceaccount" in e.api_message.lower() and time.monotonic() < end:
                time.sleep(0.2)
                continue
            raise


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
