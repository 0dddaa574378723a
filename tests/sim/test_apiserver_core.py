"""tests.apiserver through the official Python client: CRUD, conflicts, selectors, patches, watches,
restart, discovery, paging, finalizers, namespaces, events, request accounting."""
from __future__ import annotations

import json
import threading
import time

import pytest
from kubernetes import client, config, watch

from tests.apiserver import ApiError, ApiServer
from tests.apiserver.selectors import FieldSelector, LabelSelector


@pytest.fixture
def api(client_config):
    return client_config


def _body(e: client.ApiException) -> dict:
    return json.loads(e.body)


def _pod(name, labels=None, node="n1", phase=None):
    p = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
         "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox:1.36"}]}}
    if phase:
        p["status"] = {"phase": phase}
    return p


def test_discovery_and_version(api):
    assert client.VersionApi(api).get_code().git_version.startswith("v1.32")
    groups = {g.name for g in client.ApisApi(api).get_api_versions().groups}
    assert {"apps", "batch", "policy", "coordination.k8s.io", "events.k8s.io", "node.k8s.io",
            "rbac.authorization.k8s.io", "apiextensions.k8s.io"} <= groups
    core = client.CoreV1Api(api).get_api_resources()
    names = {r.name: r for r in core.resources}
    assert names["pods/eviction"].group == "policy" and names["pods/eviction"].kind == "Eviction"
    assert names["nodes"].namespaced is False and "no" in names["nodes"].short_names


def test_crud_metadata_and_errors(api):
    v1 = client.CoreV1Api(api)
    node = v1.create_node({"metadata": {"name": "n1"}})
    assert node.metadata.uid and node.metadata.creation_timestamp and node.metadata.generation == 1
    assert node.metadata.resource_version.isdigit()
    with pytest.raises(client.ApiException) as e:
        v1.create_node({"metadata": {"name": "n1"}})
    assert e.value.status == 409
    assert _body(e.value) == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": 'nodes "n1" already exists', "reason": "AlreadyExists",
                              "details": {"name": "n1", "kind": "nodes"}, "code": 409}
    with pytest.raises(client.ApiException) as e:
        client.AppsV1Api(api).read_namespaced_daemon_set("nope", "default")
    assert e.value.status == 404
    assert _body(e.value)["message"] == 'daemonsets.apps "nope" not found'
    assert _body(e.value)["details"] == {"name": "nope", "group": "apps", "kind": "daemonsets"}
    # namespaced object in a namespace that does not exist
    with pytest.raises(client.ApiException) as e:
        v1.create_namespaced_config_map("ghost", {"metadata": {"name": "c"}})
    assert e.value.status == 404 and _body(e.value)["message"] == 'namespaces "ghost" not found'
    # pod create resets status (the kubelet writes it); spec changes bump generation, metadata changes don't
    p = v1.create_namespaced_pod("default", _pod("p", phase="Running"))
    assert p.status.phase == "Pending"
    p2 = v1.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"x": "1"}}})
    assert p2.metadata.generation == 1 and int(p2.metadata.resource_version) > int(p.metadata.resource_version)
    p3 = v1.patch_namespaced_pod("p", "default", {"spec": {"activeDeadlineSeconds": 5}})
    assert p3.metadata.generation == 2
    # a status write ignores everything but .status
    body = v1.read_namespaced_pod("p", "default").to_dict()
    st = v1.patch_namespaced_pod_status("p", "default", {"metadata": {"labels": {"y": "2"}},
                                                          "status": {"phase": "Running"}})
    assert st.status.phase == "Running" and "y" not in st.metadata.labels
    # a main-resource write ignores .status
    v1.patch_namespaced_pod("p", "default", {"status": {"phase": "Failed"}})
    assert v1.read_namespaced_pod("p", "default").status.phase == "Running"
    assert body["metadata"]["name"] == "p"
    # a no-op update does not bump resourceVersion
    cur = v1.read_namespaced_pod("p", "default")
    same = v1.replace_namespaced_pod("p", "default", cur)
    assert same.metadata.resource_version == cur.metadata.resource_version


