#!/usr/bin/env python3
"""A rolling driver upgrade across a simulated fleet: what coordinating it costs.

Every node runs the real node code — the cluster agent (state machine, preflight, cordon, drain
through the Eviction API, state annotations, labels, condition, uncordon) and a coordinator
candidate in the Lease election — against an API server:
- --apiserver real (the default): the real control plane of tests/controlplane.py (kube-apiserver,
  etcd, kube-controller-manager with the disruption controller and garbage collector; built by
  .ci/build-control-plane), deploy/ applied, every node daemon with its own node-bound token of
  deploy/'s ServiceAccount (RBAC and the admission policies judge every call);
- --apiserver loopback: tests/apiserver, the in-process test server (no TLS, no etcd; its numbers
  are not a real apiserver's).

What a node's host does (--hosts):
- timed (the default): the node's work costs what it costs on a node — wall-clock time, not this
  machine's CPU (driverd.sim.timedhost): a transaction is --reload-s (the driver's load on the
  GPUs) + --validate-s (the workload check), the preflight --preflight-s; which driver runs and which
  pods' processes hold a GPU are a record in memory. The defaults are measured on GPU machines
  (docs/testing.md): 4.5 s from nvidia.ko's load to 4×H200 initialised (the kernel log; 3.2 s on
  1×H200), 2.46 s the workload check on 4×H200 (0.91 s on 1×H100). The coordinator runs in a
  process of its own (a node no rollout selects, started first so it holds the Lease); the other
  daemons are spread over --node-processes processes of their own (default: one per 250 daemons, at
  least 4; 0: threads of this process), one Kubernetes client, informers and watches each (nothing
  shared: each node's requests are its own); their hosts' GPU processes are the played kubelet's,
  read from a file.
- files: every node a simulated host tree with the simulated kernel, the node transaction the real
  one — every node's work is this machine's CPU (what the fleet bench measured before issue 34).

Each node has a GPU pod (a ReplicaSet's, under a PodDisruptionBudget; all in one namespace, or
dealt over --namespaces) whose process holds /dev/nvidia0 on its host, and a device-plugin
DaemonSet pod that follows the driverd.io/driver-ready label (--no-device-plugin: none). The
kubelets and the DaemonSet controller are played by one list + watch each (the harness: its
requests are the admin's, not driverd's); the drained GPU pods come back between rollouts. An
observer with its own watch counts unavailable nodes at every change.

  python bench/fleet.py --nodes 1000 --namespaces 20 --max-parallel 50,10 --json
  python bench/fleet.py --nodes 200 --hosts files --max-parallel 7 --json
  python bench/fleet.py --nodes 12 --max-parallel 3 --max-unavailable 25% --drain-timeout 2 --faults \\
      apiserver-restart,daemon-kill,pdb-never,node-notready,reload-fails,no-controller,two-pdbs,stuck-terminating

--max-parallel takes a list: one rollout after the other on the same fleet (to the new driver, back,
...), each measured on its own. --nodes takes a list too: the same rollouts on a fleet of each size,
one fleet after the other (each with a control plane of its own), and how the coordinator's CPU per
node scales with the fleet (issue 47's target: the largest fleet's at most 1.2x the smallest's).
Per rollout, first a one-node rollout of a node outside --nodes measures the per-node time now
(admitted -> done: the node's work and its own API path, alone), and (timed hosts) one round of node
transactions at the rollout's parallelism runs with no API at all; then the rollout of the N nodes.
Prints one JSON object (--json: on one line; with several rollouts {"runs": [...]}) with:
  makespan_s           first admission to the last node done
  one_node_s           the one-node rollout's admitted -> done
  ideal_s              ceil(N / min(maxParallel, the unavailability limit)) x one_node_s
  makespan_ratio       makespan_s / ideal_s
  work_round_s         one round of node transactions, no coordination (timed hosts)
  work_ideal_s, makespan_ratio_work  the same with work_round_s: what the coordination costs in all
  per_node_median_s    admitted -> done in the rollout (what contention adds to one_node_s); per_node_p90_s
                       and per_node_max_s: its spread (the slowest slot decides the makespan)
  per_state_median_s   how long nodes stayed in each state (admitted, cordoned, evicting, ...);
                       per_state_p90_s: the same, 90th percentile
  slot_gap_median_s    a node done -> the next admission (how long a freed slot stays empty)
  first_wave_s         the first maxParallel admissions, first to last
  preflight_s          the rollout's creation to its first admission
  admitted_by          who wrote the admissions (driverd.io/admitted-by): the coordinator's process
  daemon_processes     the processes the other daemons ran in (--node-processes; 0: threads here)
  api_requests_per_node   driverd's requests during the rollout / N as the apiserver counted them:
                       its audit log's requests of deploy/'s ServiceAccount (every daemon's, the
                       coordinator's included; the log survives an apiserver restart). Loopback: the
                       daemons' clients' count
  api_requests_by_kind the same per (verb resource/subresource), the largest
  event_reasons_per_node  the rollout's Node Events a node, by reason: one per transition, and the
                       waits a node said (WaitingForGPUs, WaitingForPods, ...)
  api_requests_per_node_client   the daemons' clients' own count (killed and restarted ones included)
  api_requests_per_node_metrics  apiserver_request_total's growth / N, summed over the apiserver's
                       lifetimes (every client: the harness and the controller-manager too)
  apiserver_restarts   restarts during the rollout (the apiserver-restart fault)
  cpu_s, cpu_ms_per_node  CPU from /proc of kube-apiserver (all lifetimes), etcd, the
                       controller-manager, the coordinator's process and this process (the fleet's
                       daemons and the harness) during the rollout
  admission_policy_ms_per_node  the apiserver's time in deploy/'s ValidatingAdmissionPolicies by
                       operation (CREATE is mostly the evictions: driverd-node-evictions judges
                       every pod of the evicted pod's namespace)
  machine              cores, load averages before/after, busy_cores (all of the machine's CPU
                       use over the rollout, other work included, from /proc/stat); second by second:
                       busy_cores_peak_1s, busy_cores_p90_1s and saturated_s (seconds with >= 90% of
                       the cores busy: then the makespan measures this machine, not the coordination);
                       with daemon processes, daemon_process_busy_p90_1s (the busiest one's cores)
                       and daemon_processes_saturated_s (seconds one of them used >= 0.9 of a core:
                       its daemons waited for its interpreter, and the makespan measures the harness)
  max_unavailable_seen, admissions_over_limit (nodes admitted while the nodes the rollout had taken
                       out — cordoned or being upgraded — were already past the limit: the guarantee;
                       a node going NotReady by itself may take max_unavailable_seen past the limit),
  limit_unavailable, left_cordoned_by_us, final_states, phase (Paused when the failures exceed
                       --failure-budget), fault_outcomes.
With several --nodes: {"sizes": [{"nodes": N, "runs": [...]}, ...], "scaling": [...]}, one scaling row
per maxParallel:
  coordinator_cpu_ms_per_node   the coordinator's CPU per node at each size (cpu_ms_per_node's)
  coordinator_cpu_ratio        the largest fleet's / the smallest's (the baseline: the smallest fleet
                               of the same run)
  api_requests_per_node, makespan_ratio   at each size

Faults (with one --max-parallel only): pdb-never, reload-fails, no-controller (a GPU pod nothing
would recreate), two-pdbs (the Eviction API answers 500), stuck-terminating (a finalizer keeps the
evicted pod Terminating) each fail their node; apiserver-restart, daemon-kill (mid-drain) and
node-notready (an idle node NotReady for a while, raising the unavailable count) end done.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FAILING = ("pdb-never", "reload-fails", "no-controller", "two-pdbs", "stuck-terminating")
SA_USER = "system:serviceaccount:driverd:driverd"
COORDINATOR_USER = "system:serviceaccount:driverd:driverd-coordinator"
DAEMONS_PER_PROCESS = 250       # node daemons a process of their own runs by default (node_processes)


def main(argv=None) -> int:
    from driverd.sim.timedhost import RELOAD_S, VALIDATE_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="50", help="the fleet's size; a comma list: a fleet of each size, one "
                    "after the other, and how the coordinator's CPU per node scales (default 50)")
    ap.add_argument("--max-parallel", default="10", help="spec.maxParallel; a comma list: one rollout after "
                    "the other on the same fleet (default 10)")
    ap.add_argument("--max-unavailable", default="10%", help="spec.maxUnavailable (default 10%%)")
    ap.add_argument("--hosts", choices=("timed", "files"), default="timed",
                    help="timed: a node's work is wall-clock time (default); files: simulated host trees")
    ap.add_argument("--reload-s", type=float, default=RELOAD_S, help=f"timed hosts: the driver's load on a node "
                    f"(default {RELOAD_S}: nvidia.ko to 4xH200 initialised, the kernel log)")
    ap.add_argument("--validate-s", type=float, default=VALIDATE_S, help=f"timed hosts: the workload check "
                    f"(default {VALIDATE_S}: 4xH200)")
    ap.add_argument("--preflight-s", type=float, default=0.0, help="timed hosts: a node's preflight (default 0)")
    ap.add_argument("--namespaces", type=int, default=1, help="spread the GPU pods over this many namespaces "
                    "(default 1: all in one, the most parameters for deploy/'s eviction policy)")
    ap.add_argument("--node-processes", type=int, default=None, metavar="K",
                    help="timed hosts: the daemons spread over K processes of their own (default: one per "
                         f"{DAEMONS_PER_PROCESS} daemons, at least 4; 0: threads of this process, one interpreter "
                         "lock for the whole fleet)")
    ap.add_argument("--switch-interval", type=float, default=0.1, metavar="S",
                    help="this interpreter's switch interval while the fleet runs (default 0.1; see run())")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", default="", help="comma list of: apiserver-restart, daemon-kill, pdb-never, "
                    "node-notready, reload-fails, no-controller, two-pdbs, stuck-terminating")
    ap.add_argument("--drain-timeout", type=int, default=30, help="seconds (pdb-never, two-pdbs, stuck-terminating "
                    "fail after this)")
    ap.add_argument("--failure-budget", type=int, default=None, help="default: the number of faults that fail "
                    "a node (lower: the rollout pauses)")
    ap.add_argument("--no-device-plugin", dest="device_plugin", action="store_false")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per rollout")
    ap.add_argument("--work-dir", "--workdir", dest="workdir", default=None)   # driverd's spelling, and the old one
    ap.add_argument("--apiserver", choices=("real", "loopback"), default="real")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeline", metavar="FILE", default=None,
                    help="write each rollout's per-node times (when the observer saw each state) to FILE as JSON "
                         "lines, one per rollout: where a slow node's time went")
    a = ap.parse_args(argv)
    sizes = _sizes(a.nodes)
    if len(sizes) == 1:
        a.nodes = sizes[0]
        res = run(a)
        runs = res.get("runs", [res])
    else:
        res = run_sizes(a, sizes)
        runs = [r for size in res["sizes"] for r in size["runs"]]
    print(json.dumps(res, indent=None if a.json else 2, sort_keys=True))
    return 0 if all(r["completed"] and r["admissions_over_limit"] == 0 and r["left_cordoned_by_us"] == 0
                    for r in runs) else 1


def _sizes(text) -> list[int]:
    try:
        sizes = [int(n) for n in str(text).split(",") if n.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"fleet.py: --nodes {text!r}: one or more numbers >= 1")
    return sizes


def run_sizes(a, sizes: list[int]) -> dict:
    """The same rollouts on a fleet of each size, one after the other (a control plane each), and per
    maxParallel how the coordinator's CPU per node, the requests per node and the makespan's ratio to
    the ideal go with the fleet's size; the baseline is the smallest fleet of this run."""
    out = []
    for n in sizes:
        workdir = os.path.join(a.workdir, f"nodes-{n}") if a.workdir else None
        res = run(argparse.Namespace(**(vars(a) | {"nodes": n, "workdir": workdir})))
        out.append({"nodes": n, "runs": res.get("runs", [res])})
    scaling = _scaling(out)
    for row in scaling:
        cpu = ", ".join(f"{n} nodes {ms} ms" for n, ms in zip(row["nodes"], row["coordinator_cpu_ms_per_node"]))
        print(f"fleet.py: maxParallel {row['max_parallel']}: coordinator CPU per node {cpu}: "
              f"{row['coordinator_cpu_ratio']}x the smallest fleet's (target <= 1.2); requests per node "
              f"{', '.join(map(str, row['api_requests_per_node']))}; makespan "
              f"{', '.join(map(str, row['makespan_ratio']))} x ideal", file=sys.stderr, flush=True)
    return {"nodes": sizes, "sizes": out, "scaling": scaling, "apiserver": getattr(a, "apiserver", "real")}


