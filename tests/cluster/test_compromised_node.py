"""Issue 30: what the credential of a compromised GPU node can do, on the real control plane.

The attacker holds what node A's driverd holds: a TokenRequest token of deploy/'s ServiceAccount
bound to A (a Node-bound token; a DaemonSet pod's names its node the same way). deploy/'s RBAC and
its ValidatingAdmissionPolicies (base/admission-node-scope.yaml) must hold it to A's own Node
(driverd's keys, the cordon, GPUDriverReady), its own pods and Events about its own Node — never the
rollout Lease, another node's admission, a rollout's status or finalizer (issue 44: those are the
coordinator's, an identity of its own, ServiceAccount driverd-coordinator with a pod-bound token, and
only while it holds the Lease).
Nothing it writes may make the garbage collector delete an object or pin one (ownerReferences,
finalizers). And a node agent acts only on an admission naming a live rollout that selects it, with
that rollout's driver: anything else is handed back, pinned to the driver it runs, with a Warning.

Every test here failed before the fix (see the commit that added them)."""
from __future__ import annotations

import json
import time
import urllib.error
import uuid

import pytest

from driverd.cluster import model as m
from driverd.cluster.kube import Kube, Target, lease_path, node_path, rollout_path
from driverd.cluster.lease import Lease
from driverd.sim.fleet import GPU_NS, NEW, OLD, Fleet
from tests.cluster.realfleet import coordinator_token
from tests.controlplane import reset

A, B, CP = "gpu-0000", "gpu-0001", "control-plane-0"
N = "/api/v1/nodes/"
EVENTS = "/api/v1/namespaces/default/events"
MERGE = "application/merge-patch+json"
GHOST = {"apiVersion": "v1", "kind": "Namespace", "name": "ghost", "uid": str(uuid.UUID(int=1))}


@pytest.fixture
def fleet(deployed, tmp_path):
    """Two GPU nodes (their daemons not started: the tests speak for them) and a control-plane Node."""
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 2, server=deployed, lease_s=3).build()
    deployed.api("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": CP, "labels": {"node-role.kubernetes.io/control-plane": ""}}})
    yield f
    f.stop()


def _code(cp, method, path, body, token, ctype=MERGE) -> tuple[int, str]:
    try:
        cp.api(method, path, body, token=token, content_type=ctype)
        return 200, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}").get("message", "")  # noqa


def _refused(cp, method, path, body, token, *words, ctype=MERGE) -> str:
    code, msg = _code(cp, method, path, body, token, ctype)
    assert code == 403, (method, path, body, code, msg)
    for w in words:
        assert w in msg, (w, msg)
    return msg


def _allowed(cp, method, path, body, token, ctype=MERGE) -> None:
    code, msg = _code(cp, method, path, body, token, ctype)
    assert code == 200, (method, path, body, code, msg)


COORD, COORD2 = Fleet.COORDINATOR, "driverd-coordinator-1"


def _hold_lease(f: Fleet, name: str = COORD, duration_s: int = 3) -> Lease:
    """Coordinator replica `name` takes the rollout Lease as the coordinator does (waiting out a holder)."""
    lease = Lease(Kube(Target(kubeconfig=f.coordinator_kubeconfig(name)), retry_for_s=0), "driverd", name,
                  duration_s=duration_s)
    assert f.wait(lease.try_acquire, 15, step=0.5), f"{name} could not take the Lease"
    time.sleep(0.5)       # the apiserver's admission informer sees the new holder
    return lease


def _admission(me: str, rollout: str = "r/uid/1", target: str = f"{NEW}/auto", **extra) -> dict:
    """What the coordinator writes on a node it admits (coordinator._admit)."""
    ann = {m.A_STATE: m.ADMITTED, m.A_REASON: "Admitted", m.A_MESSAGE: f"admitted by {me}",
           m.A_SINCE: "2025-01-01T00:00:00Z", m.A_ROLLOUT: rollout, m.A_TARGET: target, m.A_ATTEMPT: "1",
           m.A_PREVIOUS: f"{OLD}/open", m.A_RETRY: None, m.A_PINNED: None, m.A_ADMITTED_BY: me, **extra}
    return {"metadata": {"annotations": ann}}


