"""The hosts of a simulated fleet (driverd.sim.fleet): the drivers every node starts on and the
repositories that serve them, each node's host (a host tree converged through the real transaction
path, or a TimedHost), the GPU processes its pods hold there, and the faults that live on a host."""
from __future__ import annotations

import itertools
import os
import shutil
import uuid
from dataclasses import field
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.sim.scenario import RELEASE

OLD, NEW = "535.261.03", "550.127.05"
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
    """One node of a simulated fleet: its host and the daemon parts (agent, coordinator) running for it."""
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


class FleetHosts:
    """Fleet's host side (a mixin: Fleet sets these attributes in its __init__)."""
    work: Path
    n: int
    first: int
    prefix: str
    nodes: dict[str, SimNode]
    repo: Path
    bad_repo: Path
    module_unload: bool
    timed: bool
    costs: object
    cfg: object
    _pids: itertools.count

    # -- building --------------------------------------------------------------------------------
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
            name = self.node_name(i, self.prefix)
            self.nodes[name] = SimNode(name, croot, host=TimedHost(name, self.costs, loaded=(OLD, "open"),
                                                                   kernel=RELEASE))

    def _host_trees(self) -> None:
        from driverd.repo.index import write_index
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
            name = self.node_name(i, self.prefix)
            root = self.work / "nodes" / name
            if not root.exists():
                shutil.copytree(template, root, symlinks=True)
            self.nodes[name] = SimNode(name, root)

    @staticmethod
    def node_name(i: int, prefix: str = "gpu") -> str:
        return f"{prefix}-{i:04d}"

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

    # -- the GPU processes of the pods, on their hosts ---------------------------------------------
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

    # -- faults of the host --------------------------------------------------------------------------
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
