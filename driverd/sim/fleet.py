"""A simulated GPU cluster for tests, the demo and bench/fleet.py: N nodes, each a simulated host
tree (its own root, simulated kernel, journal and host lock) running the real node code — the
cluster agent (state machine, drain, node transaction) and a coordinator candidate — against the
loopback API server, plus GPU pods guarded by PodDisruptionBudgets.

Every node starts on driver OLD (loaded, validated, labelled); the package repository has NEW for
the same kernel. Faults (by name) make chosen nodes misbehave in the ways a real fleet does.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from driverd.sim.scenario import RELEASE

OLD, NEW = "535.261.03", "550.127.05"
FAULTS = ("apiserver-restart", "daemon-kill", "pdb-never", "node-notready", "reload-fails")
GPU_NS = "gpu-jobs"
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
                 lease_s: int = 15, kubeconfig: str | None = None, module_unload: bool = True) -> None:
        self.work = Path(workdir)
        self.n, self.srv, self.log, self.gpu_pods, self.lease_s = nodes, server, log, gpu_pods, lease_s
        self.module_unload = module_unload         # False: a kernel built without CONFIG_MODULE_UNLOAD
        self.kubeconfig = kubeconfig or str(self.work / "kubeconfig")
        self.nodes: dict[str, SimNode] = {}
        self.repo = self.work / "repo"
        self.bad_repo = self.work / "repo-broken"

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
                _ensure(st, "pods", GPU_NS, {
                    "metadata": {"name": pod, "namespace": GPU_NS, "labels": {"app": pod}},
                    "spec": {"nodeName": name, "containers": [{"name": "main", "image": "train:1",
                                                                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
                    "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
                _ensure(st, "poddisruptionbudgets", GPU_NS, {
                    "metadata": {"name": f"{pod}-pdb", "namespace": GPU_NS},
                    "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": pod}}}})

    # -- faults ------------------------------------------------------------------------------------
    def pdb_never(self, name: str) -> None:
        """Every PDB of the node's GPU pods forbids any disruption."""
        for j in range(self.gpu_pods):
            pod = f"train-{name}-{j}"
            self.srv.store.patch("poddisruptionbudgets", f"{pod}-pdb", {"spec": {"maxUnavailable": 0}},
                                 namespace=GPU_NS)

    def reload_fails(self, name: str) -> None:
        """The node's repository serves a NEW package without its GSP firmware: the load fails."""
        p = self.nodes[name].root / "etc/driverd/config.toml"
        p.write_text(CONFIG.format(version=OLD, repo=self.bad_repo))

    def set_ready(self, name: str, ready: bool) -> None:
        cond = {"type": "Ready", "status": "True" if ready else "False",
                "reason": "KubeletReady" if ready else "NodeStatusUnknown"}
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
        for sn in self.nodes.values():
            if sn.agent:
                sn.agent.close()
            if sn.coordinator:
                sn.coordinator.close()
        for sn in self.nodes.values():
            for t in sn.threads:
                t.join(timeout=5)

    def requests(self) -> int:
        return sum(sn.kube.requests for sn in self.nodes.values() if sn.kube)

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
