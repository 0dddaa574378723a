"""Issue 44, item 1 (defence in depth): the coordinator may write admissions (the admission policy allows
the Lease holder that much), so a compromised coordinator could admit every node of a pool at once (a GPU
node's identity no longer can: it may not hold the Lease, tests/cluster/test_compromised_node.py). The admitted node's own agent checks the admission against the
rollout's rules as it can see them, read fresh from the API server: a canary that waits for `rollout
resume` takes no more nodes, no more than maxParallel nodes of the rollout are upgraded at once. An
admission beyond them is given back (idle, nothing cordoned, drained or installed) with a Warning; a
coordinator's own admissions always pass, so the rollout then finishes as it would have.

On the real control plane (deploy/'s policies), each daemon with its node-bound token, the coordinator with
its own; the forged admissions are written with the coordinator's token, as a compromised one would."""
from __future__ import annotations

import time

import pytest

from driverd.cluster import model as m
from driverd.cluster.kube import node_path, rollout_path
from driverd.sim.fleet import NEW, OLD, Fleet
from tests.cluster.realfleet import (  # noqa: F401 (make: a fixture)
    coordinator_token,
    hosts,
    make,
    refusals,
    rollout,
    start_with_coordinator,
    views,
    wait_phase,
)

pytestmark = [pytest.mark.real, pytest.mark.slow]
COORD = Fleet.COORDINATOR
EVENTS = "/api/v1/namespaces/default/events"


def _forge(cp, f, coordinator: str, node: str, name: str) -> None:
    """What the Lease holder may write on another node: an admission into rollout `name`, with its
    key and its driver (every check of the issue-30 defence passes), beyond the rollout's limits."""
    ro = f.admin.get(rollout_path(name))
    key = f"{name}/{ro['metadata']['uid']}/{ro['metadata']['generation']}"
    assert f.wait(lambda: (views(f)[node].preflight or {}).get("rollout") == key, 30), views(f)[node]
    ann = {m.A_STATE: m.ADMITTED, m.A_REASON: "Admitted", m.A_MESSAGE: f"admitted by {coordinator}",
           m.A_SINCE: "2025-01-01T00:00:00Z", m.A_ROLLOUT: key, m.A_TARGET: f"{NEW}/auto", m.A_ATTEMPT: "1",
           m.A_PREVIOUS: f"{OLD}/open", m.A_ADMITTED_BY: coordinator}
    cp.api("PATCH", node_path(node), {"metadata": {"annotations": ann}},
           token=coordinator_token(f, coordinator), content_type="application/merge-patch+json")


def _given_back(cp, f, node: str, *words: str) -> None:
    assert f.wait(lambda: views(f)[node].reason == "AdmissionBeyondLimits", 30), views(f)[node]
    time.sleep(1)                                     # and nothing moves afterwards
    v = views(f)[node]
    assert v.state == m.IDLE and not v.unschedulable and v.driver == OLD, vars(v)
    assert OLD in (f.nodes[node].root / "proc/driver/nvidia/version").read_text()
    evs = [e for e in cp.api("GET", EVENTS)["items"]
           if e["involvedObject"].get("name") == node and e["reason"] == "AdmissionBeyondLimits"]
    assert evs and evs[-1]["type"] == "Warning" and f"admission by {COORD} not acted on" in evs[-1]["message"], evs
    for w in words:       # a word, or a tuple of words any one of which is said
        assert any(x in evs[-1]["message"] for x in ((w,) if isinstance(w, str) else w)), (w, evs[-1]["message"])


def test_an_admission_past_a_paused_canary_is_given_back_and_the_rollout_goes_on_after_resume(control_plane,
                                                                                             deployed, make):
    """The issue's attack: canary 1, maxParallel 1: the canary is done and the rollout waits for
    `rollout resume` (Paused/CanaryDone); the Lease holder admits the two other nodes at once. Before
    the fix both were cordoned, drained and upgraded together."""
    cp = control_plane
    f = make(4)
    start_with_coordinator(f)
    targets = ["gpu-0001", "gpu-0002", "gpu-0003"]
    f.admin.create(rollout_path(), rollout("r", nodeSelector=hosts(*targets), canary=1, maxParallel=1))
    ro = wait_phase(f, "r", ("Paused",), timeout=90)
    assert ro["status"]["reason"] == "CanaryDone" and views(f)["gpu-0001"].driver == NEW
    for node in ("gpu-0002", "gpu-0003"):
        _forge(cp, f, COORD, node, "r")
    # the first forged node reads the rollout Paused/CanaryDone; the second may read it after the coordinator
    # rewrote its status around the first (a node admitted): then the canary it finds taken stops it, or the
    # other forged node, still admitted when it counts, already fills maxParallel 1
    for node, other in (("gpu-0002", "gpu-0003"), ("gpu-0003", "gpu-0002")):
        _given_back(cp, f, node, ("paused (CanaryDone)", "canary node(s) are taken (gpu-0001)",
                                  f"1 other node(s) of rollout r are being upgraded ({other}); its maxParallel is 1"))
    assert f.admin.get(rollout_path("r"))["status"]["phase"] == "Paused"
    # the operator resumes: the coordinator's own admissions pass the same check, one node at a time
    f.admin.patch(rollout_path("r"), {"spec": {"paused": False},
                                      "metadata": {"annotations": {"driverd.io/canary-approved": "true"}}})
    wait_phase(f, "r", ("Completed",), timeout=120)
    vs = views(f)
    assert [vs[n].driver for n in targets] == [NEW, NEW, NEW] and vs["gpu-0000"].driver == OLD
    assert refusals(deployed, f.audit_from) == []


