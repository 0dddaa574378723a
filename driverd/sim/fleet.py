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
import threading
from pathlib import Path

from driverd.sim.fleethosts import CONFIG, NEW, OLD, FleetHosts, SimNode, _quiet
from driverd.sim.fleetobjects import FleetConflict, FleetObjects
from driverd.sim.scenario import RELEASE
from driverd.sim.standins import PLUGIN, PLUGIN_NS, DaemonSetController, Kubelet

FAULTS = ("apiserver-restart", "daemon-kill", "pdb-never", "node-notready", "reload-fails", "no-controller",
          "two-pdbs", "stuck-terminating")
GPU_NS = "gpu-jobs"
SIM_WORKERS = 8                    # threads of the played kubelets and DaemonSet controller (timed hosts)


# One mixin per subject (the hosts: fleethosts.py; the API objects and faults: fleetobjects.py) keeps
# this class to building the fleet and running its daemons.
class Fleet(FleetHosts, FleetObjects):
    def __init__(self, workdir: str | os.PathLike, nodes: int, *, server, log=_quiet, gpu_pods: int = 1,
                 lease_s: int | None = None, kubeconfig: str | None = None, module_unload: bool = True,
                 gpu_processes: bool = True, device_plugin: bool = False, first: int = 0, hosts: str = "files",
                 costs=None, namespaces: int = 1, labels: dict | None = None, coordinator: str | None = None,
                 prefix: str = "gpu", exclusive: bool = False) -> None:
        """hosts: "files", every node a simulated host tree (its own root, simulated kernel, journal),
        the node transaction the real one; "timed", every node a driverd.sim.timedhost.TimedHost
        (the node's work is wall-clock time of `costs`, a NodeCosts; no host tree), for fleets of
        hundreds of nodes whose agents must not spend this machine's CPU on the hosts' work.
        namespaces: the GPU pods' namespaces (GPU_NS for 1; else GPU_NS-0 …, the nodes' pods dealt
        round-robin): how many pods each eviction's admission policy takes as its parameters.
        labels: on every Node, GPU pod, ReplicaSet and PodDisruptionBudget the fleet makes (the demo marks
        its own so that its rollout selects them and its clean-up finds them).
        prefix: node names are <prefix>-<first>… (the demo's are unique to its run, so that it never
        meets a node of the cluster under its own name).
        exclusive: the fleet works only on what carries `labels`: an object of one of its names that
        exists without them is refused (FleetConflict) instead of taken over, and remove() deletes only
        what carries them. Without it an existing object is taken over (a fleet rebuilt on the same
        server, as the tests do).
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
        self.prefix = prefix
        if exclusive and not self.labels:
            raise ValueError("exclusive: the fleet needs labels to tell its own objects from others'")
        self.exclusive = exclusive

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

    # -- the cluster's own components, simulated ---------------------------------------------------
    def _start_sim(self) -> None:
        from driverd.cluster.kube import Kube, Target
        # a fleet of timed hosts is hundreds of nodes changing at once: their kubelets and the DaemonSet
        # controller act in parallel there, as in a cluster (the host-tree fleets of the tests: in order)
        workers = SIM_WORKERS if self.timed else 0
        if self.kubelet is None:
            self.kubelet = Kubelet(self, Kube(Target(kubeconfig=self.kubeconfig)), workers).start()
        if self.device_plugin and self.plugins is None:
            self.plugins = DaemonSetController(self, Kube(Target(kubeconfig=self.kubeconfig)), workers).start()

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

    def requests(self) -> int:
        """API requests of every node daemon and coordinator so far, as their clients counted them: daemons killed and
        started again included, spawned ones as they last reported."""
        return self._retired_requests + sum(sn.kube.requests for sn in self.nodes.values() if sn.kube) + \
            sum(c.coordinator.kube.requests for c in self.coordinators.values() if hasattr(c, "coordinator")) + \
            self.spawned_requests()


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


__all__ = ["CONFIG", "FAULTS", "GPU_NS", "NEW", "OLD", "PLUGIN", "PLUGIN_NS", "SIM_WORKERS", "DaemonSetController",
           "Fleet", "FleetConflict", "Kubelet", "SimNode", "spawn_coordinator"]