def test_lease_leader_election_conflicts(api):
    co = client.CoordinationV1Api(api)
    lease = co.create_namespaced_lease("kube-system", client.V1Lease(
        metadata=client.V1ObjectMeta(name="driverd-admission"),
        spec=client.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15)))
    a = co.read_namespaced_lease("driverd-admission", "kube-system")
    b = co.read_namespaced_lease("driverd-admission", "kube-system")
    a.spec.holder_identity = "a"
    a.spec.lease_transitions = 1
    won = co.replace_namespaced_lease("driverd-admission", "kube-system", a)
    assert int(won.metadata.resource_version) > int(lease.metadata.resource_version)
    b.spec.holder_identity = "b"
    with pytest.raises(client.ApiException) as e:
        co.replace_namespaced_lease("driverd-admission", "kube-system", b)
    assert e.value.status == 409
    assert _body(e.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'Operation cannot be fulfilled on leases.coordination.k8s.io "driverd-admission": the object has '
                   "been modified; please apply your changes to the latest version and try again",
        "reason": "Conflict", "details": {"name": "driverd-admission", "group": "coordination.k8s.io",
                                          "kind": "leases"}, "code": 409}
    assert co.read_namespaced_lease("driverd-admission", "kube-system").spec.holder_identity == "a"


def test_label_and_field_selectors(api, srv):
    v1 = client.CoreV1Api(api)
    for name, labels, node in [("a", {"app": "x", "tier": "gpu"}, "n1"), ("b", {"app": "y"}, "n1"),
                               ("c", {"app": "z", "tier": "cpu"}, "n2"), ("d", {}, "")]:
        v1.create_namespaced_pod("default", _pod(name, labels, node))

    def names(**kw):
        return sorted(p.metadata.name for p in v1.list_namespaced_pod("default", **kw).items)
    assert names(label_selector="app=x") == ["a"]
    assert names(label_selector="app==y") == ["b"]
    assert names(label_selector="app!=x") == ["b", "c", "d"]
    assert names(label_selector="app in (x, z)") == ["a", "c"]
    assert names(label_selector="app notin (x,z)") == ["b", "d"]
    assert names(label_selector="tier") == ["a", "c"]
    assert names(label_selector="!tier") == ["b", "d"]
    assert names(label_selector="app,tier notin (gpu)") == ["b", "c"]
    assert names(field_selector="spec.nodeName=n1") == ["a", "b"]
    assert names(field_selector="spec.nodeName=") == ["d"]
    assert names(field_selector="spec.nodeName!=n1,metadata.name!=d") == ["c"]
    assert names(field_selector="status.phase=Pending", label_selector="tier=cpu") == ["c"]
    with pytest.raises(client.ApiException) as e:
        v1.list_namespaced_pod("default", field_selector="spec.bogus=1")
    assert e.value.status == 400 and "field label not supported: spec.bogus" in _body(e.value)["message"]
    v1.create_node({"metadata": {"name": "n1"}, "spec": {"unschedulable": True}})
    v1.create_node({"metadata": {"name": "n2"}})
    assert [n.metadata.name for n in v1.list_node(field_selector="spec.unschedulable=false").items] == ["n2"]
    # the parsers on their own
    assert LabelSelector.from_dict({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}).matches({})
    assert not LabelSelector.parse("a in (1)").matches({"a": "2"})
    assert FieldSelector.parse("involvedObject.kind=Node", "", "events").matches({"involvedObject": {"kind": "Node"}})