def _scaling(sizes: list[dict]) -> list[dict]:
    """Per maxParallel, in the order the rollouts ran: each size's numbers, smallest fleet first."""
    rows = []
    by_size = sorted(sizes, key=lambda s: s["nodes"])
    for i, first in enumerate(by_size[0]["runs"]):
        runs = [s["runs"][i] for s in by_size if i < len(s["runs"])]
        cpu = [r["cpu_ms_per_node"].get("coordinator") for r in runs]
        measured = len(cpu) > 1 and bool(cpu[0]) and cpu[-1] is not None     # a coordinator process of its own
        rows.append({"max_parallel": first["max_parallel"], "nodes": [r["nodes"] for r in runs],
                     "coordinator_cpu_ms_per_node": cpu,
                     "coordinator_cpu_ratio": round(cpu[-1] / cpu[0], 2) if measured else None,
                     "api_requests_per_node": [r["api_requests_per_node"] for r in runs],
                     "makespan_ratio": [r["makespan_ratio"] for r in runs]})
    return rows


class Real:
    """The real control plane, started for this bench, deploy/ applied."""

    def __init__(self, work: str) -> None:
        from pathlib import Path

        from tests.controlplane import ControlPlane, apply_deploy, find_binaries
        d, missing = find_binaries()
        if missing:
            raise SystemExit(f"fleet.py: {missing}")
        self.cp = ControlPlane(d, Path(work) / "control-plane").start()
        apply_deploy(self.cp, Path(work))
        self.server = self.cp

    def restart(self) -> None:
        self.cp.restart_apiserver()

    def mark(self) -> dict:
        cp = self.cp
        return {"audit": cp.audit_mark(), "metrics": sum(cp.metrics().values()), "restarts": cp.restarts,
                "policies": cp.policy_seconds(),
                "cpu": {"apiserver": cp.cpu_seconds("kube-apiserver"), "etcd": cp.cpu_seconds("etcd"),
                        "controller_manager": cp.cpu_seconds("kube-controller-manager")}}

    def counted(self, m0: dict, m1: dict) -> dict:
        """driverd's requests between two marks, as the apiserver's audit log has them: the node daemons'
        and the coordinator's (its own ServiceAccount)."""
        out = self.cp.audit_requests(SA_USER, m0["audit"], m1["audit"])
        for k, v in self.cp.audit_requests(COORDINATOR_USER, m0["audit"], m1["audit"]).items():
            out[k] = out.get(k, 0) + v
        return out

    def stop(self) -> None:
        self.cp.stop()


