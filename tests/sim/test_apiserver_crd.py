"""CustomResourceDefinitions: serving, status subresource, generation, schema enforcement (422), defaults,
pruning, printer columns as server-side Tables, deletion."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from kubernetes import client


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "driverrollouts.driverd.io"},
    "spec": {"group": "driverd.io", "scope": "Cluster",
             "names": {"plural": "driverrollouts", "singular": "driverrollout", "kind": "DriverRollout",
                       "shortNames": ["dr"], "categories": ["driverd"]},
             "versions": [{
                 "name": "v1alpha1", "served": True, "storage": True, "subresources": {"status": {}},
                 "additionalPrinterColumns": [
                     {"name": "Driver", "type": "string", "jsonPath": ".spec.driver"},
                     {"name": "Parallel", "type": "integer", "jsonPath": ".spec.maxParallel"},
                     {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                     {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}],
                 "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                     "spec": {"type": "object", "required": ["driver"], "properties": {
                         "driver": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+(\.[0-9]+)?$"},
                         "maxParallel": {"type": "integer", "minimum": 1, "maximum": 100, "default": 1},
                         "flavor": {"type": "string", "enum": ["open", "proprietary"], "default": "open"},
                         "maxUnavailable": {"x-kubernetes-int-or-string": True},
                         "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}},
                     "status": {"type": "object", "properties": {
                         "phase": {"type": "string"},
                         "conditions": {"type": "array", "items": {"type": "object", "properties": {
                             "type": {"type": "string"}, "status": {"type": "string"}}}}}}}}}}]}}
G, V, P = "driverd.io", "v1alpha1", "driverrollouts"


@pytest.fixture
def api(client_config):
    client.ApiextensionsV1Api(client_config).create_custom_resource_definition(CRD)
    return client_config


def test_served_with_discovery_and_crud(api, srv):
    rl = client.CustomObjectsApi(api).get_api_resources(G, V)
    r = next(r for r in rl.resources if r.name == P)
    assert (r.kind, r.namespaced, r.short_names, r.categories) == ("DriverRollout", False, ["dr"], ["driverd"])
    assert any(r.name == f"{P}/status" for r in rl.resources)
    crd = client.ApiextensionsV1Api(api).read_custom_resource_definition(f"{P}.{G}")
    assert {c.type: c.status for c in crd.status.conditions}["Established"] == "True"
    co = client.CustomObjectsApi(api)
    obj = co.create_cluster_custom_object(G, V, P, {"apiVersion": f"{G}/{V}", "kind": "DriverRollout",
                                                    "metadata": {"name": "r1"},
                                                    "spec": {"driver": "550.54.15", "bogus": 1,
                                                             "extra": {"kept": True}},
                                                    "status": {"phase": "ignored"}})
    assert obj["spec"] == {"driver": "550.54.15", "maxParallel": 1, "flavor": "open", "extra": {"kept": True}}
    assert "status" not in obj and obj["metadata"]["generation"] == 1
    assert [o["metadata"]["name"] for o in co.list_cluster_custom_object(G, V, P)["items"]] == ["r1"]
    # a PUT without resourceVersion is refused for custom resources, a stale one conflicts
    stale = dict(obj)
    with pytest.raises(client.ApiException) as e:
        co.replace_cluster_custom_object(G, V, P, "r1", {**obj, "metadata": {"name": "r1"}})
    assert e.value.status == 422
    co.patch_cluster_custom_object(G, V, P, "r1", {"spec": {"maxParallel": 3}})
    with pytest.raises(client.ApiException) as e:
        co.replace_cluster_custom_object(G, V, P, "r1", stale)
    assert e.value.status == 409
    # strategic merge patch is not for custom resources (415), as in Kubernetes
    req = urllib.request.Request(f"{srv.url}/apis/{G}/{V}/{P}/r1", method="PATCH", data=b'{"spec":{}}',
                                 headers={"Content-Type": "application/strategic-merge-patch+json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 415 and json.loads(e.value.read())["reason"] == "UnsupportedMediaType"
    co.delete_cluster_custom_object(G, V, P, "r1")
    assert co.list_cluster_custom_object(G, V, P)["items"] == []


def test_status_subresource_and_generation(api):
    co = client.CustomObjectsApi(api)
    co.create_cluster_custom_object(G, V, P, {"apiVersion": f"{G}/{V}", "kind": "DriverRollout",
                                              "metadata": {"name": "r"}, "spec": {"driver": "550.54"}})
    st = co.patch_cluster_custom_object_status(G, V, P, "r", {"spec": {"driver": "999.1"}, "status": {
        "phase": "Rolling", "conditions": [{"type": "Ready", "status": "True"}]}})
    assert st["spec"]["driver"] == "550.54" and st["status"]["phase"] == "Rolling"
    assert st["metadata"]["generation"] == 1
    main = co.patch_cluster_custom_object(G, V, P, "r", {"spec": {"driver": "560.1"}, "status": {"phase": "X"}})
    assert main["status"]["phase"] == "Rolling" and main["metadata"]["generation"] == 2
    lab = co.patch_cluster_custom_object(G, V, P, "r", {"metadata": {"labels": {"a": "b"}}})
    assert lab["metadata"]["generation"] == 2


def test_schema_rejections_are_422_with_kubernetes_wording(api):
    co = client.CustomObjectsApi(api)

    def create(spec, name="x"):
        with pytest.raises(client.ApiException) as e:
            co.create_cluster_custom_object(G, V, P, {"apiVersion": f"{G}/{V}", "kind": "DriverRollout",
                                                      "metadata": {"name": name}, "spec": spec})
        assert e.value.status == 422
        return json.loads(e.value.body)
    b = create({"driver": "550.54", "maxParallel": 0})
    assert b["message"] == ('DriverRollout.driverd.io "x" is invalid: spec.maxParallel: Invalid value: 0: '
                            'spec.maxParallel in body should be greater than or equal to 1')
    assert b["reason"] == "Invalid" and b["details"]["causes"][0]["field"] == "spec.maxParallel"
    assert create({})["message"] == 'DriverRollout.driverd.io "x" is invalid: spec.driver: Required value'
    assert create({"driver": "550", "flavor": "closed"})["message"].endswith(
        'spec.driver: Invalid value: "550": spec.driver in body should match \'^[0-9]+\\.[0-9]+(\\.[0-9]+)?$\', '
        'spec.flavor: Unsupported value: "closed": supported values: "open", "proprietary"]')
    assert 'spec.maxParallel: Invalid value: "string": spec.maxParallel in body must be of type integer: "string"' \
        in create({"driver": "1.2", "maxParallel": "two"})["message"]
    co.create_cluster_custom_object(G, V, P, {"apiVersion": f"{G}/{V}", "kind": "DriverRollout",
                                              "metadata": {"name": "ok"},
                                              "spec": {"driver": "1.2", "maxUnavailable": "10%"}})
    with pytest.raises(client.ApiException) as e:
        co.patch_cluster_custom_object(G, V, P, "ok", {"spec": {"maxParallel": 101}})
    assert e.value.status == 422 and "less than or equal to 100" in json.loads(e.value.body)["message"]


def test_printer_columns_table(api, srv):
    co = client.CustomObjectsApi(api)
    co.create_cluster_custom_object(G, V, P, {"apiVersion": f"{G}/{V}", "kind": "DriverRollout",
                                              "metadata": {"name": "r"}, "spec": {"driver": "550.54",
                                                                                  "maxParallel": 4}})
    co.patch_cluster_custom_object_status(G, V, P, "r", {"status": {"conditions": [{"type": "Ready",
                                                                                    "status": "True"}]}})
    req = urllib.request.Request(f"{srv.url}/apis/{G}/{V}/{P}", headers={
        "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"})
    table = json.loads(urllib.request.urlopen(req).read())
    assert table["kind"] == "Table" and table["apiVersion"] == "meta.k8s.io/v1"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Driver", "Parallel", "Ready", "Age"]
    cells = table["rows"][0]["cells"]
    assert cells[:4] == ["r", "550.54", 4, "True"] and cells[4].endswith("s")
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"


def test_deleting_the_crd_removes_its_resources(api, srv):
    co = client.CustomObjectsApi(api)
    co.create_cluster_custom_object(G, V, P, {"apiVersion": f"{G}/{V}", "kind": "DriverRollout",
                                              "metadata": {"name": "r"}, "spec": {"driver": "550.54"}})
    client.ApiextensionsV1Api(api).delete_custom_resource_definition(f"{P}.{G}")
    with pytest.raises(client.ApiException) as e:
        co.list_cluster_custom_object(G, V, P)
    assert e.value.status == 404
    assert "driverd.io" not in {g.name for g in client.ApisApi(api).get_api_versions().groups}