def test_patch_types(api, srv):
    v1 = client.CoreV1Api(api)
    v1.create_node({"metadata": {"name": "n1", "labels": {"a": "1", "b": "2"}, "finalizers": ["x/one"]},
                    "spec": {"taints": [{"key": "k1", "effect": "NoSchedule"}, {"key": "k2", "effect": "NoExecute"}]},
                    "status": {"conditions": [{"type": "Ready", "status": "True"},
                                              {"type": "MemoryPressure", "status": "False"}]}})
    # merge patch (RFC 7386): null deletes, lists replace
    n = v1.api_client.call_api  # noqa: F841
    srv.store.patch("nodes", "n1", {"metadata": {"labels": {"a": None, "c": "3"}}}, "merge")
    assert srv.store.get("nodes", "n1")["metadata"]["labels"] == {"b": "2", "c": "3"}
    # strategic: taints merge by key, $patch delete, conditions by type (status subresource)
    v1.patch_node("n1", {"spec": {"taints": [{"key": "k3", "effect": "NoSchedule"},
                                             {"key": "k1", "$patch": "delete"}]}})
    assert [t.key for t in v1.read_node("n1").spec.taints] == ["k2", "k3"]
    v1.patch_node_status("n1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    conds = {c.type: c.status for c in v1.read_node("n1").status.conditions}
    assert conds == {"Ready": "False", "MemoryPressure": "False"}
    srv.store.patch("nodes", "n1", {"metadata": {"finalizers": ["x/two"],
                                                 "$deleteFromPrimitiveList/finalizers": ["x/one"]}}, "strategic")
    assert srv.store.get("nodes", "n1")["metadata"]["finalizers"] == ["x/two"]
    srv.store.patch("nodes", "n1", {"metadata": {"finalizers": None}}, "strategic")
    # containers by name, env by name, $setElementOrder, and a list without merge key (args) replaced
    v1.create_namespaced_pod("default", {"metadata": {"name": "p"}, "spec": {"containers": [
        {"name": "a", "image": "i:1", "args": ["x", "y"], "env": [{"name": "E1", "value": "1"}]},
        {"name": "b", "image": "i:1"}]}})
    v1.patch_namespaced_pod("p", "default", {"spec": {
        "$setElementOrder/containers": [{"name": "b"}, {"name": "a"}],
        "containers": [{"name": "a", "image": "i:2", "args": ["z"], "env": [{"name": "E2", "value": "2"}]}]}})
    p = v1.read_namespaced_pod("p", "default")
    assert [c.name for c in p.spec.containers] == ["b", "a"]
    a = p.spec.containers[1]
    assert a.image == "i:2" and a.args == ["z"] and [e.name for e in a.env] == ["E1", "E2"]
    v1.patch_namespaced_pod("p", "default", {"spec": {"containers": [{"name": "b", "$patch": "delete"}]}})
    assert [c.name for c in v1.read_namespaced_pod("p", "default").spec.containers] == ["a"]
    # $patch: replace on a map
    v1.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"$patch": "replace", "only": "me"}}})
    assert v1.read_namespaced_pod("p", "default").metadata.labels == {"only": "me"}
    # JSON patch (RFC 6902) through the client (it picks json-patch for a list body)
    v1.patch_namespaced_pod("p", "default", [{"op": "add", "path": "/metadata/labels/j", "value": "1"},
                                             {"op": "remove", "path": "/metadata/labels/only"},
                                             {"op": "copy", "from": "/metadata/labels/j", "path": "/metadata/labels/k"},
                                             {"op": "test", "path": "/metadata/labels/k", "value": "1"}])
    assert v1.read_namespaced_pod("p", "default").metadata.labels == {"j": "1", "k": "1"}
    with pytest.raises(client.ApiException) as e:
        v1.patch_namespaced_pod("p", "default", [{"op": "test", "path": "/metadata/labels/k", "value": "2"}])
    assert e.value.status == 422
    # a patch carrying a stale resourceVersion conflicts
    with pytest.raises(client.ApiException) as e:
        v1.patch_namespaced_pod("p", "default", {"metadata": {"resourceVersion": "1", "labels": {"z": "1"}}})
    assert e.value.status == 409 and _body(e.value)["reason"] == "Conflict"


def _stream(api_fn, events, stop_after=None, **kw):
    w = watch.Watch()
    for ev in w.stream(api_fn, **kw):
        obj = ev["object"]
        name = obj["metadata"].get("name") if isinstance(obj, dict) else obj.metadata.name
        rv = obj["metadata"]["resourceVersion"] if isinstance(obj, dict) else obj.metadata.resource_version
        events.append((ev["type"], name, rv))
        if stop_after and stop_after(events):
            w.stop()