def _answered_preflight(cp, node: str) -> None:
    """The node's daemon has answered some rollout's preflight (what makes a node admissible)."""
    cp.api("PATCH", N + node, {"metadata": {"annotations": {m.A_PREFLIGHT: json.dumps({"ok": True, "rollout": "x"})}}},
           content_type=MERGE)


# -- 1 (critical): nothing a node writes deletes or pins an object --------------------------------------

def test_no_node_token_makes_the_garbage_collector_delete_or_pin_anything(control_plane, fleet):
    cp, f = control_plane, fleet
    a = cp.token("driverd", "driverd", node=A)
    for node in (B, CP):
        _answered_preflight(cp, node)
    # the patch (state=admitted and an owner that does not exist, or a finalizer) on its own Node
    admitted = {m.A_STATE: m.ADMITTED}
    _refused(cp, "PATCH", N + A, {"metadata": {"annotations": admitted, "ownerReferences": [GHOST]}}, a,
             "ownerReferences")
    _refused(cp, "PATCH", N + A, {"metadata": {"annotations": admitted, "finalizers": ["example.com/pin"]}}, a,
             "finalizers")
    # and on node B or a control-plane Node: nothing at all, even what the coordinator writes there (issue 44)
    for node in (B, CP):
        for extra in ({"ownerReferences": [GHOST]}, {"finalizers": ["example.com/pin"]}, {}):
            _refused(cp, "PATCH", N + node, {"metadata": {"annotations": admitted, **extra}}, a,
                     "may write only its own Node")
    _refused(cp, "PATCH", N + B, _admission(A), a, "may write only its own Node", "coordinator")
    # not even the coordinator (it holds the Lease) on any Node
    c = coordinator_token(f)
    _hold_lease(f)
    for node in (B, CP, A):
        _refused(cp, "PATCH", N + node, {"metadata": {"annotations": admitted, "ownerReferences": [GHOST]}}, c,
                 "ownerReferences")
        _refused(cp, "PATCH", N + node, {"metadata": {"annotations": admitted, "finalizers": ["example.com/pin"]}},
                 c, "finalizers")
    _allowed(cp, "PATCH", N + B, _admission(COORD), c)          # what the coordinator may write there
    # DriverRollouts: driverd's own finalizer only, no owner (the coordinator); nothing of them (a node)
    cp.api("POST", rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                    "metadata": {"name": "r"}, "spec": {"driver": NEW, "paused": True}})
    _refused(cp, "PATCH", rollout_path("r"), {"metadata": {"finalizers": [m.FINALIZER]}}, a, "cannot patch")
    _refused(cp, "PATCH", rollout_path("r"), {"metadata": {"ownerReferences": [GHOST]}}, c, "ownerReferences")
    _refused(cp, "PATCH", rollout_path("r"), {"metadata": {"finalizers": [m.FINALIZER, "example.com/pin"]}}, c,
             "finalizers")
    _allowed(cp, "PATCH", rollout_path("r"), {"metadata": {"finalizers": [m.FINALIZER]}}, c)
    # the Lease itself cannot be handed to the garbage collector either
    lease = cp.api("GET", lease_path("driverd", "driverd-rollout"))
    lease["metadata"]["ownerReferences"] = [GHOST]
    _refused(cp, "PUT", lease_path("driverd", "driverd-rollout"), lease, c, "ownerReferences",
             ctype="application/json")
    _refused(cp, "PUT", lease_path("driverd", "driverd-rollout"), lease, a, "cannot update", ctype="application/json")
    # the collector had its chance: every object is still there
    time.sleep(3)
    for path in (N + B, N + CP, N + A, rollout_path("r"), lease_path("driverd", "driverd-rollout")):
        cp.api("GET", path)


# -- 2 (high): another node drained into a driver nobody asked for --------------------------------------

def _warning(cp, node: str, reason: str) -> dict | None:
    evs = [e for e in cp.api("GET", EVENTS)["items"]
           if e["involvedObject"].get("name") == node and e["reason"] == reason]
    return max(evs, key=lambda e: int(e["metadata"]["resourceVersion"])) if evs else None


