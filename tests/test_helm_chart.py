"""deploy/helm/driverd, driverd's Helm chart (issue 48), with Helm itself built from its Go module at a pinned
version (.ci/build-helm): it is tools/gen_helm_chart.py's rendering of deploy/base (no drift), `helm lint
--strict` is clean, `helm template` renders the objects `kubectl kustomize` renders for each overlay (the
values that stand for it), bad values are refused in one line, and `helm install`, `upgrade` and `uninstall`
work on a real control plane of its own (kube-apiserver with its CRD schema, RBAC and admission)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, missing_component
from tests.kubetools import kubectl, kubectl_binary

CHART = REPO / "deploy/helm/driverd"
KUBE_VERSION = "1.34.4"          # the control plane's (.ci/build-control-plane)
# each overlay of deploy/ and the values that give the chart the same objects
OVERLAY_VALUES = {
    "container-mode": [],
    "crio": ["--set", "runtime=crio"],
    "host-mode": ["--set", "mode=host"],
    "pinned-example": ["--set", "image.repository=registry.example/driverd", "--set", "image.digest=sha256:" + "0" * 64],
}


def helm_binary() -> str:
    r = subprocess.run(["bash", str(REPO / ".ci/build-helm"), "--print"], capture_output=True, text=True)
    path = r.stdout.strip()
    if subprocess.run(["bash", str(REPO / ".ci/build-helm"), "--check"]).returncode != 0:
        missing_component(f"helm is not built at {path} (bash .ci/build-helm builds it)")
    return path


def helm(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=300, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def _canonical(text: str) -> dict[tuple[str, str], dict]:
    """Objects by (kind, name), as Go's YAML reads them: the text goes through `kubectl kustomize` (Go's
    parser and emitter, the same that renders the overlays), so that two texts that differ only in how a
    string is written compare equal. CEL is whitespace-insensitive, and a folded CEL block of the sources
    reads with a blank line more or less depending on the parser that first read it: CEL fields are
    compared with their whitespace collapsed."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "all.yaml").write_text(text)
        Path(d, "kustomization.yaml").write_text("resources: [all.yaml]\n")
        out = kubectl({}, "kustomize", d).stdout

    def norm(o):
        if isinstance(o, dict):
            return {k: (" ".join(v.split()) if k in ("expression", "messageExpression") and isinstance(v, str)
                        else norm(v)) for k, v in o.items()}
        if isinstance(o, list):
            return [norm(x) for x in o]
        return o
    return {(o["kind"], o["metadata"]["name"]): norm(o) for o in yaml.safe_load_all(out) if o}


def template(*values: str, namespace: str = "driverd") -> subprocess.CompletedProcess:
    return helm("template", "driverd", str(CHART), "-n", namespace, "--include-crds", "--kube-version", KUBE_VERSION,
                *values, check=False)


