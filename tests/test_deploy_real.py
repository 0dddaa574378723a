"""deploy/ on the real kube-apiserver (tests/controlplane.py: etcd, kube-apiserver with Node,RBAC and
the default admission plugins, kube-controller-manager, built from upstream's Go modules by
.ci/build-control-plane). The loopback test server accepted a CRD that a real apiserver refuses
("anyOf[0].type: Forbidden: must be empty to be structural"): what a cluster accepts is judged here,
by the apiserver itself."""
from __future__ import annotations

import json
import re

import pytest

from tests.test_deploy import DEPLOY, OVERLAYS, render
from tests.kubetools import kubectl

CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/driverrollouts.driverd.io"


@pytest.mark.real
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubectl_apply_k_of_every_overlay_on_the_real_apiserver(control_plane, tmp_path, overlay):
    """`kubectl apply -k` as a cluster admin runs it: a server-side dry run with strict field
    validation (every object against the apiserver's own schema), then for real, then again: nothing
    left to change."""
    env = control_plane.kubectl_env(tmp_path)
    path = str(DEPLOY / "overlays" / overlay)
    # a server-side dry run creates nothing, so the namespace the overlay creates must exist for the
    # dry run of the objects in it (as on any cluster: the first apply is the real one)
    kubectl(env, "apply", "-f", str(DEPLOY / "base/namespace.yaml"))
    dry = kubectl(env, "apply", "-k", path, "--dry-run=server", "--validate=strict", check=False)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    objs = render(tmp_path, overlay)
    for o in objs:
        assert re.search(rf"{o['kind'].lower()}[./a-z0-9-]*/{re.escape(o['metadata']['name'])} "
                         r"(created|configured|unchanged|serverside-applied) \(server dry run\)", dry.stdout), \
            (o["kind"], dry.stdout)
    kubectl(env, "apply", "-k", path, "--validate=strict")
    again = kubectl(env, "apply", "-k", path)
    assert "created" not in again.stdout and "configured" not in again.stdout, again.stdout


@pytest.mark.real
def test_the_crd_is_structural_and_explained(control_plane, tmp_path):
    env = control_plane.kubectl_env(tmp_path)
    kubectl(env, "apply", "-f", str(DEPLOY / "base/crd-driverrollout.yaml"))
    crd = control_plane.api("GET", CRD)
    conds = {c["type"]: c for c in crd["status"]["conditions"]}
    assert "NonStructuralSchema" not in conds, conds
    for _ in range(100):
        if control_plane.api("GET", CRD)["status"]["conditions"][0]:
            conds = {c["type"]: c for c in control_plane.api("GET", CRD)["status"]["conditions"]}
            if conds.get("Established", {}).get("status") == "True":
                break
    out = kubectl(env, "explain", "driverrollout.spec").stdout
    for field in ("driver", "maxParallel", "maxUnavailable", "nodeSelector", "drain", "failureBudget"):
        assert re.search(rf"^\s+{field}\s", out, re.M), (field, out)
    out = kubectl(env, "explain", "driverrollout.spec.maxUnavailable").stdout
    assert "maxUnavailable" in out and "percentage" in out


def test_the_old_crd_form_is_refused_by_the_real_apiserver(control_plane, tmp_path):
    """The form the loopback server let through: `type` inside anyOf next to x-kubernetes-int-or-string."""
    import yaml
    crd = yaml.safe_load((DEPLOY / "base/crd-driverrollout.yaml").read_text())
    crd["metadata"]["name"] = "oldrollouts.driverd.io"
    crd["spec"]["names"] = {"plural": "oldrollouts", "singular": "oldrollout", "kind": "OldRollout"}
    mu = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["maxUnavailable"]
    mu.pop("x-kubernetes-validations", None)
    mu["anyOf"] = [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": "^[0-9]+%$"}]
    r = kubectl(control_plane.kubectl_env(tmp_path), "create", "--dry-run=server", "-f", "-", input=json.dumps(crd),
                check=False)
    assert r.returncode != 0 and "structural" in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("bad,field", [
    ({"maxParallel": 0}, "spec.maxParallel"),
    ({"maxUnavailable": 0}, "spec.maxUnavailable"),
    ({"maxUnavailable": "ten"}, "spec.maxUnavailable"),
    ({"maxUnavailable": "10"}, "spec.maxUnavailable"),
    ({"driver": "latest"}, "spec.driver"),
    ({"flavor": "closed"}, "spec.flavor"),
    ({"drain": {"timeoutSeconds": 0}}, "spec.drain.timeoutSeconds"),
])
def test_the_crd_schema_refuses_bad_specs_naming_the_field(control_plane, tmp_path, bad, field):
    env = control_plane.kubectl_env(tmp_path)
    kubectl(env, "apply", "-f", str(DEPLOY / "base/crd-driverrollout.yaml"))
    obj = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "bad"},
           "spec": {"driver": "550.127.05", **bad}}
    r = kubectl(env, "create", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False)
    assert r.returncode != 0 and field in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("good", [{}, {"maxUnavailable": 3}, {"maxUnavailable": "25%"}])
def test_the_crd_schema_accepts_and_defaults_good_specs(control_plane, tmp_path, good):
    env = control_plane.kubectl_env(tmp_path)
    kubectl(env, "apply", "-f", str(DEPLOY / "base/crd-driverrollout.yaml"))
    obj = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "good"},
           "spec": {"driver": "550.127.05", **good}}
    r = kubectl(env, "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(obj))
    spec = json.loads(r.stdout)["spec"]
    assert spec["maxUnavailable"] == good.get("maxUnavailable", 1)