def _started(deployed, tmp_path) -> tuple[Fleet, str, str]:
    """Two GPU nodes with their daemons running on OLD and the coordinator (its own identity) holding the
    Lease: (fleet, node A, node B)."""
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 2, server=deployed, lease_s=3).build()
    f.start()
    k = f.admin
    assert f.wait(lambda: all(_view(f, n).driver == OLD for n in (A, B)), 60)
    assert f.wait(lambda: ((k.find(lease_path("driverd", "driverd-rollout")) or {}).get("spec") or {})
                  .get("holderIdentity") == COORD, 30)
    time.sleep(0.5)
    return f, A, B


def _view(f: Fleet, node: str) -> m.NodeView:
    return m.NodeView.from_node(f.admin.get(node_path(node)))


def test_a_node_admits_no_other_node(control_plane, deployed, tmp_path):
    """The issue's attack: a node's daemon admits another node into 550 while no DriverRollout exists
    (before the fix: 200, and that node cordoned, drained and installed 550)."""
    cp = control_plane
    f, holder, other = _started(deployed, tmp_path)
    try:
        tok = cp.token("driverd", "driverd", node=other)
        forged = {"metadata": {"annotations": {m.A_STATE: m.ADMITTED, m.A_REASON: "Admitted",
                                               m.A_ROLLOUT: "forged/0/1", m.A_TARGET: f"{NEW}/open"}}}
        _refused(cp, "PATCH", N + holder, forged, tok, "driverd-")
        time.sleep(2)
        v = _view(f, holder)
        assert v.state == m.IDLE and not v.unschedulable and v.driver == OLD, vars(v)
    finally:
        f.stop()


def test_the_agent_hands_back_an_admission_no_live_rollout_made(control_plane, deployed, tmp_path):
    """Written by hand (an admin; anything the policy does not judge), or by the coordinator (a compromised
    one: the policy lets the Lease holder admit) naming a
    rollout with another driver or one that does not select the node: the node's agent does not
    cordon, drain or install; it records the node failed, pinned to the driver it runs, with a
    Warning naming who wrote the admission (before the fix: the node was upgraded)."""
    cp = control_plane
    f, holder, other = _started(deployed, tmp_path)
    try:
        k = f.admin

        def rejected(node: str, since: str) -> None:
            assert f.wait(lambda: _view(f, node).reason == "AdmissionRejected" and _view(f, node).since != since,
                          30), vars(_view(f, node))
            time.sleep(1)                 # nothing moves afterwards
            v = _view(f, node)
            assert v.state == m.FAILED and not v.unschedulable and v.driver == OLD, vars(v)
            assert v.rollout is None and v.target == "", vars(v)
            ann = k.get(node_path(node))["metadata"]["annotations"]
            assert ann[m.A_PINNED] == f"{OLD}/{v.flavor}" and m.A_PREVIOUS not in ann, ann
            assert OLD in (f.nodes[node].root / "proc/driver/nvidia/version").read_text()

        # by hand, no rollout at all
        k.patch(node_path(holder), {"metadata": {"annotations": {
            m.A_STATE: m.ADMITTED, m.A_REASON: "Admitted", m.A_ROLLOUT: "forged/0/1", m.A_TARGET: f"{NEW}/open"}}})
        rejected(holder, "")
        ev = _warning(cp, holder, "AdmissionRejected")
        assert ev and ev["type"] == "Warning", ev
        assert "not written by a live rollout's coordinator" in ev["message"] and "no DriverRollout forged" \
            in ev["message"] and "managedFields" in ev["message"], ev["message"]
        # the holder (the policy lets it admit) names a live rollout, with another driver than the rollout's
        k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                  "metadata": {"name": "r"}, "spec": {"driver": NEW, "paused": True}})
        ro = k.get(rollout_path("r"))
        key = f"r/{ro['metadata']['uid']}/{ro['metadata']['generation']}"
        assert f.wait(lambda: (_view(f, other).preflight or {}).get("rollout") == key, 30)
        htok = coordinator_token(f)
        since = _view(f, other).since
        _allowed(cp, "PATCH", N + other, _admission(COORD, key, f"{OLD}/open"), htok)
        rejected(other, since)
        ev = _warning(cp, other, "AdmissionRejected")
        assert ev and f"admitted by {COORD}" in ev["message"] and f"installs {NEW}/auto, not {OLD}/open" \
            in ev["message"], ev
        # ... or a rollout that does not select the node
        k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                  "metadata": {"name": "elsewhere"},
                                  "spec": {"driver": NEW, "paused": True,
                                           "nodeSelector": {"matchLabels": {"pool": "other"}}}})
        ro = k.get(rollout_path("elsewhere"))
        key = f"elsewhere/{ro['metadata']['uid']}/{ro['metadata']['generation']}"
        since = _view(f, other).since
        _allowed(cp, "PATCH", N + other, _admission(COORD, key, f"{NEW}/auto"), htok)
        rejected(other, since)
        ev = _warning(cp, other, "AdmissionRejected")
        assert ev and "does not select" in ev["message"], ev
    finally:
        f.stop()