class Loopback:
    def __init__(self, work: str) -> None:
        from tests.apiserver import ApiServer
        self.server = ApiServer(host="127.0.0.1", port=0).start()

    def restart(self) -> None:
        self.server.restart()

    def mark(self) -> dict:
        return {"audit": None, "metrics": None, "restarts": None, "cpu": {}, "policies": {}}

    def counted(self, m0: dict, m1: dict) -> None:
        return None

    def stop(self) -> None:
        self.server.stop()


def run(a) -> dict:
    from driverd.sim.fleet import FAULTS
    faults = [f for f in a.faults.split(",") if f]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        raise SystemExit(f"fleet.py: unknown fault(s) {bad}; known: {', '.join(FAULTS)}")
    ps = [int(p) for p in str(a.max_parallel).split(",") if p.strip()]
    if not ps or min(ps) < 1:
        raise SystemExit(f"fleet.py: --max-parallel {a.max_parallel!r}: one or more numbers >= 1")
    if faults and len(ps) > 1:
        raise SystemExit("fleet.py: --faults with one --max-parallel only (a failed node stays failed)")
    rnd = random.Random(a.seed)
    # Hundreds of daemons' threads share this interpreter: every thread waiting for the interpreter lock
    # wakes once per switch interval (5 ms by default), so a burst of them (every daemon answering a
    # preflight, decoding the same watch event) turned into a storm of futex wake-ups that took both
    # cores (seen at 500 nodes: 169 s of system time in 2.5 min, the preflight never finished). Threads
    # here give the lock up at every network wait anyway; a longer interval only bounds how long one
    # computing thread may hold it. (A node's daemon has a handful of threads: no such storm.)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(getattr(a, "switch_interval", 0.1))
    work = a.workdir or tempfile.mkdtemp(prefix="driverd-fleet.")
    kind = getattr(a, "apiserver", "real")
    try:
        backend = (Real if kind == "real" else Loopback)(work)
        try:
            runs = _run(a, backend, faults, rnd, work, ps)
        finally:
            backend.stop()
    finally:
        sys.setswitchinterval(interval)
    for r in runs:
        r["apiserver"] = kind
    return runs[0] if len(runs) == 1 else {"runs": runs, "nodes": a.nodes, "apiserver": kind, "workdir": work}