def test_an_admission_past_max_parallel_is_given_back_while_another_node_upgrades(control_plane, deployed, make):
    """maxParallel 1: while the coordinator's node drains (a PDB that allows no eviction keeps it
    there), the Lease holder admits a second node: given back; the rollout's own order is untouched."""
    cp = control_plane
    f = make(3)
    start_with_coordinator(f)
    f.pdb_never("gpu-0001")
    f.admin.create(rollout_path(), rollout("p", nodeSelector=hosts("gpu-0001", "gpu-0002"), maxParallel=1,
                                           drain={"timeoutSeconds": 600}))
    assert f.wait(lambda: views(f)["gpu-0001"].state == m.EVICTING, 60), views(f)["gpu-0001"]
    assert views(f)["gpu-0002"].state == m.IDLE
    _forge(cp, f, COORD, "gpu-0002", "p")
    _given_back(cp, f, "gpu-0002", "1 other node(s) of rollout p are being upgraded (gpu-0001)", "maxParallel is 1")
    assert views(f)["gpu-0001"].state == m.EVICTING
    f.set_pdb("gpu-0001", 1)
    wait_phase(f, "p", ("Completed",), timeout=120)
    vs = views(f)
    assert vs["gpu-0001"].driver == NEW and vs["gpu-0002"].driver == NEW
    assert refusals(deployed, f.audit_from) == []


def test_the_limits_read_every_nodes_metadata_alone_from_the_real_apiserver(control_plane):
    """Issue 47: the check lists every Node at each admission, so what each list carries is paid once per
    admitted node. kube-apiserver answers a metadata-only list: what the check reads (state, rollout and
    target annotations, the labels a rollout selects on) is all there, the status (images, conditions) not."""
    import json as _json

    from driverd.cluster.kube import Kube, Target
    cp, names, SEL = control_plane, ["limits-md-0", "limits-md-1"], "test.driverd.io/limits-metadata"
    ann = {m.A_STATE: m.CORDONED, m.A_ROLLOUT: "r/uid-1/1", m.A_TARGET: f"{NEW}/open"}
    try:
        for n in names:
            cp.api("POST", node_path(), {"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": n, "labels": {SEL: "true"}, "annotations": ann}, "spec": {"unschedulable": True}})
            cp.api("PATCH", node_path(n) + "/status", {"status": {"images": [
                {"names": [f"img{i}@sha256:" + "a" * 64], "sizeBytes": 1} for i in range(20)]}},
                content_type="application/strategic-merge-patch+json")
        kube = Kube(Target(kubeconfig=cp.kubeconfig))
        full = kube.list(node_path(), labels=f"{SEL}=true")          # these two alone, whatever else runs
        meta = kube.list(node_path(), labels=f"{SEL}=true", metadata_only=True)
        assert meta["kind"] == "PartialObjectMetadataList" and len(meta["items"]) == len(names), meta["kind"]
        assert all(set(i) == {"kind", "apiVersion", "metadata"} for i in meta["items"]), meta["items"][0].keys()
        for f, p in zip(full["items"], meta["items"]):
            fv, pv = m.NodeView.from_node(f), m.NodeView.from_node(p)
            assert (pv.name, pv.state, pv.rollout, pv.target, pv.labels, pv.active) == \
                   (fv.name, fv.state, fv.rollout, fv.target, fv.labels, True)
        assert len(_json.dumps(meta)) < len(_json.dumps(full)) / 2
    finally:
        for n in names:
            try:
                cp.api("DELETE", node_path(n))
            except Exception:
                pass
