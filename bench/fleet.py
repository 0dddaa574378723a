#!/usr/bin/env python3
"""A rolling driver upgrade across a simulated fleet, measured.

Every node runs the real node code (cluster agent: state machine, drain through the Eviction API,
node transaction on its own simulated host tree; and a coordinator candidate in the Lease election)
against an API server:
- --apiserver real (the default): the real control plane of tests/controlplane.py (kube-apiserver,
  etcd, kube-controller-manager with the disruption controller and garbage collector; built by
  .ci/build-control-plane), deploy/ applied, every node daemon with its own node-bound token of
  deploy/'s ServiceAccount (RBAC and the admission policy judge every call);
- --apiserver loopback: tests/apiserver, the in-process test server (no TLS, no etcd: faster, for
  large N on a small machine; its numbers are not a real apiserver's).
Each node has a GPU pod (a ReplicaSet's, under a
PodDisruptionBudget) whose process holds /dev/nvidia0 on the host, and a device-plugin DaemonSet pod
that follows the driverd.io/driver-ready label (--no-device-plugin: none). An observer with its own
watch counts unavailable nodes at every change.

  python bench/fleet.py --nodes 200 --max-parallel 10 --max-unavailable 5% --json
  python bench/fleet.py --apiserver loopback --nodes 500 --max-parallel 10 --max-unavailable 5% --json
  python bench/fleet.py --nodes 60 --max-parallel 5 --max-unavailable 10% --faults apiserver-restart,daemon-kill,pdb-never,node-notready,reload-fails,no-controller,two-pdbs,stuck-terminating

First a one-node rollout on a node of its own (not counted in --nodes) measures the per-node time
on this machine, in this run; then the rollout of the N nodes. Prints one JSON object (--json) with:
nodes, one_node_s (admitted -> done of the one-node rollout), makespan_s (first admission to the
last node done), ideal_s = ceil(N / min(maxParallel, the unavailability limit)) x one_node_s,
makespan_ratio, per_node_median_s (admitted -> done in the big rollout: what contention costs),
preflight_s, api_requests_per_node (driverd's requests during the rollout / nodes, as the API server
counted them: on the real one the growth of `apiserver_request_total` over the resources driverd
uses, less the harness's own requests (its client-side count); on the loopback one the daemons'
client-side count), api_requests_per_node_client (the daemons' clients, daemons killed and restarted
included), api_requests_per_node_audit (real: the audit log's requests of driverd's ServiceAccount), max_unavailable_seen (the observer),
admissions_over_limit (nodes admitted while the nodes the rollout had taken out — cordoned or being
upgraded — were already past the limit: the guarantee; a node going NotReady by itself may take
max_unavailable_seen past the limit),
limit_unavailable, left_cordoned_by_us, final_states, phase (Paused when the failures exceed
--failure-budget).

Faults: pdb-never, reload-fails, no-controller (a GPU pod nothing would recreate), two-pdbs (the
Eviction API answers 500), stuck-terminating (a finalizer keeps the evicted pod Terminating) each
fail their node; apiserver-restart, daemon-kill (mid-drain) and node-notready (an idle node NotReady
for a while, raising the unavailable count) end done.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
import math
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--max-parallel", type=int, default=10)
    ap.add_argument("--max-unavailable", default="5%")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", default="", help="comma list of: apiserver-restart, daemon-kill, pdb-never, "
                    "node-notready, reload-fails")
    ap.add_argument("--drain-timeout", type=int, default=30, help="seconds (pdb-never, two-pdbs, stuck-terminating "
                    "fail after this)")
    ap.add_argument("--failure-budget", type=int, default=None, help="default: the number of faults that fail "
                    "a node (lower: the rollout pauses)")
    ap.add_argument("--no-device-plugin", dest="device_plugin", action="store_false")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--work-dir", "--workdir", dest="workdir", default=None)   # driverd's spelling, and the old one
    ap.add_argument("--apiserver", choices=("real", "loopback"), default="real")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = run(a)
    print(json.dumps(res, indent=None if a.json else 2, sort_keys=True))
    return 0 if res["completed"] and res["admissions_over_limit"] == 0 and res["left_cordoned_by_us"] == 0 else 1


FAILING = ("pdb-never", "reload-fails", "no-controller", "two-pdbs", "stuck-terminating")
# What driverd's daemons call (the metric's `resource` label); the controller-manager's own traffic
# (PodDisruptionBudget status, its informers) falls mostly outside.
DRIVERD_RESOURCES = {"nodes", "pods", "events", "leases", "driverrollouts", "driverpools", "runtimeclasses",
                     "resourceclaims", "daemonsets"}
SA_USER = "system:serviceaccount:driverd:driverd"


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

    def counted(self) -> float:
        return sum(v for (verb, res, sub), v in self.cp.metrics().items() if res in DRIVERD_RESOURCES)

    def audited(self) -> int | None:
        return len(self.cp.audited(SA_USER))

    def stop(self) -> None:
        self.cp.stop()


class Loopback:
    def __init__(self, work: str) -> None:
        from tests.apiserver import ApiServer
        self.server = ApiServer(host="127.0.0.1", port=0).start()

    def restart(self) -> None:
        self.server.restart()

    def counted(self) -> float | None:
        return None

    def audited(self) -> int | None:
        return None

    def stop(self) -> None:
        self.server.stop()


def run(a) -> dict:
    from driverd.sim.fleet import FAULTS
    faults = [f for f in a.faults.split(",") if f]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        raise SystemExit(f"fleet.py: unknown fault(s) {bad}; known: {', '.join(FAULTS)}")
    rnd = random.Random(a.seed)
    work = a.workdir or tempfile.mkdtemp(prefix="driverd-fleet.")
    kind = getattr(a, "apiserver", "real")
    backend = (Real if kind == "real" else Loopback)(work)
    try:
        return _run(a, backend, faults, rnd, work) | {"apiserver": kind}
    finally:
        backend.stop()


def _run(a, backend, faults, rnd, work) -> dict:
    import threading as th

    from driverd.cluster import model as m
    from driverd.cluster.informer import Informer
    from driverd.cluster.kube import Kube, Target, node_path, parse_time, rollout_path
    from driverd.sim.fleet import NEW, OLD, Fleet
    t0 = time.monotonic()
    fleet = Fleet(work, a.nodes + 1, server=backend.server, device_plugin=getattr(a, "device_plugin", True)).build()
    build_s = time.monotonic() - t0
    calib = Fleet.node_name(a.nodes)          # the one-node rollout's node, outside the measured N
    names = sorted(n for n in fleet.nodes if n != calib)
    victims = rnd.sample(names, min(len(names), len(faults)))
    role = dict(zip(faults, victims))
    for fault, act in (("pdb-never", fleet.pdb_never), ("reload-fails", fleet.reload_fails),
                       ("two-pdbs", fleet.two_pdbs), ("stuck-terminating", fleet.stuck_terminating)):
        if fault in role:
            act(role[fault])
    if "no-controller" in role:
        fleet.no_controller(role["no-controller"], process=False)

    obs_kube = Kube(Target(kubeconfig=fleet.kubeconfig), retry_for_s=600)
    limit = _limit(a)
    lock = th.Lock()
    seen = {"max_unavail": 0, "admitted": {}, "done": {}, "states": {}, "over": 0}
    unavailable: dict[str, bool] = {}
    driven: dict[str, bool] = {}

    def observe(kind, obj):
        if not obj.get("metadata"):
            return
        with lock:
            v = m.NodeView.from_node(obj)
            if v.name == calib:
                if v.state == m.ADMITTED:
                    seen.setdefault("calib_admitted", time.time())
                if v.state in (m.DONE, m.FAILED):
                    seen.setdefault("calib_done", time.time())
                return
            if kind == "DELETED":
                unavailable.pop(v.name, None)
                driven.pop(v.name, None)
            else:
                unavailable[v.name] = v.unavailable
                # what the rollout itself takes out (cordoned or being upgraded); a node NotReady by
                # itself counts for max_unavailable_seen, and the coordinator stops counting it once it
                # has been NotReady past spec.notReadyTimeoutSeconds
                driven[v.name] = v.unschedulable or v.active
            now_unavail = sum(unavailable.values())
            seen["max_unavail"] = max(seen["max_unavail"], now_unavail)
            seen["states"][v.name] = v.state
            t = parse_time(v.since)
            if v.state == m.ADMITTED and t and v.name not in seen["admitted"]:
                seen["admitted"][v.name] = time.time()
                if sum(driven.values()) > limit:
                    seen["over"] += 1
            if v.state in (m.DONE, m.FAILED) and v.name in seen["admitted"]:
                seen["done"].setdefault(v.name, time.time())
            hook(v)

    fired: set = set()

    def hook(v):
        if "daemon-kill" in role and v.name == role["daemon-kill"] and v.state == m.EVICTING and "kill" not in fired:
            fired.add("kill")
            th.Thread(target=lambda: (fleet.kill_node(v.name), time.sleep(1.0), fleet.start_node(v.name)),
                      daemon=True).start()
        if "node-notready" in role and seen["admitted"] and "notready" not in fired:
            # an idle node goes NotReady by itself for a while: the unavailable count rises
            fired.add("notready")
            th.Thread(target=lambda: (fleet.set_ready(role["node-notready"], False), time.sleep(3.0),
                                      fleet.set_ready(role["node-notready"], True)), daemon=True).start()
        if "apiserver-restart" in role and "restart" not in fired and len(seen["done"]) >= max(1, a.nodes // 3):
            fired.add("restart")
            th.Thread(target=backend.restart, daemon=True).start()

    nodes_inf = Informer(obs_kube, node_path(), on_change=observe, name="observer").start()
    nodes_inf.synced.wait(30)
    fleet.start()
    # every daemon up: its labels say what it runs
    ok = fleet.wait(lambda: all((n["metadata"].get("labels") or {}).get(m.L_VERSION) == OLD
                                for n in nodes_inf.snapshot()), timeout=300)
    if not ok:
        raise SystemExit("fleet.py: the node daemons did not start")
    # the one-node rollout: the per-node time on this machine, now
    calib_name = "one-node"
    obs_kube.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                     "metadata": {"name": calib_name},
                                     "spec": {"driver": NEW, "nodeSelector": {"matchLabels": {
                                         "kubernetes.io/hostname": calib}}, "validation": {"timeoutSeconds": 60}}})
    if not fleet.wait(lambda: "calib_done" in seen, timeout=300):
        raise SystemExit("fleet.py: the one-node rollout did not finish")
    one_node = seen["calib_done"] - seen["calib_admitted"]
    with lock:
        seen["max_unavail"] = 0
    time.sleep(1.0)                 # let the start-up writes settle before counting
    req0, harness0, obs0 = fleet.requests(), fleet.harness_requests(), obs_kube.requests
    counted0, audited0 = backend.counted(), backend.audited()
    n_fail = sum(1 for f in faults if f in FAILING)
    budget = n_fail if getattr(a, "failure_budget", None) is None else a.failure_budget
    name = "to-" + NEW.replace(".", "-")
    obs_kube.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                     "metadata": {"name": name},
                                     "spec": {"driver": NEW, "maxParallel": a.max_parallel,
                                              "maxUnavailable": int(a.max_unavailable) if a.max_unavailable.isdigit()
                                              else a.max_unavailable, "failureBudget": budget,
                                              "nodeSelector": {"matchExpressions": [{
                                                  "key": "kubernetes.io/hostname", "operator": "NotIn",
                                                  "values": [calib]}]},
                                              "drain": {"timeoutSeconds": a.drain_timeout},
                                              "validation": {"timeoutSeconds": 60}}})
    t_start = time.time()
    end = time.monotonic() + a.timeout
    phase = None
    last_note = 0.0
    while time.monotonic() < end:
        if time.monotonic() - last_note > 15:
            last_note = time.monotonic()
            with lock:
                states = dict(Counter(seen["states"].values()))
            print(f"fleet.py: {time.time() - t_start:5.0f}s {states} threads={th.active_count()}", file=sys.stderr,
                  flush=True)
        ro = obs_kube.get(rollout_path(name))
        st = ro.get("status") or {}
        phase = st.get("phase")
        if phase in ("Completed", "Failed", "Refused", "Paused") and \
                st.get("observedGeneration") == ro["metadata"].get("generation"):
            break
        time.sleep(0.5)
    t_end = time.time()
    requests = fleet.requests() - req0
    harness = fleet.harness_requests() - harness0 + obs_kube.requests - obs0
    counted = backend.counted()
    counted = None if counted is None else counted - counted0 - harness
    audited = backend.audited()
    audited = None if audited is None else audited - audited0
    nodes_now = [m.NodeView.from_node(n) for n in obs_kube.list(node_path()).get("items") or [] if
                 n["metadata"]["name"] != calib]
    fleet.stop()
    nodes_inf.close()
    with lock:
        per = [seen["done"][k] - seen["admitted"][k] for k in seen["done"] if k in seen["admitted"]]
        first = min(seen["admitted"].values()) if seen["admitted"] else t_end
        last = max(seen["done"].values()) if seen["done"] else t_end
    per_node = statistics.median(per) if per else 0.0
    makespan = last - first
    # the rollout can never run more nodes at once than maxParallel nor than the unavailability limit
    effective = min(a.max_parallel, limit)
    ideal = math.ceil(a.nodes / effective) * one_node
    final = Counter(v.state for v in nodes_now)
    return {
        "nodes": a.nodes, "max_parallel": a.max_parallel, "faults": faults, "fault_nodes": role,
        "phase": phase, "completed": phase in ("Completed", "Failed"),
        "build_s": round(build_s, 2), "preflight_s": round(first - t_start, 2),
        "one_node_s": round(one_node, 3), "per_node_median_s": round(per_node, 3),
        "makespan_s": round(makespan, 2), "ideal_s": round(ideal, 2),
        "makespan_ratio": round(makespan / ideal, 3) if ideal else None,
        "api_requests_per_node": round((requests if counted is None else counted) / a.nodes, 1),
        "api_requests_per_node_client": round(requests / a.nodes, 1),
        "api_requests_per_node_audit": None if audited is None else round(audited / a.nodes, 1),
        "max_unavailable_seen": seen["max_unavail"], "admissions_over_limit": seen["over"],
        "limit_unavailable": limit, "effective_parallel": effective,
        "left_cordoned_by_us": sum(1 for v in nodes_now if v.cordoned_by_us or (v.unschedulable and v.state in
                                                                                   (m.DONE, m.FAILED))),
        "final_states": dict(final),
        "fault_outcomes": {f: {"node": n, "state": next((v.state for v in nodes_now if v.name == n), None),
                               "reason": next((f"{v.reason}: {v.message}" for v in nodes_now if v.name == n), None)}
                           for f, n in role.items()},
        "workdir": work,
    }


def _limit(a) -> int:
    from driverd.cluster import model as m
    mu = int(a.max_unavailable) if a.max_unavailable.isdigit() else a.max_unavailable
    return m.Rollout.from_object({"metadata": {"name": "x"}, "spec": {"driver": "1.0", "maxUnavailable": mu}}
                                 ).unavailable_limit(a.nodes)


if __name__ == "__main__":
    sys.exit(main())