class Observer:
    """The nodes as one more watch sees them: unavailable counts at every change, when each node of
    the measured rollout was admitted and done, the one-node rollout's times, fault triggers."""

    def __init__(self, calib: str, skip: set[str], limit: int) -> None:
        self.calib, self.skip, self.limit = calib, skip, limit
        self.lock = threading.Lock()
        self.unavailable: dict[str, bool] = {}
        self.driven: dict[str, bool] = {}
        self.states: dict[str, str] = {}
        self.hooks: list = []
        self.source = None          # the observer's informer, read again after a re-list
        self.reset(None, None)

    def reset(self, calib_rollout: str | None, rollout: str | None) -> None:
        with self.lock:
            self.calib_rollout, self.rollout = calib_rollout, rollout
            self.max_unavail, self.over = 0, 0
            self.admitted: dict[str, float] = {}
            self.done: dict[str, float] = {}
            self.entered: dict[str, dict[str, float]] = {}     # node -> state -> first seen (this rollout)
            self.calib_times: dict[str, float] = {}

    def __call__(self, kind: str, obj: dict) -> None:
        if kind == "SYNC" and self.source is not None:
            # a re-list (the watch was cut: the apiserver-restart fault) reports only the nodes that are
            # gone; every other node may have changed meanwhile: read them all, the counts first
            nodes = self.source.snapshot()
            with self.lock:
                for o in nodes:
                    self._count(o)
            for o in nodes:
                self._see("MODIFIED", o)
            return
        if not obj.get("metadata"):
            return
        self._see(kind, obj)

    def _count(self, obj: dict) -> None:
        from driverd.cluster import model as m
        v = m.NodeView.from_node(obj)
        if v.name != self.calib and v.name not in self.skip:
            self.unavailable[v.name] = v.unavailable
            self.driven[v.name] = v.unschedulable or v.active

    def _see(self, kind: str, obj: dict) -> None:
        from driverd.cluster import model as m
        with self.lock:
            v = m.NodeView.from_node(obj)
            ro = (v.rollout or "").split("/")[0]
            if v.name == self.calib:
                if ro and ro == self.calib_rollout:
                    if v.state == m.ADMITTED:
                        self.calib_times.setdefault("admitted", time.time())
                    if v.state in (m.DONE, m.FAILED) and "admitted" in self.calib_times:
                        self.calib_times.setdefault("done", time.time())
                return
            if v.name in self.skip:
                return
            if kind == "DELETED":
                self.unavailable.pop(v.name, None)
                self.driven.pop(v.name, None)
            else:
                self.unavailable[v.name] = v.unavailable
                # what the rollout itself takes out (cordoned or being upgraded); a node NotReady by
                # itself counts for max_unavailable_seen, and the coordinator stops counting it once it
                # has been NotReady past spec.notReadyTimeoutSeconds
                self.driven[v.name] = v.unschedulable or v.active
            self.max_unavail = max(self.max_unavail, sum(self.unavailable.values()))
            self.states[v.name] = v.state
            if self.rollout and ro == self.rollout:
                self.entered.setdefault(v.name, {}).setdefault(v.state, time.time())
                if v.state == m.ADMITTED and v.name not in self.admitted:
                    self.admitted[v.name] = time.time()
                    if sum(self.driven.values()) > self.limit:
                        self.over += 1
                if v.state in (m.DONE, m.FAILED) and v.name in self.admitted:
                    self.done.setdefault(v.name, time.time())
            for hook in self.hooks:
                hook(v)