def test_the_chart_is_the_rendering_of_deploy_base():
    r = subprocess.run([sys.executable, str(REPO / "tools/gen_helm_chart.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_helm_lint_strict_is_clean():
    r = helm("lint", "--strict", str(CHART), "-n", "driverd", "--kube-version", KUBE_VERSION, check=False)
    assert r.returncode == 0 and "[WARNING]" not in r.stdout and "[ERROR]" not in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("overlay", OVERLAY_VALUES)
def test_the_chart_renders_what_kustomize_renders_for_each_overlay(overlay):
    kubectl_binary()
    k = _canonical(kubectl({}, "kustomize", str(REPO / "deploy/overlays" / overlay)).stdout)
    # Helm's rule: the release's namespace is made before the chart (`--create-namespace`), not by it
    k.pop(("Namespace", "driverd"))
    r = template(*OVERLAY_VALUES[overlay])
    assert r.returncode == 0, r.stderr
    h = _canonical(r.stdout)
    assert sorted(h) == sorted(k)
    for key in k:
        assert h[key] == k[key], key


def test_values_that_differ_from_the_defaults_reach_the_objects():
    r = template("--set", "driver.version=550.163.01", "--set", "driver.flavor=open",
                 "--set", "repository.urls={https://repo.example/driverd,file:///srv/driverd}",
                 "--set-string", "config=[modules]\nload_drm = true\n",
                 "--set", "pools[0].name=h100", "--set", "pools[0].driver=550.163.01",
                 "--set", "pools[0].nodeSelector.matchLabels.pool=h100", "--set", "pools[0].maxUnavailable=2",
                 "--set", "coordinator.replicas=2", "--set", "image.tag=0.2.0")
    assert r.returncode == 0, r.stderr
    objs = _canonical(r.stdout)
    import tomllib
    cfg = tomllib.loads(objs[("ConfigMap", "driverd-config")]["data"]["config.toml"])
    assert cfg["driver"] == {"version": "550.163.01", "flavor": "open"}
    assert cfg["packages"]["repositories"] == ["https://repo.example/driverd", "file:///srv/driverd"]
    assert cfg["modules"] == {"load_drm": True} and cfg["cluster"] == {"coordinate": False}
    pool = objs[("DriverPool", "h100")]
    assert pool["spec"] == {"driver": "550.163.01", "nodeSelector": {"matchLabels": {"pool": "h100"}},
                            "maxUnavailable": 2}
    assert objs[("Deployment", "driverd-coordinator")]["spec"]["replicas"] == 2
    ds = objs[("DaemonSet", "driverd")]["spec"]["template"]["spec"]["containers"][0]
    assert ds["image"] == "driverd:0.2.0"


@pytest.mark.parametrize("values, says", [
    (["--set", "mode=daemonset"], "at '/mode': value must be one of 'container', 'host'"),
    (["--set", "driver.version=latest"], "/driver/version"),
    (["--set", "image.digest=sha256:abc"], "/image/digest"),
    (["--set", "repository.urls={ftp://x}"], "/repository/urls/0"),
    (["--set", "pools[0].name=h100"], "/pools/0"),
    (["--set", "replicas=3"], "additional properties 'replicas' not allowed"),
])
def test_bad_values_are_refused_naming_the_value(values, says):
    r = template(*values)
    assert r.returncode != 0 and says in r.stderr, r.stderr


def test_a_namespace_other_than_driverd_is_refused_with_the_fix():
    r = template(namespace="default")
    assert r.returncode != 0
    assert "installs into the namespace driverd (its admission policies name it), not default: run helm install " \
           "with -n driverd --create-namespace" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    """A control plane of its own: the session's has deploy/ applied with kubectl, which Helm would refuse to
    take over (the objects carry no release of its)."""
    from tests.controlplane import ControlPlane, binaries, finish, started
    cp = started(ControlPlane(binaries(), tmp_path_factory.mktemp("helm-k8s")))
    try:
        yield cp
    finally:
        finish(cp)


def _code(plane, path: str) -> int:
    import urllib.error
    try:
        plane.raw("GET", path)
        return 200
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.real
def test_install_upgrade_and_uninstall_on_the_real_control_plane(plane, tmp_path):
    env = {"HOME": str(tmp_path), "KUBECONFIG": plane.kubeconfig, "PATH": "/usr/bin:/bin",
           "HELM_CACHE_HOME": str(tmp_path / "cache"), "HELM_CONFIG_HOME": str(tmp_path / "config"),
           "HELM_DATA_HOME": str(tmp_path / "data")}
    r = helm("install", "driverd", str(CHART), "-n", "driverd", "--create-namespace", env=env)
    assert "STATUS: deployed" in r.stdout, r.stdout
    crd = plane.api("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/driverrollouts.driverd.io")
    assert crd["metadata"]["labels"]["app.kubernetes.io/part-of"] == "driverd"
    cm = plane.api("GET", "/api/v1/namespaces/driverd/configmaps/driverd-config")
    assert 'version = "570.195.03"' in cm["data"]["config.toml"]
    assert cm["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    ds = plane.api("GET", "/apis/apps/v1/namespaces/driverd/daemonsets/driverd")
    assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == "driverd:0.1.0"
    for p in ("driverd-node-scope", "driverd-coordinator-scope", "driverd-pool-rollouts"):
        plane.api("GET", f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{p}")

    # an upgrade: a new driver for the nodes in no pool, a pool (the real CRD's schema judges it), CRI-O
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "runtime": "crio", "driver": {"version": "550.163.01", "flavor": "open"},
        "pools": [{"name": "h100", "driver": "550.163.01", "nodeSelector": {"matchLabels": {"pool": "h100"}},
                   "maxUnavailable": 2}]}))
    r = helm("upgrade", "driverd", str(CHART), "-n", "driverd", "-f", str(values), env=env)
    assert "REVISION: 2" in r.stdout, r.stdout
    cm = plane.api("GET", "/api/v1/namespaces/driverd/configmaps/driverd-config")
    assert 'version = "550.163.01"' in cm["data"]["config.toml"]
    pool = plane.api("GET", "/apis/driverd.io/v1alpha1/driverpools/h100")
    assert pool["spec"]["maxUnavailable"] == 2
    env_names = [e["name"] for e in plane.api("GET", "/apis/apps/v1/namespaces/driverd/daemonsets/driverd")
                 ["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert "DRIVERD_RUNTIME_RUNTIMES" in env_names
    # a value the schema refuses: nothing is sent, the release stays at revision 2
    bad = helm("upgrade", "driverd", str(CHART), "-n", "driverd", "--set", "driver.flavor=closed", env=env,
               check=False)
    assert bad.returncode != 0 and "/driver/flavor" in bad.stderr, bad.stderr
    st = json.loads(helm("status", "driverd", "-n", "driverd", "-o", "json", env=env).stdout)
    assert st["version"] == 2 and st["info"]["status"] == "deployed"
    # mode=host: the DaemonSet, its ConfigMap and NetworkPolicy go, the rest stays
    helm("upgrade", "driverd", str(CHART), "-n", "driverd", "--set", "mode=host", env=env)
    assert _code(plane, "/apis/apps/v1/namespaces/driverd/daemonsets/driverd") == 404

    helm("uninstall", "driverd", "-n", "driverd", "--wait", env=env)
    for path in ("/apis/driverd.io/v1alpha1/driverpools/h100",
                 "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/driverd-node-scope",
                 "/apis/apps/v1/namespaces/driverd/deployments/driverd-coordinator",
                 "/apis/rbac.authorization.k8s.io/v1/clusterroles/driverd-node"):
        end = time.monotonic() + 60
        while _code(plane, path) != 404:
            assert time.monotonic() < end, path
            time.sleep(0.5)
    # Helm's rule for crds/: installed with the chart, never deleted with it (their objects would go too)
    plane.api("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/driverrollouts.driverd.io")


def test_the_readme_says_how_the_crds_are_upgraded():
    text = (REPO / "README.md").read_text()
    assert "helm install driverd deploy/helm/driverd -n driverd --create-namespace" in text
    assert re.search(r"kubectl apply --server-side -f deploy/helm/driverd/crds/", text), \
        "the README must say how CRDs are upgraded (Helm never upgrades crds/)"