# -- 3 (high): rollout status forged --------------------------------------------------------------------

def test_rollout_status_and_finalizers_are_the_lease_holders_only(control_plane, fleet):
    """A node never writes them (RBAC); a coordinator replica only while it holds the Lease (policy)."""
    cp, f = control_plane, fleet
    a = cp.token("driverd", "driverd", node=A)
    c, c2 = coordinator_token(f), coordinator_token(f, COORD2)
    cp.api("POST", rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                    "metadata": {"name": "r"}, "spec": {"driver": NEW, "paused": True}})
    _hold_lease(f)
    forged = ({"status": {"phase": "Completed", "reason": "Completed", "observedGeneration": 1}},
              {"status": {"failedNodes": [{"node": B, "reason": "forged"}], "nodes": {"failed": 1}}})
    for body in forged:
        _refused(cp, "PATCH", rollout_path("r", status=True), body, a, "cannot patch")
        _refused(cp, "PATCH", rollout_path("r", status=True), body, c2, "does not hold the Lease", COORD)
    _refused(cp, "PATCH", rollout_path("r"), {"metadata": {"finalizers": [m.FINALIZER]}}, a, "cannot patch")
    _refused(cp, "PATCH", rollout_path("r"), {"metadata": {"finalizers": [m.FINALIZER]}}, c2, "Lease")
    for body in forged:                  # the coordinator writes it
        _allowed(cp, "PATCH", rollout_path("r", status=True), body, c)
    _allowed(cp, "PATCH", rollout_path("r"), {"metadata": {"finalizers": [m.FINALIZER]}}, c)


# -- 4 (medium): evictions, the Lease, Events ---------------------------------------------------------------

def test_evictions_only_of_pods_on_its_own_node(control_plane, fleet):
    cp, f = control_plane, fleet
    a = cp.token("driverd", "driverd", node=A)

    def pod(ns: str, name: str, node: str) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
                "spec": {"nodeName": node, "automountServiceAccountToken": False,
                         "containers": [{"name": "c", "image": "x:1"}]}}
    f.running_pod("kube-system", pod("kube-system", "kube-proxy-b", B))
    f.running_pod(GPU_NS, pod(GPU_NS, "solo-a", A))
    try:
        evict = lambda ns, name: ("POST", f"/api/v1/namespaces/{ns}/pods/{name}/eviction",  # noqa: E731
                                  {"apiVersion": "policy/v1", "kind": "Eviction",
                                   "metadata": {"name": name, "namespace": ns}})
        _refused(cp, *evict(GPU_NS, f"train-{B}-0"), a, "own node", B, ctype="application/json")
        _refused(cp, *evict("kube-system", "kube-proxy-b"), a, "own node", B, ctype="application/json")
        _allowed(cp, *evict(GPU_NS, "solo-a"), a, ctype="application/json")
        # its own GPU pod under a PDB: the eviction is judged by the PDB (201 or 429), not refused
        code, msg = _code(cp, *evict(GPU_NS, f"train-{A}-0"), a, ctype="application/json")
        assert code in (200, 429), (code, msg)
    finally:
        cp.api("DELETE", "/api/v1/namespaces/kube-system/pods/kube-proxy-b",
               {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})