def _run(a, backend, faults, rnd, work, ps) -> list[dict]:
    from driverd.cluster import model as m
    from driverd.cluster.informer import Informer
    from driverd.cluster.kube import Kube, Target, lease_path, node_path
    from driverd.cluster.lease import LEASE_NAME
    from driverd.sim.fleet import NEW, OLD, Fleet
    from driverd.sim.timedhost import NodeCosts
    timed = getattr(a, "hosts", "timed") == "timed"
    costs = NodeCosts(getattr(a, "reload_s", NodeCosts.reload_s), getattr(a, "validate_s", NodeCosts.validate_s),
                      getattr(a, "preflight_s", 0.0))
    t0 = time.monotonic()
    # one node more for the one-node rollout, and with timed hosts one for the coordinator's process
    fleet = Fleet(work, a.nodes + (2 if timed else 1), server=backend.server,
                  device_plugin=getattr(a, "device_plugin", True), hosts="timed" if timed else "files",
                  costs=costs, namespaces=getattr(a, "namespaces", 1)).build()
    build_s = time.monotonic() - t0
    calib = Fleet.node_name(a.nodes)
    coord_node = Fleet.node_name(a.nodes + 1) if timed else None
    outside = {calib} | ({coord_node} if coord_node else set())
    # who coordinates: on the real control plane deploy/'s own identity (`driverd cluster coordinator` in a
    # process of its own, as its Deployment runs it; the extra node is then an idle node outside the
    # rollouts); on the simulated API server the extra node's daemon, in a process of its own
    own = fleet.coordinator_mode == "own"
    coord = (Fleet.COORDINATOR if own else coord_node) if timed else None
    names = sorted(n for n in fleet.nodes if n not in outside)
    victims = rnd.sample(names, min(len(names), len(faults)))
    role = dict(zip(faults, victims))
    for fault, act in (("pdb-never", fleet.pdb_never), ("reload-fails", fleet.reload_fails),
                       ("two-pdbs", fleet.two_pdbs), ("stuck-terminating", fleet.stuck_terminating)):
        if fault in role:
            act(role[fault])
    if "no-controller" in role:
        fleet.no_controller(role["no-controller"], process=False)

    obs_kube = Kube(Target(kubeconfig=fleet.kubeconfig), retry_for_s=600)
    limit = _limit(a.max_unavailable, a.nodes)
    obs = Observer(calib, outside - {calib}, limit)
    fired: set = set()

    def hook(v):
        if "daemon-kill" in role and v.name == role["daemon-kill"] and v.state == m.EVICTING and "kill" not in fired:
            fired.add("kill")
            threading.Thread(target=lambda: (fleet.kill_node(v.name), time.sleep(1.0), fleet.start_node(v.name)),
                             daemon=True).start()
        if "node-notready" in role and obs.admitted and "notready" not in fired:
            # an idle node goes NotReady by itself for a while: the unavailable count rises
            fired.add("notready")
            threading.Thread(target=lambda: (fleet.set_ready(role["node-notready"], False), time.sleep(3.0),
                                             fleet.set_ready(role["node-notready"], True)), daemon=True).start()
        if "apiserver-restart" in role and "restart" not in fired and len(obs.done) >= max(1, a.nodes // 3):
            fired.add("restart")
            threading.Thread(target=backend.restart, daemon=True).start()
    obs.hooks.append(hook)
    nodes_inf = obs.source = Informer(obs_kube, node_path(), on_change=obs, name="observer")
    nodes_inf.start()
    nodes_inf.synced.wait(30)
    t1 = time.monotonic()
    if coord:
        # the coordinator first, in its own process: it takes the Lease and keeps it
        fleet._start_sim()
        if own:
            fleet.spawn_coordinator(coord)
        else:
            fleet.spawn_node(coord)
        holder = lambda: ((obs_kube.find(lease_path("driverd", LEASE_NAME)) or {}).get("spec") or {}  # noqa: E731
                          ).get("holderIdentity")
        if not fleet.wait(lambda: holder() == coord, timeout=120, step=0.5):
            raise SystemExit(f"fleet.py: the coordinator's daemon did not take the Lease (holder {holder()}); "
                             f"its log: {fleet.work / 'daemons' / (coord + '.log')}")
    fleet._start_sim()
    procs = node_processes(getattr(a, "node_processes", 0), a.nodes) if a.hosts == "timed" else 0
    # a fault's node stays a thread here (daemon-kill kills and restarts it alone)
    grouped = [nd for nd in fleet.nodes if nd != coord and nd not in role.values()] if procs else []
    for i in range(procs):
        if grouped[i::procs]:
            fleet.spawn_group(grouped[i::procs], switch_interval=sys.getswitchinterval())
    for nd in fleet.nodes:
        if nd != coord and nd not in grouped:
            fleet.start_node(nd)
    # every daemon up: its labels say what it runs
    ok = fleet.wait(lambda: all((n["metadata"].get("labels") or {}).get(m.L_VERSION) == OLD
                                for n in nodes_inf.snapshot()), timeout=max(300, a.nodes), step=1.0)
    if not ok:
        raise SystemExit("fleet.py: the node daemons did not start")
    start_s = time.monotonic() - t1
    runs = []
    try:
        for i, p in enumerate(ps):
            target = NEW if i % 2 == 0 else OLD
            if i:
                _clear_rollouts(fleet, obs_kube)
                fleet.workloads_back()          # the drained GPU pods return: the next drain has them too
            # the first time too: at 1,000 nodes the disruption controller had not yet counted the new
            # pods when the one-node rollout began (its eviction refused for 12 s: a 19 s "one node")
            if not fleet.wait_budgets(skip=set(role.values())):
                raise SystemExit("fleet.py: the GPU pods' PodDisruptionBudgets did not allow evictions again")
            r = _rollout(a, i, p, target, fleet, obs, obs_kube, backend, costs, calib, coord, outside, faults, role,
                         limit, timed)
            r.update(build_s=round(build_s, 2), start_s=round(start_s, 2), workdir=work)
            runs.append(r)
            print(f"fleet.py: maxParallel {p}: {r['phase']}, makespan {r['makespan_s']} s = {r['makespan_ratio']} x "
                  f"ideal, {r['api_requests_per_node']} requests per node", file=sys.stderr, flush=True)
            for line in _why_slow(r):
                print(f"fleet.py: maxParallel {p}: {line}", file=sys.stderr, flush=True)
            if r["phase"] not in ("Completed", "Failed"):
                break
    finally:
        fleet.stop()
        nodes_inf.close()
    return runs


def _rollout(a, i, p, target, fleet, obs, obs_kube, backend, costs, calib, coord, outside, faults, role, limit,
             timed) -> dict:
    from driverd.cluster import model as m
    from driverd.cluster.kube import node_path, rollout_path
    from tests.controlplane import proc_cpu_seconds
    calib_name = f"one-node-{i}"
    name = f"to-{target.replace('.', '-')}-{i}"
    obs.reset(calib_name, None)
    # the one-node rollout: the per-node time on this machine, now, with nothing else going on
    obs_kube.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                     "metadata": {"name": calib_name},
                                     "spec": {"driver": target, "nodeSelector": {"matchLabels": {
                                         "kubernetes.io/hostname": calib}}, "validation": {"timeoutSeconds": 60}}})
    if not fleet.wait(lambda: "done" in obs.calib_times, timeout=300):
        raise SystemExit("fleet.py: the one-node rollout did not finish")
    one_node = obs.calib_times["done"] - obs.calib_times["admitted"]
    effective = min(p, limit)
    work_round = _work_round(costs, effective, target, fleet) if timed else None
    obs.reset(calib_name, name)
    time.sleep(1.0)                 # let the start-up writes settle before counting
    n_fail = sum(1 for f in faults if f in FAILING)
    budget = n_fail if getattr(a, "failure_budget", None) is None else a.failure_budget
    mu = int(a.max_unavailable) if str(a.max_unavailable).isdigit() else a.max_unavailable
    req0, harness0 = fleet.requests(), fleet.harness_requests()
    mark0, cpu0 = backend.mark(), _cpu(fleet, coord, proc_cpu_seconds)
    obs_kube.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                     "metadata": {"name": name},
                                     "spec": {"driver": target, "maxParallel": p, "maxUnavailable": mu,
                                              "failureBudget": budget,
                                              "nodeSelector": {"matchExpressions": [{
                                                  "key": "kubernetes.io/hostname", "operator": "NotIn",
                                                  "values": sorted(outside)}]},
                                              "drain": {"timeoutSeconds": a.drain_timeout},
                                              "validation": {"timeoutSeconds": 60}}})
    t_start = time.time()
    end = time.monotonic() + a.timeout
    phase, why = None, None
    last_note = 0.0
    saturation = Saturation(pids=sorted({sn.proc.pid for nd, sn in fleet.nodes.items()
                                         if sn.proc is not None and nd != coord}),
                            cpu_of=proc_cpu_seconds).start()
    while time.monotonic() < end:
        if time.monotonic() - last_note > 15:
            last_note = time.monotonic()
            with obs.lock:
                states = dict(Counter(s for n, s in obs.states.items()))
            print(f"fleet.py: maxParallel {p}: {time.time() - t_start:5.0f}s {states} threads={threading.active_count()}",
                  file=sys.stderr, flush=True)
        ro = obs_kube.get(rollout_path(name))
        st = ro.get("status") or {}
        phase, why = st.get("phase"), f"{st.get('reason')}: {st.get('message')}"
        if phase in ("Completed", "Failed", "Refused", "Paused") and \
                st.get("observedGeneration") == ro["metadata"].get("generation"):
            break
        time.sleep(0.5)
    t_end = time.time()
    saturation.close()
    time.sleep(2.5)                 # the spawned daemons report their request counts every 2 s
    mark1, cpu1 = backend.mark(), _cpu(fleet, coord, proc_cpu_seconds)
    requests = fleet.requests() - req0
    harness = fleet.harness_requests() - harness0
    counted = backend.counted(mark0, mark1)
    raw = [n for n in obs_kube.list(node_path()).get("items") or [] if n["metadata"]["name"] not in outside]
    nodes_now = [m.NodeView.from_node(n) for n in raw]
    # who wrote each admission of this rollout (the coordinator's identity, driverd.io/admitted-by)
    admitted_by = Counter((n["metadata"].get("annotations") or {}).get(m.A_ADMITTED_BY) for n, v in zip(raw, nodes_now)
                          if (v.rollout or "").split("/")[0] == name)
    with obs.lock:
        per = [obs.done[k] - obs.admitted[k] for k in obs.done if k in obs.admitted]
        first = min(obs.admitted.values()) if obs.admitted else t_end
        last = max(obs.done.values()) if obs.done else t_end
        max_unavail, over = obs.max_unavail, obs.over
        phases = _state_quantiles(obs.entered)
        phases_p90 = _state_quantiles(obs.entered, 0.9)
        gap = _slot_gap(sorted(obs.admitted.values()), sorted(obs.done.values()), min(p, limit))
        wave = sorted(obs.admitted.values())[:min(p, limit)]
        timeline = {nd: dict(seen) for nd, seen in obs.entered.items()}
    if getattr(a, "timeline", None):
        with open(a.timeline, "a") as fh:
            fh.write(json.dumps({"rollout": name, "fleet_size": a.nodes, "max_parallel": p, "one_node_s": one_node,
                                 "nodes": timeline}) + "\n")
    reasons = _event_reasons(obs_kube, t_start, outside)
    per_node = statistics.median(per) if per else 0.0
    makespan = last - first
    rounds = math.ceil(a.nodes / effective)
    ideal = rounds * one_node
    n = a.nodes
    total = sum(counted.values()) if counted is not None else requests
    wall = cpu1["wall"] - cpu0["wall"]
    cpu = {k: round(cpu1[k] - cpu0[k], 2) for k in ("fleet", "coordinator") if k in cpu0 and k in cpu1}
    cpu.update({k: round(mark1["cpu"][k] - mark0["cpu"][k], 2) for k in mark1["cpu"]})
    final = Counter(v.state for v in nodes_now)
    out = {
        "nodes": n, "max_parallel": p, "target": target, "hosts": "timed" if timed else "files",
        "gpu_namespaces": len(fleet.gpu_namespaces),
        "faults": faults, "fault_nodes": role,
        "phase": phase, "phase_reason": why, "completed": phase in ("Completed", "Failed"),
        "preflight_s": round(first - t_start, 2),
        "one_node_s": round(one_node, 3), "per_node_median_s": round(per_node, 3),
        "per_node_p90_s": round(sorted(per)[int(0.9 * (len(per) - 1))], 3) if per else 0.0,
        "per_node_max_s": round(max(per), 3) if per else 0.0,
        "per_state_median_s": phases, "per_state_p90_s": phases_p90, "slot_gap_median_s": gap,
        "first_wave_s": round(wave[-1] - wave[0], 3) if wave else None,
        "makespan_s": round(makespan, 2), "ideal_s": round(ideal, 2),
        "makespan_ratio": round(makespan / ideal, 3) if ideal else None,
        "node_work_s": round(costs.work_s, 3) if timed else None,
        "work_round_s": None if work_round is None else round(work_round, 3),
        "work_ideal_s": None if work_round is None else round(rounds * work_round, 2),
        "makespan_ratio_work": None if not work_round else round(makespan / (rounds * work_round), 3),
        "api_requests_per_node": round(total / n, 1),
        "api_requests_counted_by": "audit log" if counted is not None else "clients",
        "api_requests_by_kind": None if counted is None else {
            f"{verb} {res}" + (f"/{sub}" if sub else ""): round(c / n, 2)
            for (verb, res, sub), c in sorted(counted.items(), key=lambda kv: -kv[1])[:12]},
        # the Node Events of the rollout by reason: one a transition, and the waits a node said (WaitingFor...)
        "event_reasons_per_node": {k: round(c / n, 2) for k, c in reasons.most_common(12)},
        "api_requests_per_node_client": round(requests / n, 1),
        "api_requests_per_node_metrics": None if mark1["metrics"] is None else
        round((mark1["metrics"] - mark0["metrics"]) / n, 1),
        "harness_requests_per_node": round(harness / n, 1),
        "apiserver_restarts": None if mark1["restarts"] is None else mark1["restarts"] - mark0["restarts"],
        "cpu_s": cpu, "cpu_ms_per_node": {k: round(v * 1000 / n, 1) for k, v in cpu.items()},
        # the apiserver's time in deploy/'s admission policies, by operation (its own histogram's sum)
        "admission_policy_ms_per_node": {k: round((v - mark0["policies"].get(k, 0.0)) * 1000 / n, 1)
                               for k, v in sorted(mark1["policies"].items())},
        "machine": {"cores": os.cpu_count(), "load_before": cpu0["load"], "load_after": cpu1["load"],
                    "busy_cores": round((cpu1["busy"] - cpu0["busy"]) / wall, 2) if wall > 0 else None,
                    "rollout_wall_s": round(wall, 1), **saturation.summary()},
        "admitted_by": dict(admitted_by), "coordinator": coord,
        "daemon_processes": len({sn.proc.pid for nd, sn in fleet.nodes.items() if sn.proc is not None and nd != coord}),
        "max_unavailable_seen": max_unavail, "admissions_over_limit": over,
        "limit_unavailable": limit, "effective_parallel": effective,
        "left_cordoned_by_us": sum(1 for v in nodes_now if v.cordoned_by_us or (v.unschedulable and v.state in
                                                                                   (m.DONE, m.FAILED))),
        "final_states": dict(final),
        "fault_outcomes": {f: {"node": nd, "state": next((v.state for v in nodes_now if v.name == nd), None),
                               "reason": next((f"{v.reason}: {v.message}" for v in nodes_now if v.name == nd), None)}
                           for f, nd in role.items()},
        # a node that failed without a fault of its own: the bench's faults reached past their node
        "failed_without_fault": {v.name: f"{v.reason}: {v.message}" for v in nodes_now
                                 if v.state == m.FAILED and v.name not in role.values()},
    }
    return out


