"""The pods/eviction subresource under PodDisruptionBudgets, and the PDB status the server keeps."""
from __future__ import annotations

import json

import pytest
from kubernetes import client



@pytest.fixture
def api(client_config):
    return client_config


def running_pod(store, name, labels, ready=True, owner=None, ns="default"):
    md = {"name": name, "namespace": ns, "labels": labels}
    if owner:
        md["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner["kind"], "name": owner["metadata"]["name"],
                                  "uid": owner["metadata"]["uid"], "controller": True}]
    return store.create("pods", {"metadata": md, "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
                                 "status": {"phase": "Running", "conditions": [
                                     {"type": "Ready", "status": "True" if ready else "False"}]}}, keep_status=True)


def evict(api, name, ns="default"):
    """POST pods/NAME/eviction (the client has it on CoreV1Api; the budgets are PolicyV1Api's)."""
    return client.CoreV1Api(api).create_namespaced_pod_eviction(name, ns, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=name, namespace=ns)))


def test_eviction_without_budget_deletes_the_pod(api, srv):
    running_pod(srv.store, "p", {"app": "x"})
    v1 = client.CoreV1Api(api)
    raw = v1.create_namespaced_pod_eviction_with_http_info(
        "p", "default", client.V1Eviction(metadata=client.V1ObjectMeta(name="p")))
    assert raw[1] == 201          # (data, status, headers)
    with pytest.raises(client.ApiException) as e:
        v1.read_namespaced_pod("p", "default")
    assert e.value.status == 404


def test_budget_blocks_with_kubernetes_message_then_allows(api, srv):
    s = srv.store
    for i in range(3):
        running_pod(s, f"web-{i}", {"app": "web"})
    running_pod(s, "other", {"app": "other"})
    s.create("poddisruptionbudgets", {"metadata": {"name": "web-pdb", "namespace": "default"},
                                      "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}}})
    policy = client.PolicyV1Api(api)
    pdb = policy.read_namespaced_pod_disruption_budget("web-pdb", "default")
    assert (pdb.status.current_healthy, pdb.status.desired_healthy, pdb.status.disruptions_allowed,
            pdb.status.expected_pods) == (3, 2, 1, 3)
    evict(api, "web-0")
    pdb = policy.read_namespaced_pod_disruption_budget("web-pdb", "default")
    assert (pdb.status.current_healthy, pdb.status.disruptions_allowed) == (2, 0)
    with pytest.raises(client.ApiException) as e:
        evict(api, "web-1")
    assert e.value.status == 429
    assert json.loads(e.value.body) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "Cannot evict pod as it would violate the pod's disruption budget.", "reason": "TooManyRequests",
        "details": {"causes": [{"reason": "DisruptionBudget",
                                "message": "The disruption budget web-pdb needs 2 healthy pods and has 2 currently"}]},
        "code": 429}
    evict(api, "other")                      # not covered by the budget
    # an unready pod may go while the budget is met (IfHealthyBudget); a Pending one always may
    running_pod(s, "web-9", {"app": "web"}, ready=False)
    evict(api, "web-9")
    s.create("pods", {"metadata": {"name": "web-p", "namespace": "default", "labels": {"app": "web"}},
                      "spec": {"containers": [{"name": "c", "image": "i"}]}})
    evict(api, "web-p")
    # lowering the budget lets the next one go
    policy.patch_namespaced_pod_disruption_budget("web-pdb", "default", {"spec": {"minAvailable": 1}})
    evict(api, "web-1")
    assert [p["metadata"]["name"] for p in s.list("pods", "default")] == ["web-2"]


def test_max_unavailable_percent_uses_controller_scale(api, srv):
    s = srv.store
    rs = s.create("replicasets", {"metadata": {"name": "rs", "namespace": "default"}, "spec": {
        "replicas": 4, "selector": {"matchLabels": {"app": "w"}},
        "template": {"metadata": {"labels": {"app": "w"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}})
    for i in range(3):                           # one replica is missing: 3 of 4 healthy
        running_pod(s, f"w-{i}", {"app": "w"}, owner=rs)
    s.create("poddisruptionbudgets", {"metadata": {"name": "w", "namespace": "default"},
                                      "spec": {"maxUnavailable": "25%", "selector": {"matchLabels": {"app": "w"}}}})
    st = s.get("poddisruptionbudgets", "w", "default")["status"]
    assert (st["expectedPods"], st["desiredHealthy"], st["currentHealthy"], st["disruptionsAllowed"]) == (4, 3, 3, 0)
    with pytest.raises(client.ApiException) as e:
        evict(api, "w-0")
    assert e.value.status == 429


def test_two_budgets_and_delete_with_grace_period(api, srv):
    s = srv.store
    running_pod(s, "p", {"app": "x"})
    for n in ("a", "b"):
        s.create("poddisruptionbudgets", {"metadata": {"name": n, "namespace": "default"},
                                          "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "x"}}}})
    with pytest.raises(client.ApiException) as e:
        evict(api, "p")
    assert e.value.status == 500 and "more than one PodDisruptionBudget" in json.loads(e.value.body)["message"]
    v1 = client.CoreV1Api(api)
    w = s.watch("pods", "default", s.resource_version)
    got = v1.delete_namespaced_pod("p", "default", grace_period_seconds=30)
    assert got.metadata.deletion_timestamp is not None and got.metadata.deletion_grace_period_seconds == 30
    first, second = w.next(1), w.next(1)
    w.stop()
    assert first[0] == "MODIFIED" and first[1]["metadata"]["deletionTimestamp"]
    assert second[0] == "DELETED"
    assert s.list("pods") == []