def test_a_node_creates_only_a_validation_workload_pod_on_itself(control_plane, fleet):
    """Issue 42: a rollout's validation workload pod (spec.validation.workloadPod) is created by the node's own
    identity, in driverd's namespace, which allows privileged pods (the DaemonSet's). Its token may create
    only that pod — on its own node, runtime class nvidia, nothing of the host, no credential — and delete
    it there; never a privileged pod, one on another node, or one that would carry a ServiceAccount's token
    (the coordinator's) or a secret onto the node."""
    from driverd.cluster import workloadpod as wlp
    cp = control_plane
    a = cp.token("driverd", "driverd", node=A)
    pods = "/api/v1/namespaces/driverd/pods"
    made: list[str] = []

    def pod(name: str, node: str = A, *, spec: dict | None = None, container: dict | None = None,
            labels: dict | None = None, meta: dict | None = None) -> tuple:
        p = wlp.manifest(name, "driverd", node, "r", m.WorkloadPod("cuda-check:1", ("/check",)), gpu=True)
        p["spec"].update(spec or {})
        p["spec"]["containers"][0].update(container or {})
        p["metadata"].update(meta or {})
        if labels is not None:
            p["metadata"]["labels"] = labels
        return "POST", pods, p
    try:
        # the agent's own pod on its own node, and its deletion
        _allowed(cp, *pod("validation-a"), a, ctype="application/json")
        made.append("validation-a")
        _allowed(cp, "DELETE", f"{pods}/validation-a", None, a, ctype="application/json")
        made.remove("validation-a")
        _refused(cp, *pod("on-b", B), a, "own node", B, ctype="application/json")
        _refused(cp, *pod("unlabelled", labels={}), a, "driverd.io/validation", ctype="application/json")
        _refused(cp, *pod("runc", spec={"runtimeClassName": None}), a, "runtimeClassName nvidia",
                 ctype="application/json")
        _refused(cp, *pod("privileged", container={"securityContext": {"privileged": True}}), a, "privileged",
                 ctype="application/json")
        _refused(cp, *pod("sys-admin", container={"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}), a,
                 "added capability", ctype="application/json")
        _refused(cp, *pod("host-root", spec={"volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
                          container={"volumeMounts": [{"name": "root", "mountPath": "/host"}]}), a,
                 "nothing of the host", ctype="application/json")
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            _refused(cp, *pod(host.lower(), spec={host: True}), a, "nothing of the host", ctype="application/json")
        # the coordinator's ServiceAccount, whose token kube-apiserver would mount into the pod on this node
        _refused(cp, *pod("coordinator", spec={"serviceAccountName": "driverd-coordinator",
                                               "automountServiceAccountToken": True}), a, "validation workload pod",
                 ctype="application/json")
        _refused(cp, *pod("coordinator-sa", spec={"serviceAccountName": "driverd-coordinator"}), a,
                 "without credentials", ctype="application/json")
        _refused(cp, *pod("secret-env", container={"env": [{"name": "T", "valueFrom": {"secretKeyRef": {
            "name": "any", "key": "token"}}}]}), a, "without credentials", ctype="application/json")
        _refused(cp, *pod("pinned", meta={"finalizers": ["example.com/pin"]}), a, "finalizers",
                 ctype="application/json")
        # RBAC: in driverd's namespace only
        gpu_jobs = pod("elsewhere")
        gpu_jobs[2]["metadata"]["namespace"] = GPU_NS
        code, msg = _code(cp, "POST", f"/api/v1/namespaces/{GPU_NS}/pods", gpu_jobs[2], a, "application/json")
        assert code == 403 and "cannot create resource" in msg, (code, msg)
        # another node's validation pod (made by an admin here) is not its to delete
        cp.api("POST", pods, pod("validation-b", B)[2])
        made.append("validation-b")
        _refused(cp, "DELETE", f"{pods}/validation-b", None, a, "own node", B, ctype="application/json")
    finally:
        for name in made:
            cp.api("DELETE", f"{pods}/{name}", {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})


def _lease(holder: str | None, duration: int, *, name: str = "driverd-rollout", renew: str | None = None,
           transitions: int = 0) -> dict:
    now = renew or time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": "driverd"},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration, "acquireTime": now,
                     "renewTime": now, "leaseTransitions": transitions}}


def test_the_lease_names_only_its_writer_for_a_sane_time(control_plane, fleet):
    """A node may not write the Lease at all (issue 44: RBAC gives it none); a coordinator replica holds it
    only in its own pod's name, for a sane term, counting a takeover."""
    cp, f = control_plane, fleet
    a = cp.token("driverd", "driverd", node=A)
    c = coordinator_token(f)
    leases = lease_path("driverd")
    js = "application/json"
    _refused(cp, "POST", leases, _lease(A, 15), a, "cannot create", ctype=js)                # a node: never
    _refused(cp, "POST", leases, _lease(COORD2, 15), c, "holder", ctype=js)                  # in another's name
    _refused(cp, "POST", leases, _lease(COORD, 15, name="other"), c, "driverd-rollout", ctype=js)  # another Lease
    _refused(cp, "POST", leases, _lease(COORD, 2**31 - 1, renew="2099-01-01T00:00:00.000000Z"), c,
             "leaseDurationSeconds", ctype=js)                                            # 68 years
    # a far renewTime is no claim: driverd judges a holder by when it saw the record change, so the
    # next replica takes the Lease one duration after the first stops renewing
    cp.api("POST", leases, _lease(COORD, 3, renew="2099-01-01T00:00:00.000000Z"), token=c)
    other = Lease(Kube(Target(kubeconfig=f.coordinator_kubeconfig(COORD2)), retry_for_s=0), "driverd", COORD2,
                  duration_s=3)
    assert not other.try_acquire()
    time.sleep(3.3)
    assert other.try_acquire()
    cur = cp.api("GET", lease_path("driverd", "driverd-rollout"))
    # the first may not stretch the second's term, give it back for it, or take it without counting
    for spec in ({"leaseDurationSeconds": 2**31 - 1}, {"holderIdentity": None},
                 {"holderIdentity": COORD, "leaseTransitions": cur["spec"]["leaseTransitions"]}):
        body = json.loads(json.dumps(cur))
        body["spec"].update(spec)
        _refused(cp, "PUT", lease_path("driverd", "driverd-rollout"), body, c, ctype=js)
    body = json.loads(json.dumps(cur))
    body["spec"].update(holderIdentity=A, leaseTransitions=cur["spec"]["leaseTransitions"] + 1)
    _refused(cp, "PUT", lease_path("driverd", "driverd-rollout"), body, a, "cannot update", ctype=js)
    # taking it over as the protocol does (a dead holder's successor) stays possible: see the limit in docs
    body["spec"].update(holderIdentity=COORD)
    _allowed(cp, "PUT", lease_path("driverd", "driverd-rollout"), body, c, ctype=js)


def _event(node: str, *, source: str = "driverd", host: str | None = None, instance: str | None = None,
           kind: str = "Node", reason: str = "NodeNotReady") -> dict:
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": f"{node}.", "namespace": "default"},
            "involvedObject": {"apiVersion": "v1", "kind": kind, "name": node}, "reason": reason,
            "message": "forged", "type": "Warning", "source": {"component": source, "host": host or node},
            "reportingComponent": source, "reportingInstance": instance or host or node,
            "firstTimestamp": "2025-01-01T00:00:00Z", "lastTimestamp": "2025-01-01T00:00:00Z", "count": 1}