def _clear_rollouts(fleet, kube) -> None:
    """The ended rollouts deleted before the next one (they hold no node, but every coordinator pass
    and every preflight looks at each): it starts as the first did."""
    from driverd.cluster.kube import rollout_path
    for ro in kube.list(rollout_path()).get("items") or []:
        kube.delete(rollout_path(ro["metadata"]["name"]))
    if not fleet.wait(lambda: not (kube.list(rollout_path()).get("items") or []), timeout=120, step=0.5):
        raise SystemExit("fleet.py: the ended rollouts were not deleted")


def _event_reasons(kube, since: float, outside: set[str]) -> Counter:
    """The driverd Events on the fleet's Nodes made since `since` (epoch s), counted by reason (the
    harness's admin list: not counted as driverd's requests)."""
    from driverd.cluster.events import NAMESPACE
    from driverd.cluster.kube import parse_time
    out: Counter = Counter()
    for e in kube.list(f"/api/v1/namespaces/{NAMESPACE}/events", fields="involvedObject.kind=Node").get("items") or []:
        made = parse_time((e.get("metadata") or {}).get("creationTimestamp"))
        if made is not None and made >= since - 1 and (e.get("involvedObject") or {}).get("name") not in outside:
            out[e.get("reason")] += 1
    return out


def _state_quantiles(entered: dict[str, dict[str, float]], q: float = 0.5) -> dict[str, float]:
    """How long the nodes stayed in each state of the upgrade (the q-quantile, the median by default,
    over the nodes that went on to a later one), as the observer's watch saw the changes."""
    from driverd.cluster import model as m
    order = [m.ADMITTED, m.CORDONED, m.WAITING, m.EVICTING, m.UNLOADING, m.VALIDATING, m.DONE]
    out = {}
    for i, st in enumerate(order[:-1]):
        spans = []
        for seen in entered.values():
            if st in seen:
                later = [seen[n] for n in order[i + 1:] if n in seen]
                if later:
                    spans.append(min(later) - seen[st])
        if spans:
            out[st] = round(statistics.median(spans) if q == 0.5 else sorted(spans)[int(q * (len(spans) - 1))], 3)
    return out


