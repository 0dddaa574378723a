"""Fleet metrics: the coordinator's numbers per rollout (nodes upgrading, done, failed, pending, ...) and
its phase, on the /metrics of `driverd cluster coordinator --listen` (the coordinator's own identity,
issue 44; a node daemon holding the Lease served them before), read back with prometheus_client's own
parser of the text format."""
from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from driverd.cluster import model as m
from driverd.cluster.fleet_status import PHASES, STATES, FleetStatus
from driverd.cluster.kube import Kube, Target, node_path, rollout_path
from driverd.daemon.metrics import Metrics
from driverd.sim.fleet import NEW, OLD, Fleet
from tests.controlplane import reset
from tests.daemon.conftest import cluster_node


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, for every sample of the driverd_rollout/coordinator families."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith(("driverd_rollout", "driverd_coordinator")):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _rollout(name: str, driver: str, status: dict | None = None, deleting: bool = False) -> dict:
    md = {"name": name, "generation": 1}
    if deleting:
        md["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": md, "spec": {"driver": driver}, "status": status or {}}


def test_the_fleet_per_rollout_in_the_text_format():
    fleet = FleetStatus()
    met = Metrics()
    met.watch_fleet(fleet.snapshot)
    # not the coordinator (yet): it says so and counts nothing
    got = samples(met.render().decode())
    assert got == {("driverd_coordinator", ()): 0.0}
    live = {"phase": "Progressing", "nodes": {"total": 10, "done": 3, "failed": 1, "upgrading": 2, "pending": 2,
                                              "skipped": 1, "excluded": 0, "notReady": 1}}
    ended = {"phase": "Completed", "nodes": {"total": 4, "done": 4}}
    fleet.publish([_rollout("a", NEW), _rollout("b", OLD, ended), _rollout("gone", NEW, ended, deleting=True),
                   _rollout("bad", "x", {"phase": "Invalid"})], {"a": live})
    got = samples(met.render().decode())
    assert got[("driverd_coordinator", ())] == 1
    for state, v in {"done": 3, "failed": 1, "upgrading": 2, "pending": 2, "skipped": 1, "excluded": 0,
                     "not_ready": 1}.items():
        assert got[("driverd_rollout_nodes", (("rollout", "a"), ("state", state)))] == v, state
    assert got[("driverd_rollout_target_nodes", (("rollout", "a"),))] == 10
    assert got[("driverd_rollout_nodes", (("rollout", "b"), ("state", "done")))] == 4
    assert got[("driverd_rollout_nodes", (("rollout", "b"), ("state", "pending")))] == 0
    # one phase series per phase, the current one 1
    phases = {dict(k[1])["phase"]: v for k, v in got.items() if k[0] == "driverd_rollout_phase" and dict(k[1])["rollout"] == "a"}
    assert set(phases) == set(PHASES) and [p for p, v in phases.items() if v == 1] == ["Progressing"]
    assert got[("driverd_rollout_phase", (("phase", "Invalid"), ("rollout", "bad")))] == 1
    assert not [k for k in got if ("rollout", "gone") in k[1]]        # being deleted: no longer a rollout of the fleet
    assert {dict(k[1])["state"] for k in got if k[0] == "driverd_rollout_nodes"} == set(STATES.values())
    # the Lease went elsewhere: the other daemon counts now
    fleet.clear()
    assert samples(met.render().decode()) == {("driverd_coordinator", ()): 0.0}


def test_the_coordinator_counts_nodes_done_and_failed(tmp_path, deployed):
    """In-process daemons on the real control plane: the Lease holder's numbers after a rollout in
    which one node's load fails (rolled back)."""
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 3, server=deployed, lease_s=3).build()
    try:
        f.reload_fails("gpu-0001")
        f.start()
        k = Kube(Target(kubeconfig=f.kubeconfig))
        assert f.wait(lambda: all(m.NodeView.from_node(n).driver == OLD for n in k.list(node_path())["items"]), 60)
        k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                  "metadata": {"name": "r"}, "spec": {"driver": NEW, "failureBudget": 1}})
        assert f.wait(lambda: (k.get(rollout_path("r")).get("status") or {}).get("phase") == "Failed", 120)

        holder = f.coordinators[Fleet.COORDINATOR].coordinator          # the coordinator's own identity
        assert f.wait(lambda: holder.fleet.snapshot().coordinator and holder.fleet.snapshot().rollouts
                      and holder.fleet.snapshot().rollouts[0].phase == "Failed", 30)
        (c,) = holder.fleet.snapshot().rollouts
        assert (c.rollout, c.total, c.nodes["done"], c.nodes["failed"], c.nodes["pending"], c.nodes["upgrading"]) \
            == ("r", 3, 2, 1, 0, 0), c
        assert all(sn.coordinator is None for sn in f.nodes.values())    # no node coordinates
    finally:
        f.stop()


def test_the_coordinator_serves_the_fleet_on_metrics(tmp_path, daemons, deployed):
    """`driverd cluster coordinator --listen` (deploy/'s Deployment, its own identity) beside the one
    node's `driverd daemon` in cluster mode: it holds the Lease, its /metrics says how the rollout went and
    /readyz that it coordinates; the node daemon's /metrics has no fleet (it coordinates nothing)."""
    import urllib.error
    import urllib.request
    from driverd.sim.fleet import spawn_coordinator
    from tests.conftest import free_port, stop_process
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    port = free_port()
    p, log = spawn_coordinator(f.coordinator_kubeconfig(), Fleet.COORDINATOR, tmp_path, listen=f"127.0.0.1:{port}")

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
    try:
        root = cluster_node(f, "gpu-0000", coordinator=False)      # the node-bound token; its own side only
        d = daemons(root)
        d.wait_log(r"this node's side of rollouts only", 60)
        end = time.monotonic() + 60
        while True:
            try:
                code, text = get("/readyz")
                if code == 200 and "coordinates rollouts" in text:
                    break
            except OSError:
                pass
            assert time.monotonic() < end, log.read_text()[-2000:]
            time.sleep(0.3)
        k = Kube(Target(kubeconfig=f.kubeconfig))
        k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                  "metadata": {"name": "r"}, "spec": {"driver": NEW}})
        end = time.monotonic() + 90
        while True:
            got = samples(get("/metrics")[1])
            if got.get(("driverd_rollout_phase", (("phase", "Completed"), ("rollout", "r")))) == 1:
                break
            assert time.monotonic() < end, (got, d.log[-3000:])
            time.sleep(0.5)
        assert got[("driverd_coordinator", ())] == 1
        assert got[("driverd_rollout_nodes", (("rollout", "r"), ("state", "done")))] == 1
        assert got[("driverd_rollout_nodes", (("rollout", "r"), ("state", "upgrading")))] == 0
        assert got[("driverd_rollout_target_nodes", (("rollout", "r"),))] == 1
        assert m.NodeView.from_node(k.get(node_path("gpu-0000"))).driver == NEW
        assert samples(d.get("/metrics")[1]) == {}            # the node daemon serves no fleet
        assert get("/healthz")[0] == 200
        d.stop()
    finally:
        stop_process(p)
        f.stop()