def test_watch_resume_bookmarks_and_selector_transitions(api, srv):
    v1 = client.CoreV1Api(api)
    v1.create_namespaced_pod("default", _pod("a", {"app": "x"}))
    start = srv.store.resource_version
    v1.patch_namespaced_pod("a", "default", {"metadata": {"labels": {"v": "2"}}})     # before the watch
    v1.create_namespaced_pod("default", _pod("b", {"app": "x"}))
    events = []
    t = threading.Thread(target=_stream, args=(v1.list_namespaced_pod, events), kwargs={
        "namespace": "default", "resource_version": start, "allow_watch_bookmarks": True, "timeout_seconds": 2,
        "label_selector": "app=x"})
    t.start()
    time.sleep(0.5)
    v1.patch_namespaced_pod("b", "default", {"metadata": {"labels": {"app": "gone"}}})   # leaves the selector
    v1.patch_namespaced_pod("b", "default", {"metadata": {"labels": {"app": "x"}}})      # comes back
    v1.delete_namespaced_pod("a", "default")
    t.join(5)
    typed = [(t_, n) for t_, n, _ in events if t_ != "BOOKMARK"]
    assert typed == [("MODIFIED", "a"), ("ADDED", "b"), ("DELETED", "b"), ("ADDED", "b"), ("DELETED", "a")]
    rvs = [int(rv) for t_, _, rv in events if t_ != "BOOKMARK"]
    assert rvs == sorted(rvs) and rvs[0] > int(start)
    bookmarks = [int(rv) for t_, _, rv in events if t_ == "BOOKMARK"]
    assert bookmarks and bookmarks[-1] >= rvs[-1]


def test_watch_gone_after_history_and_after_restart(tmp_path):
    srv = ApiServer(history=5).start()
    try:
        srv.write_kubeconfig(tmp_path / "kc")
        api = config.new_client_from_config(str(tmp_path / "kc"))
        v1 = client.CoreV1Api(api)
        v1.create_namespaced_config_map("default", {"metadata": {"name": "c"}})
        old = srv.store.resource_version
        for i in range(10):
            v1.patch_namespaced_config_map("c", "default", {"data": {"i": str(i)}})
        with pytest.raises(client.ApiException) as e:
            for _ in watch.Watch().stream(v1.list_namespaced_config_map, "default", resource_version=old,
                                          timeout_seconds=1):
                pass
        assert e.value.status == 410 and "too old resource version" in e.value.reason
        # the raw event, as Kubernetes sends it: HTTP 200 and an ERROR event with a 410 Status
        resp = v1.list_namespaced_config_map("default", watch=True, resource_version=old, timeout_seconds=1,
                                             _preload_content=False)
        ev = json.loads(resp.readline())
        assert ev["type"] == "ERROR" and ev["object"]["code"] == 410 and ev["object"]["reason"] == "Expired"
        # restart keeps objects and the counter; watches from the current version still work
        rv = srv.store.resource_version
        count = srv.request_count
        srv.restart()
        assert srv.store.resource_version == rv
        assert v1.read_namespaced_config_map("c", "default").data == {"i": "9"}
        assert srv.request_count == count + 1
        events = []
        t = threading.Thread(target=_stream, args=(v1.list_namespaced_config_map, events), kwargs={
            "namespace": "default", "resource_version": rv, "timeout_seconds": 2})
        t.start()
        time.sleep(0.3)
        v1.patch_namespaced_config_map("c", "default", {"data": {"i": "10"}})
        t.join(5)
        assert [(e[0], e[2]) for e in events] == [("MODIFIED", str(int(rv) + 1))]
        api.close()
    finally:
        srv.stop()


def test_stop_cuts_open_watches(srv, api):
    v1 = client.CoreV1Api(api)
    done = threading.Event()
    errors: list = []

    def run():
        try:
            for _ in watch.Watch().stream(v1.list_node):
                pass
        except Exception as e:  # noqa: BLE001 - a cut connection may surface as an error
            errors.append(e)
        done.set()
    threading.Thread(target=run, daemon=True).start()
    deadline = time.time() + 5
    while srv.open_watches == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert srv.open_watches == 1
    srv.stop()
    assert done.wait(5)