def _slot_gap(admitted: list[float], done: list[float], parallel: int) -> float | None:
    """The median time a slot stays empty: the k-th admission after the first `parallel` waits for the
    (k - parallel)-th node to be done."""
    gaps = [admitted[k] - done[k - parallel] for k in range(parallel, min(len(admitted), len(done) + parallel))]
    return round(statistics.median(gaps), 3) if gaps else None


def _work_round(costs, parallel: int, target: str, fleet) -> float:
    """One round of `parallel` node transactions at once with no API: timed hosts of their own (the
    fleet's stay as they are), each changing to `target`."""
    from driverd.apply.preflight import driver_config
    from driverd.sim.fleet import NEW, OLD
    from driverd.sim.scenario import RELEASE
    from driverd.sim.timedhost import TimedHost
    cfg = driver_config(fleet.cfg, target, "open", source="bench")
    hosts = [TimedHost(f"w{j}", costs, loaded=(OLD if target == NEW else NEW, "open"), kernel=RELEASE)
             for j in range(parallel)]
    threads = [threading.Thread(target=h.transact, args=(cfg,)) for h in hosts]
    t = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.monotonic() - t


def _busy_s() -> float:
    """The machine's busy CPU seconds so far, all cores and all processes (/proc/stat)."""
    with open("/proc/stat") as fh:
        cpu = [int(x) for x in fh.readline().split()[1:]]
    return (sum(cpu[:8]) - cpu[3] - cpu[4]) / os.sysconf("SC_CLK_TCK")