def test_events_are_driverds_own_about_its_own_node(control_plane, fleet):
    cp, f = control_plane, fleet
    a = cp.token("driverd", "driverd", node=A)
    js = "application/json"
    _hold_lease(f)                      # the coordinator holds the Lease: A is a node like any other
    _refused(cp, "POST", EVENTS, _event(B, source="kubelet"), a, "Event", ctype=js)          # as B's kubelet
    _refused(cp, "POST", EVENTS, _event(A, source="kubelet"), a, "Event", ctype=js)          # as its own kubelet
    _refused(cp, "POST", EVENTS, _event(A, host=A, instance=B), a, "Event", ctype=js)        # in B's name
    _refused(cp, "POST", EVENTS, _event(B, host=A), a, "Events about its own Node", ctype=js)  # about B
    _allowed(cp, "POST", EVENTS, _event(A), a, ctype=js)                                     # what an agent writes
    c = coordinator_token(f)
    _allowed(cp, "POST", EVENTS, _event(B, host=COORD, reason="Admitted"), c, ctype=js)      # the coordinator's


def test_its_own_nodes_status_changes_no_label_or_owner(control_plane, fleet):
    """nodes/status keeps a Node's metadata writable: its labels there are as guarded as through
    the Node itself (a node labelling itself control-plane attracts what is meant for one)."""
    cp = control_plane
    a = cp.token("driverd", "driverd", node=A)
    st = "application/strategic-merge-patch+json"
    mine = {"status": {"conditions": [{"type": "GPUDriverReady", "status": "True", "reason": "DriverValidated"}]}}
    for extra in ({"labels": {"node-role.kubernetes.io/control-plane": ""}}, {"annotations": {"other.io/x": "1"}},
                  {"ownerReferences": [GHOST]}, {"finalizers": ["example.com/pin"]}):
        _refused(cp, "PATCH", N + A + "/status", {**mine, "metadata": extra}, a, ctype=st)
    _allowed(cp, "PATCH", N + A + "/status", mine, a, ctype=st)
    labels = cp.api("GET", N + A)["metadata"].get("labels") or {}
    assert "node-role.kubernetes.io/control-plane" not in labels


