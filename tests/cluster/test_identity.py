"""driverd's identity on the real kube-apiserver: deploy/'s RBAC through the real RBAC authorizer
(exactly the permissions driverd's calls need: a missing or an excess one fails here), every call a
rollout makes as the apiserver's audit log saw it, and deploy/'s ValidatingAdmissionPolicy holding a
node's token to its own Node (and its own pods)."""
from __future__ import annotations

import json
import time
import urllib.error

import pytest

from driverd.sim.fleet import GPU_NS, NEW, OLD, PLUGIN_NS, Fleet
from tests.cluster.realfleet import COORDINATOR_USER, SA_USER, coordinator_token
from tests.controlplane import reset
from tests.test_deploy import COORDINATOR_NEEDS, NODE_NEEDS

# Granted to every authenticated user by the apiserver's own bootstrap roles (system:basic-user ...).
EVERYONE = {("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
            ("authorization.k8s.io", "selfsubjectrulesreviews", "create"),
            ("authentication.k8s.io", "selfsubjectreviews", "create")}


@pytest.fixture
def fleet(deployed, tmp_path):
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 2, server=deployed, lease_s=3, device_plugin=True).build()
    yield f
    f.stop()


def _code(cp, method, path, body, token, ctype="application/merge-patch+json") -> tuple[int, str]:
    try:
        cp.api(method, path, body, token=token, content_type=ctype)
        return 200, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}").get("message", "")  # noqa


def _rules(cp, token: str, namespace: str) -> set[tuple]:
    r = cp.api("POST", "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
               {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
                "spec": {"namespace": namespace}}, token=token)
    out = set()
    for rule in r["status"]["resourceRules"]:
        for g in rule.get("apiGroups", []):
            for res in rule.get("resources", []):
                for v in rule.get("verbs", []):
                    out.add((g, res, v, tuple(rule.get("resourceNames") or ())))
    return out


def test_the_service_account_holds_exactly_what_driverd_needs(control_plane, fleet):
    """The real authorizer's view of the node token (SelfSubjectRulesReview, in driverd's namespace
    where the Lease rules add to the cluster ones): every need granted, nothing more."""
    tok = control_plane.token("driverd", "driverd", node="gpu-0000")
    granted = _rules(control_plane, tok, "driverd")
    have = {(g, r, v) for g, r, v, _ in granted} - EVERYONE
    need = {(g, r, v) for g, r, v, _ in NODE_NEEDS}
    assert need - have == set(), f"missing: {sorted(need - have)}"
    assert have - need == set(), f"excess: {sorted(have - need)}"
    # the coordinator's own token (issue 44): its needs, the Lease by name, nothing of a node's
    ctok = coordinator_token(fleet)
    cgranted = _rules(control_plane, ctok, "driverd")
    chave = {(g, r, v) for g, r, v, _ in cgranted} - EVERYONE
    cneed = {(g, r, v) for g, r, v, _ in COORDINATOR_NEEDS}
    assert cneed - chave == set() and chave - cneed == set(), (sorted(cneed - chave), sorted(chave - cneed))
    # the Lease: create (cannot be limited by name) and the rest on driverd's own Lease only
    lease_rules = {(v, names) for g, r, v, names in cgranted if r == "leases"}
    assert lease_rules == {("create", ())} | {(v, ("driverd-rollout",)) for v in ("get", "update", "list", "watch")}
    # and the real authorizer says no to what the rules leave out: for a node, the Lease and rollout writes too
    for verb, path in (("GET", "/api/v1/namespaces/driverd/secrets"), ("GET", "/api/v1/namespaces/driverd/leases/other"),
                       ("GET", "/api/v1/namespaces/driverd/leases/driverd-rollout"),
                       ("PATCH", "/apis/driverd.io/v1alpha1/driverrollouts/x/status"),
                       ("DELETE", "/api/v1/nodes/gpu-0000"), ("DELETE", "/apis/driverd.io/v1alpha1/driverrollouts/x"),
                       ("GET", "/apis/apps/v1/namespaces/gpu-operator/daemonsets")):
        path = path.replace("/api/v1/namespaces/driverd/leases", "/apis/coordination.k8s.io/v1/namespaces/driverd/leases")
        code, msg = _code(control_plane, verb, path, {} if verb == "PATCH" else None, tok)
        assert code == 403 and SA_USER in msg, (verb, path, code, msg)