class Saturation:
    """The machine's busy cores second by second while a rollout runs: how long it had no CPU to
    spare (>= 90% of its cores busy). A rollout that spends its waves there measures this machine,
    not the coordination: the apiserver, etcd and the daemons wait for each other's CPU.

    The same for each process of node daemons (`pids`): one interpreter runs its Python on one core
    at a time, so a process near a whole core holds its daemons back however many cores the machine
    has spare (2,000 nodes in 4 processes on 16 cores: admitted -> cordoned took 5.3 s, not 0.2 s,
    with the machine at 10 of 16 cores). Then the makespan measures the harness's processes."""

    def __init__(self, step: float = 1.0, pids: list[int] | None = None, cpu_of=None) -> None:
        self.step, self.samples = step, []
        self.pids, self.cpu_of = list(pids or []), cpu_of
        self.proc_samples: list[float] = []     # per sample: the busiest daemon process's cores
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="saturation", daemon=True)

    def start(self) -> Saturation:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)

    def _procs(self) -> list[float]:
        return [self.cpu_of(pid) for pid in self.pids] if self.cpu_of else []

    def _run(self) -> None:
        last, procs, t = _busy_s(), self._procs(), time.monotonic()
        while not self.stop.wait(self.step):
            now, procs1, t1 = _busy_s(), self._procs(), time.monotonic()
            dt = max(t1 - t, 1e-3)
            self.samples.append((now - last) / dt)
            if procs1:
                self.proc_samples.append(max((b - a) / dt for a, b in zip(procs, procs1)))
            last, procs, t = now, procs1, t1

    def summary(self) -> dict:
        cores = os.cpu_count() or 1
        s, ps = sorted(self.samples), sorted(self.proc_samples)
        out = {"busy_cores_peak_1s": round(s[-1], 2) if s else None,
               "busy_cores_p90_1s": round(s[int(0.9 * (len(s) - 1))], 2) if s else None,
               "saturated_s": round(sum(self.step for x in s if x >= 0.9 * cores), 1)}
        if self.pids:
            out |= {"daemon_process_busy_p90_1s": round(ps[int(0.9 * (len(ps) - 1))], 2) if ps else None,
                    "daemon_processes_saturated_s": round(sum(self.step for x in ps if x >= 0.9), 1)}
        return out


def node_processes(asked: int | None, nodes: int) -> int:
    """The processes the node daemons run in: as asked, or one per DAEMONS_PER_PROCESS daemons and at
    least 4. One interpreter runs its daemons' Python one at a time: on 16 cores 250 daemons a process
    reacted to their admission in 0.19 s (median; 1,000 nodes), 500 a process in 5.3 s (2,000 nodes)."""
    if asked is not None:
        return asked
    return max(4, -(-nodes // DAEMONS_PER_PROCESS))


def _why_slow(r: dict) -> list[str]:
    """What a rollout's makespan measured besides the coordination, in words: seconds of it with the
    machine's cores all busy, or with a process of node daemons at a whole core (a tenth of the
    rollout or more)."""
    mach, wall = r.get("machine") or {}, (r.get("machine") or {}).get("rollout_wall_s") or 0
    out = []
    if wall and (mach.get("saturated_s") or 0) >= 0.1 * wall:
        out.append(f"the machine had no core to spare for {mach['saturated_s']} s of {wall} s: the makespan "
                   "measures its CPU, not the coordination")
    if wall and (mach.get("daemon_processes_saturated_s") or 0) >= 0.1 * wall:
        admitted = (r.get("per_state_median_s") or {}).get("admitted")     # none when no node got that far
        out.append(f"a process of node daemons used a whole core for {mach['daemon_processes_saturated_s']} s of "
                   f"{wall} s" + (f" (median admitted -> cordoned {admitted} s)" if admitted is not None else "") +
                   f": its daemons waited for its interpreter; give them more --node-processes "
                   f"(now {r.get('daemon_processes')})")
    return out


def _cpu(fleet, coord, proc_cpu_seconds) -> dict:
    """CPU seconds of the fleet (this process and the daemons' processes) and of the coordinator's, the
    machine's busy CPU (all of it, from /proc/stat, in seconds), the load averages, the wall clock."""
    groups = {sn.proc.pid for name, sn in fleet.nodes.items() if sn.proc is not None and name != coord}
    out = {"fleet": proc_cpu_seconds(os.getpid()) + sum(proc_cpu_seconds(pid) for pid in groups),
           "wall": time.monotonic(),
           "busy": _busy_s(),
           "load": [round(x, 2) for x in os.getloadavg()]}
    sn = fleet.nodes.get(coord) if coord else None
    if sn is not None and sn.proc is not None:
        out["coordinator"] = proc_cpu_seconds(sn.proc.pid)
    proc = fleet.coordinators.get(coord) if coord else None       # `driverd cluster coordinator` (own identity)
    if proc is not None and hasattr(proc, "pid"):
        out["coordinator"] = proc_cpu_seconds(proc.pid)
    return out


def _limit(max_unavailable, nodes: int) -> int:
    from driverd.cluster import model as m
    mu = int(max_unavailable) if str(max_unavailable).isdigit() else max_unavailable
    return m.Rollout.from_object({"metadata": {"name": "x"}, "spec": {"driver": "1.0", "maxUnavailable": mu}}
                                 ).unavailable_limit(nodes)


if __name__ == "__main__":
    sys.exit(main())