# -- the agent's check of an admission, case by case (no API server) ------------------------------------

def _rollout_obj(**kw) -> dict:
    md = {"name": "r", "uid": "u1", "generation": 2, **kw.pop("metadata", {})}
    return {"metadata": md, "spec": {"driver": NEW, "flavor": "open", **kw.pop("spec", {})},
            "status": kw.pop("status", {})}


@pytest.mark.parametrize("change,why", [
    ({}, None),
    ({"rollout": ""}, "names no rollout"),
    ({"rollout": "gone/u1/2"}, "no DriverRollout gone exists"),
    ({"rollout": "r/u0/2"}, "is another object (uid u1, the admission names u0)"),
    ({"obj": {"status": {"phase": "Completed", "observedGeneration": 2}}}, "has ended (Completed)"),
    ({"obj": {"status": {"phase": "Aborted", "observedGeneration": 2},
              "metadata": {"annotations": {m.A_ABORT: "true"}}}}, None),           # tick gives it back
    ({"obj": {"metadata": {"deletionTimestamp": "2025-01-01T00:00:00Z"}}}, None),  # tick gives it back
    ({"obj": {"spec": {"nodeSelector": {"matchLabels": {"pool": "b"}}}}}, "does not select this node"),
    ({"target": f"{NEW}/proprietary"}, f"installs {NEW}/open, not {NEW}/proprietary"),
    ({"target": ""}, f"installs {NEW}/open, not (no target)"),
    ({"obj": {"spec": {"driver": "latest"}}}, "cannot be carried out: spec.driver"),
    ({"preflight": None}, "preflight answer for r/u1/2 is missing"),
    ({"preflight": {"rollout": "r/u1/1", "ok": True}}, "is missing"),
    ({"preflight": {"rollout": "r/u1/2", "ok": False}}, "is a refusal"),
    # the node's watch of the rollouts still shows it ended; the API says an operator's retry reopened it
    ({"obj": {"status": {"phase": "Failed", "observedGeneration": 2}},
      "fresh": {"status": {"phase": "Progressing", "observedGeneration": 2}}}, None),
    ({"obj": {"status": {"phase": "Failed", "observedGeneration": 2}}}, "has ended (Failed)"),
])
def test_the_agent_acts_only_on_an_admission_a_live_rollout_made(change, why):
    from driverd.cluster.agent import NodeAgent
    obj = _rollout_obj(**change.get("obj", {}))
    fresh = _rollout_obj(**change["fresh"]) if "fresh" in change else obj
    agent = NodeAgent.__new__(NodeAgent)
    agent.rollouts = type("Rollouts", (), {"get": staticmethod(lambda name: obj if name == "r" else None),
                                           "put": staticmethod(lambda o: None)})()
    # the agent reads a rollout fresh by a list by name (its RBAC lists rollouts, it does not get them)
    agent.kube = type("Kube", (), {"list": staticmethod(
        lambda path, fields=None: {"items": [fresh] if fields == "metadata.name=r" else []})})()
    agent.pools = type("Pools", (), {"snapshot": staticmethod(lambda: [])})()      # no DriverPools
    key = change.get("rollout", "r/u1/2")
    pre = change.get("preflight", {"rollout": "r/u1/2", "ok": True})
    ann = {m.A_STATE: m.ADMITTED, m.A_ROLLOUT: key, m.A_TARGET: change.get("target", f"{NEW}/open"),
           **({m.A_PREFLIGHT: json.dumps(pre)} if pre else {})}
    v = m.NodeView.from_node({"metadata": {"name": A, "annotations": ann, "labels": {"pool": "a"}}})
    got = agent._admission_problem(v)
    assert (got is None) if why is None else (got is not None and why in got), got