def test_paging_finalizers_namespaces_and_counts(api, srv):
    v1 = client.CoreV1Api(api)
    for i in range(7):
        v1.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}})
    page = v1.list_namespaced_config_map("default", limit=3)
    seen = [c.metadata.name for c in page.items]
    while page.metadata._continue:
        page = v1.list_namespaced_config_map("default", limit=3, _continue=page.metadata._continue)
        seen += [c.metadata.name for c in page.items]
    assert seen == [f"c{i}" for i in range(7)]
    # finalizers hold deletion until removed
    v1.create_namespace({"metadata": {"name": "team"}})
    v1.create_namespaced_config_map("team", {"metadata": {"name": "held", "finalizers": ["driverd.io/x"]}})
    v1.delete_namespaced_config_map("held", "team")
    held = v1.read_namespaced_config_map("held", "team")
    assert held.metadata.deletion_timestamp is not None
    v1.patch_namespaced_config_map("held", "team", {"metadata": {"finalizers": None}})
    with pytest.raises(client.ApiException):
        v1.read_namespaced_config_map("held", "team")
    # namespace deletion takes its content with it; the namespace carries the metadata.name label
    assert v1.read_namespace("team").metadata.labels == {"kubernetes.io/metadata.name": "team"}
    v1.create_namespaced_config_map("team", {"metadata": {"name": "x"}})
    v1.delete_namespace("team")
    assert srv.store.list("configmaps", "team") == []
    by_verb = srv.request_counts_by(lambda r: r.verb)
    assert by_verb["create"] >= 9 and by_verb["list"] >= 3 and srv.request_count >= sum(by_verb.values())
    with pytest.raises(ApiError):
        srv.store.get("namespaces", "team")


def test_events_core_and_events_v1(api):
    v1, ev1 = client.CoreV1Api(api), client.EventsV1Api(api)
    v1.create_namespaced_event("default", {"metadata": {"name": "e1"}, "reason": "Cordoned", "type": "Normal",
                                           "message": "cordoned by driverd", "involvedObject": {"kind": "Node",
                                                                                               "name": "n1"}})
    ev1.create_namespaced_event("default", {
        "metadata": {"name": "e2"}, "regarding": {"kind": "Node", "name": "n2"}, "reason": "Drained",
        "note": "drained", "type": "Warning", "action": "Drain", "reportingController": "driverd.io/rollout",
        "reportingInstance": "driverd-0", "eventTime": "2025-01-01T00:00:00.000000Z"})
    core = {e.metadata.name: e for e in v1.list_namespaced_event("default").items}
    assert core["e2"].message == "drained" and core["e2"].involved_object.name == "n2"
    assert core["e2"].reporting_component == "driverd.io/rollout"
    new = {e.metadata.name: e for e in ev1.list_namespaced_event("default").items}
    assert new["e1"].note == "cordoned by driverd" and new["e1"].regarding.kind == "Node"
    assert [e.metadata.name for e in v1.list_namespaced_event(
        "default", field_selector="involvedObject.kind=Node,involvedObject.name=n1").items] == ["e1"]
    assert [e.metadata.name for e in ev1.list_namespaced_event(
        "default", field_selector="regarding.name=n2").items] == ["e2"]
    got = []
    for e in watch.Watch().stream(ev1.list_namespaced_event, "default", timeout_seconds=1):
        got.append((e["type"], e["object"].metadata.name))
    assert got == [("ADDED", "e1"), ("ADDED", "e2")]


def test_openapi_validate_indexed_job():
    from tests.apiserver import openapi
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "upgrade"},
           "spec": {"completionMode": "Indexed", "completions": 4, "parallelism": 2, "backoffLimitPerIndex": 1,
                    "template": {"spec": {"restartPolicy": "Never",
                                          "containers": [{"name": "c", "image": "driverd:1"}]}}}}
    assert openapi.validate(job) == []
    job["spec"]["completions"] = "four"
    job["spec"]["template"]["spec"]["containers"][0]["imagee"] = "typo"
    errs = openapi.validate(job)
    assert any(e.startswith("spec.completions:") for e in errs)
    assert 'spec.template.spec.containers[0].imagee: unknown field "imagee"' in errs
    assert openapi.validate(job, strict=False) != [] and len(openapi.validate(job, strict=False)) == 1
    assert openapi.validate({"apiVersion": "x/v1", "kind": "Nope"})[0].startswith("<root>: no schema")