def test_every_call_of_a_rollout_is_allowed_and_listed(control_plane, fleet):
    """A rollout with a forced drain (the PDB never allows it), run by daemons holding node-bound
    tokens of deploy/'s ServiceAccount: every request the apiserver audited from that account is one
    NODE_NEEDS lists, none was refused by RBAC or admission, and every listed need was exercised
    (GPU users by request, by RuntimeClass and by DRA claim are on the nodes, and a device-plugin
    DaemonSet pod whose DaemonSet driverd reads; the rollout's validation workload pod, which the played
    kubelet ends Succeeded)."""
    import threading
    from tests.cluster.test_workload_pod import _end, _validation_pods
    f = fleet
    f.pdb_never("gpu-0000")
    # GPU users of the other kinds: a pod with the NVIDIA RuntimeClass (driverd lists RuntimeClasses)
    # and one holding a DRA ResourceClaim (driverd gets the claim to see whether it is a GPU)
    for name, spec in (("rc-user", {"runtimeClassName": "nvidia"}),
                       ("claim-user", {"resourceClaims": [{"name": "gpu", "resourceClaimName": "some-claim"}]})):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": GPU_NS},
               "spec": {"nodeName": "gpu-0001", "automountServiceAccountToken": False,
                        "containers": [{"name": "c", "image": "x:1"}], **spec}}
        f.running_pod(GPU_NS, pod)
    before = len(control_plane.audited(SA_USER))
    cbefore = len(control_plane.audited(COORDINATOR_USER))
    f.start()
    k = f.admin
    # the daemons are up (their nodes labelled driver-ready) and the device plugin runs on both nodes
    assert f.wait(lambda: len(k.list(f"/api/v1/namespaces/{PLUGIN_NS}/pods")["items"]) == 2, 60)
    stop = threading.Event()

    def kubelet() -> None:          # each validation workload pod's container runs and exits 0
        ended: set[str] = set()
        while not stop.wait(0.2):
            for p in _validation_pods(f):
                if p["metadata"]["uid"] not in ended and (p.get("status") or {}).get("phase") == "Running":
                    ended.add(p["metadata"]["uid"])
                    _end(f, p, 0)
    t = threading.Thread(target=kubelet, daemon=True)
    t.start()
    try:
        k.create("/apis/driverd.io/v1alpha1/driverrollouts", {
            "apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "r"},
            "spec": {"driver": NEW, "maxParallel": 2, "maxUnavailable": 2, "drain": {"timeoutSeconds": 2, "force": True},
                     "validation": {"workloadPod": {"image": "cuda-check:1"}}}})
        assert f.wait(lambda: (k.get("/apis/driverd.io/v1alpha1/driverrollouts/r").get("status") or {}).get("phase")
                      == "Completed", 120), (k.get("/apis/driverd.io/v1alpha1/driverrollouts/r").get("status"),
                                             [(n["metadata"]["name"], n["metadata"].get("annotations"))
                                              for n in k.list("/api/v1/nodes")["items"]])
    finally:
        stop.set()
        t.join(5)
    # a DriverPool over one node, on another driver: the coordinator writes its status and creates its
    # first revision (a DriverRollout the pool owns), which takes the node back to OLD
    k.create("/apis/driverd.io/v1alpha1/driverpools", {
        "apiVersion": "driverd.io/v1alpha1", "kind": "DriverPool", "metadata": {"name": "p"},
        "spec": {"driver": OLD, "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "gpu-0001"}}}})
    assert f.wait(lambda: ((k.get("/apis/driverd.io/v1alpha1/driverpools/p").get("status") or {}).get("nodes") or {})
                  .get("current") == 1, 120), k.get("/apis/driverd.io/v1alpha1/driverpools/p").get("status")
    f.stop()
    # the coordinator's own account made the coordinator's calls, each one deploy/ lists for it, every one used
    cseen = {((ev.get("objectRef") or {}).get("apiGroup", ""), (ev.get("objectRef") or {}).get("resource", "") +
              ("/" + ev["objectRef"]["subresource"] if (ev.get("objectRef") or {}).get("subresource") else ""),
              ev["verb"]) for ev in control_plane.audited(COORDINATOR_USER)[cbefore:]}
    cneed = {(g, r, v) for g, r, v, _ in COORDINATOR_NEEDS}
    assert cseen - cneed == set() and cneed - cseen == set(), (sorted(cseen - cneed), sorted(cneed - cseen))
    events = control_plane.audited(SA_USER)[before:]
    assert events
    seen, refused = set(), []
    for ev in events:
        ref = ev.get("objectRef") or {}
        res = ref.get("resource", "") + ("/" + ref["subresource"] if ref.get("subresource") else "")
        seen.add((ref.get("apiGroup", ""), res, ev["verb"]))
        code = ev["responseStatus"]["code"]
        # 429: a PDB refused an eviction; 409: a conflict retried; 404: a Lease not there yet
        if code == 403 or (code >= 400 and code not in (404, 409, 429)):
            refused.append((ev["verb"], ev["requestURI"], code, ev["responseStatus"].get("message", "")[:200]))
    assert not refused, refused
    need = {(g, r, v) for g, r, v, _ in NODE_NEEDS}
    assert seen - need == set(), f"calls deploy/'s RBAC does not list: {sorted(seen - need)}"
    assert need - seen == set(), f"permissions no call of the rollout used: {sorted(need - seen)}"
    assert any(ev["verb"] == "create" and (ev.get("objectRef") or {}).get("subresource") == "eviction"
               and ev["responseStatus"]["code"] == 429 for ev in events), "the PDB's refusal was not seen"


# -- node-scoped writes (deploy/base/admission-node-scope.yaml) -------------------------------------

def test_a_node_token_writes_its_own_node_only(control_plane, fleet):
    from driverd.cluster.kube import Kube, Target
    from driverd.cluster.lease import Lease
    cp = control_plane
    a = cp.token("driverd", "driverd", node="gpu-0000")
    n = "/api/v1/nodes/"
    admit = {"metadata": {"annotations": {"driverd.io/state": "admitted", "driverd.io/reason": "Admitted",
                                          "driverd.io/rollout": "r/u/1", "driverd.io/target": f"{NEW}/auto",
                                          "driverd.io/retry": None, "driverd.io/admitted-by": "gpu-0000"}}}
    # another node is admitted only by the coordinator (its own identity, holding the Lease), once its
    # daemon has answered a preflight: a node never admits one, not even holding the Lease's name
    cp.api("PATCH", n + "gpu-0001", {"metadata": {"annotations": {"driverd.io/preflight": "{}"}}},
           content_type="application/merge-patch+json")
    leases = "/apis/coordination.k8s.io/v1/namespaces/driverd/leases"
    cp.api("POST", leases, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {
        "name": "driverd-rollout", "namespace": "driverd"}, "spec": {"holderIdentity": "gpu-0000"}})
    time.sleep(0.5)
    code, msg = _code(cp, "PATCH", n + "gpu-0001", admit, a)
    assert code == 403 and "may write only its own Node" in msg, msg
    cp.api("DELETE", leases + "/driverd-rollout")
    c = fleet.coordinator_kubeconfig()
    ctok = coordinator_token(fleet)
    lease = Lease(Kube(Target(kubeconfig=c), retry_for_s=0), "driverd", Fleet.COORDINATOR, duration_s=3)
    assert fleet.wait(lease.try_acquire, 15, step=0.5)
    time.sleep(0.5)
    cadmit = json.loads(json.dumps(admit))
    cadmit["metadata"]["annotations"]["driverd.io/admitted-by"] = Fleet.COORDINATOR
    ok = [
        (n + "gpu-0000", {"metadata": {"labels": {"driverd.io/driver-version": NEW}}}, a),
        (n + "gpu-0000", {"metadata": {"annotations": {"driverd.io/state": "cordoned"}}}, a),
        (n + "gpu-0000", {"spec": {"unschedulable": True}}, a),
        (n + "gpu-0000", {"spec": {"unschedulable": None}}, a),
        # the Lease holder admits another node: the admission annotations only
        (n + "gpu-0001", cadmit, ctok),
    ]
    for path, patch, tok in ok:
        assert _code(cp, "PATCH", path, patch, tok) == (200, ""), (path, patch, _code(cp, "PATCH", path, patch, tok))
    code, msg = _code(cp, "PATCH", n + "gpu-0001", admit, a)
    assert code == 403 and "may write only its own Node" in msg, msg
    refused = [
        (n + "gpu-0001", {"metadata": {"labels": {"driverd.io/driver-version": NEW}}}, "beyond admitting"),
        (n + "gpu-0001", {"spec": {"unschedulable": True}}, "beyond admitting"),
        (n + "gpu-0001", {"metadata": {"annotations": {"driverd.io/state": "done"}}}, "beyond admitting"),
        (n + "gpu-0001", {"metadata": {"annotations": {"driverd.io/state": "admitted", "other.io/x": "1"}}},
         "beyond admitting"),
        (n + "gpu-0000", {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}}, "only driverd.io/*"),
        (n + "gpu-0000", {"metadata": {"annotations": {"other.io/x": "1"}}}, "only driverd.io/*"),
        (n + "gpu-0000", {"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}, "only driverd.io/*"),
    ]
    for path, patch, why in refused:       # another node's by the coordinator, its own by the node
        code, msg = _code(cp, "PATCH", path, patch, ctok if "gpu-0001" in path else a)
        assert code == 403 and "driverd-node-scope" in msg and why in msg, (path, patch, code, msg)
    # its own condition through nodes/status, and nothing else there
    st = "application/strategic-merge-patch+json"
    mine = {"status": {"conditions": [{"type": "GPUDriverReady", "status": "True", "reason": "DriverValidated"}]}}
    assert _code(cp, "PATCH", n + "gpu-0000/status", mine, a, st) == (200, "")
    code, msg = _code(cp, "PATCH", n + "gpu-0001/status", mine, a, st)
    assert code == 403 and "may write only its own Node" in msg, msg
    kubelets = {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "Hijacked"}]}}
    code, msg = _code(cp, "PATCH", n + "gpu-0000/status", kubelets, a, st)
    assert code == 403 and "GPUDriverReady" in msg, msg
    # pods: deleted on its own node only
    gone = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
    code, msg = _code(cp, "DELETE", f"/api/v1/namespaces/{GPU_NS}/pods/train-gpu-0001-0", gone, a, "application/json")
    assert code == 403 and "own node" in msg and "gpu-0001" in msg, msg
    assert _code(cp, "DELETE", f"/api/v1/namespaces/{GPU_NS}/pods/train-gpu-0000-0", gone, a,
                 "application/json") == (200, "")


def test_a_daemonset_pods_token_names_its_node_and_a_legacy_token_writes_nothing(control_plane, fleet):
    """Container mode: the DaemonSet pod's token is bound to the pod, and the apiserver derives the
    node from it; the same policy holds. A token that names no node (a legacy Secret token, as the
    old host mode used) may not write Nodes at all, though RBAC would allow it."""
    cp = control_plane
    pod = cp.ensure("/api/v1/namespaces/driverd/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "driverd-test-pod", "namespace": "driverd"},
        "spec": {"nodeName": "gpu-0000", "serviceAccountName": "driverd",
                 "containers": [{"name": "driverd", "image": "driverd:0.1.0"}]}})
    try:
        tok = cp.token("driverd", "driverd", pod=pod)
        ok = {"metadata": {"annotations": {"driverd.io/state": "cordoned"}}}
        assert _code(cp, "PATCH", "/api/v1/nodes/gpu-0000", ok, tok) == (200, "")
        code, msg = _code(cp, "PATCH", "/api/v1/nodes/gpu-0001", {"spec": {"unschedulable": True}}, tok)
        assert code == 403 and "driverd on node gpu-0000 may write only its own Node" in msg, msg
    finally:
        cp.api("DELETE", "/api/v1/namespaces/driverd/pods/driverd-test-pod",
               {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
    cp.ensure("/api/v1/namespaces/driverd/secrets", {
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
        "metadata": {"name": "legacy", "namespace": "driverd",
                     "annotations": {"kubernetes.io/service-account.name": "driverd"}}})
    import base64
    import time
    end = time.monotonic() + 30
    legacy = ""
    while not legacy and time.monotonic() < end:         # the token controller fills it in
        legacy = (cp.api("GET", "/api/v1/namespaces/driverd/secrets/legacy").get("data") or {}).get("token", "")
        time.sleep(0.2)
    assert legacy, "the token controller did not fill the legacy token"
    legacy = base64.b64decode(legacy).decode()
    code, msg = _code(cp, "PATCH", "/api/v1/nodes/gpu-0000", {"metadata": {"labels": {"driverd.io/x": "1"}}}, legacy)
    assert code == 403 and "names no node" in msg, msg
    assert _code(cp, "GET", "/api/v1/nodes", None, legacy)[0] == 200       # reading (a list) stays allowed
    cp.api("DELETE", "/api/v1/namespaces/driverd/secrets/legacy")
