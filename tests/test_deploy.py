"""deploy/: a kustomize base and four overlays (container-mode, crio, host-mode, pinned-example), rendered with the
real `kubectl kustomize`, checked object by object (namespace, ServiceAccounts, RBAC against the API
calls driverd makes, the DaemonSet's image/args/env, a configuration driverd accepts). What the real
kube-apiserver accepts of them (`kubectl apply -k`, strict field validation) is tests/test_deploy_real.py;
what its RBAC authorizer and admission make of driverd's calls, tests/cluster/test_identity.py."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.kubetools import kubectl, kubectl_binary

DEPLOY = REPO / "deploy"
OVERLAYS = ("container-mode", "crio", "host-mode", "pinned-example")
NS = "driverd"
SA = "driverd"
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "RuntimeClass",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}

# What the node daemons call, (api group, resource, verb, where): "cluster" through the ClusterRole,
# "ns" in the driverd namespace. Keep in step with driverd/cluster (see test_code_calls_are_listed).
NODE_NEEDS = [
    ("", "nodes", v, "cluster") for v in ("list", "watch", "patch")
] + [
    ("", "pods", v, "cluster") for v in ("list", "watch", "delete")
] + [
    ("", "pods/eviction", "create", "cluster"),
    ("", "nodes/status", "patch", "cluster"),
    ("", "events", "create", "cluster"),
    ("resource.k8s.io", "resourceclaims", "get", "cluster"),
    ("resource.k8s.io", "resourceslices", "list", "cluster"),
    ("node.k8s.io", "runtimeclasses", "list", "cluster"),
] + [
    ("driverd.io", "driverrollouts", v, "cluster") for v in ("list", "watch")
] + [
    ("apps", "daemonsets", "get", "cluster"),
] + [
    ("driverd.io", "driverpools", "list", "cluster"),
    ("driverd.io", "driverpools", "watch", "cluster"),
] + [
    # a rollout's validation workload pod (spec.validation.workloadPod), in driverd's namespace only
    ("", "pods", "create", "ns"),
]
# (issue 44: the Lease, rollout writes and pool status are the coordinator's, COORDINATOR_NEEDS)
# What `driverd cluster coordinator` calls, as its own ServiceAccount (issue 44): the coordinator's half of
# NODE_NEEDS and nothing of a node's (no pods, evictions, node status, DRA, DaemonSets).
COORDINATOR_SA = "driverd-coordinator"
COORDINATOR_NEEDS = [("", "nodes", v, "cluster") for v in ("list", "watch", "patch")] + [
    ("", "events", "create", "cluster"),
] + [("driverd.io", "driverrollouts", v, "cluster") for v in ("list", "watch", "patch", "create")] + [
    ("driverd.io", "driverrollouts/status", "patch", "cluster"),
    ("driverd.io", "driverpools", "list", "cluster"),
    ("driverd.io", "driverpools", "watch", "cluster"),
    ("driverd.io", "driverpools/status", "patch", "cluster"),
] + [("coordination.k8s.io", "leases", v, "ns") for v in ("get", "create", "update", "list", "watch")]
OPERATOR_NEEDS = [("driverd.io", "driverrollouts", v) for v in ("create", "get", "list", "watch", "patch", "delete")] \
    + [("driverd.io", "driverpools", v) for v in ("create", "get", "list", "watch", "patch", "update", "delete")] \
    + [("", "nodes", v) for v in ("get", "list", "watch", "patch")] + [("", "events", "list")]


def _tree(tmp_path: Path) -> Path:
    """deploy/ as it is; while the DriverRollout CRD is still being written, a placeholder for it in
    this test's copy only."""
    if (DEPLOY / "base" / "crd-driverrollout.yaml").is_file():
        return DEPLOY
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    (copy / "base" / "crd-driverrollout.yaml").write_text(
        "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata:\n"
        "  name: driverrollouts.driverd.io\nspec:\n  group: driverd.io\n  scope: Cluster\n"
        "  names: {kind: DriverRollout, plural: driverrollouts, singular: driverrollout, listKind: DriverRolloutList}\n"
        "  versions:\n  - name: v1alpha1\n    served: true\n    storage: true\n    subresources: {status: {}}\n"
        "    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}\n")
    return copy


def render(tmp_path: Path, overlay: str) -> list[dict]:
    kubectl_binary()
    r = kubectl(dict(os.environ), "kustomize", str(_tree(tmp_path) / "overlays" / overlay))
    return [o for o in yaml.safe_load_all(r.stdout) if o]


def _by(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _allows(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    for r in rules:
        if group in r.get("apiGroups", []) and resource in r.get("resources", []) and verb in r.get("verbs", []):
            return True
    return False


def _bound_rules(objs: list[dict], sa: str = SA) -> tuple[list[dict], list[dict]]:
    """The rules bound to ServiceAccount driverd/`sa`: cluster-wide ones, and those in namespace driverd."""
    def to_sa(b):
        return any(s.get("kind") == "ServiceAccount" and s.get("name") == sa and s.get("namespace") == NS
                   for s in b.get("subjects") or [])
    roles, croles = _by(objs, "Role"), _by(objs, "ClusterRole")
    cluster = [r for b in _by(objs, "ClusterRoleBinding").values() if to_sa(b)
               for r in croles[b["roleRef"]["name"]]["rules"]]
    ns = [r for b in _by(objs, "RoleBinding").values() if to_sa(b) and b["metadata"]["namespace"] == NS
          for r in (roles if b["roleRef"]["kind"] == "Role" else croles)[b["roleRef"]["name"]]["rules"]]
    return cluster, ns


@pytest.mark.real
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_objects_are_consistent(tmp_path, overlay):
    objs = render(tmp_path, overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
            "RoleBinding", "RuntimeClass", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= kinds
    assert list(_by(objs, "Namespace")) == [NS]
    assert "driverrollouts.driverd.io" in _by(objs, "CustomResourceDefinition")
    for o in objs:                                    # one namespace, and none on cluster-scoped kinds
        if o["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in o["metadata"], o["metadata"]
        else:
            assert o["metadata"].get("namespace") == NS, (o["kind"], o["metadata"])
    # every ServiceAccount referenced exists, every role bound exists
    sas = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs if o["kind"] == "ServiceAccount"}
    refs = [(NS, ds["spec"]["template"]["spec"]["serviceAccountName"])
            for ds in list(_by(objs, "DaemonSet").values()) + list(_by(objs, "Deployment").values())]
    for b in list(_by(objs, "ClusterRoleBinding").values()) + list(_by(objs, "RoleBinding").values()):
        refs += [(s["namespace"], s["name"]) for s in b["subjects"] if s["kind"] == "ServiceAccount"]
        assert b["roleRef"]["name"] in _by(objs, b["roleRef"]["kind"]), b["roleRef"]
    for sec in _by(objs, "Secret").values():
        if sec.get("type") == "kubernetes.io/service-account-token":
            refs.append((NS, sec["metadata"]["annotations"]["kubernetes.io/service-account.name"]))
    assert refs and set(refs) <= sas, set(refs) - sas
    rc = _by(objs, "RuntimeClass")["nvidia"]
    from driverd.config import SCHEMA
    assert rc["handler"] == SCHEMA["runtime.handler"].default


def _holds_exactly(objs: list[dict], sa: str, needs: list[tuple]) -> tuple[list[dict], list[dict]]:
    """ServiceAccount driverd/`sa` is granted every one of `needs`, nothing else, no wildcard; its rules
    (cluster-wide, in namespace driverd)."""
    cluster, ns = _bound_rules(objs, sa)
    missing = [n for n in needs if not _allows(cluster if n[3] == "cluster" else ns + cluster, *n[:3])]
    assert not missing, (sa, missing)
    needed = {(g, r, v) for g, r, v, _ in needs}
    extra = [(g, r, v) for rule in cluster + ns for g in rule["apiGroups"] for r in rule["resources"]
             for v in rule["verbs"] if (g, r, v) not in needed]
    assert not extra, f"rules {sa} does not need: {extra}"
    assert not any("*" in rule.get(k, []) for rule in cluster + ns for k in ("apiGroups", "resources", "verbs"))
    return cluster, ns


@pytest.mark.real
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_covers_the_node_daemons_calls_and_nothing_more(tmp_path, overlay):
    objs = render(tmp_path, overlay)
    cluster, ns = _holds_exactly(objs, SA, NODE_NEEDS)
    # in driverd's namespace the node daemons hold only the creation of a validation workload pod (the Lease
    # is the coordinator's); what such a pod may be is the admission policy's (driverd-node-scope)
    assert [(g, r, v) for rule in ns for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]] \
        == [("", "pods", "create")], ns
    op = _by(objs, "ClusterRole")["driverd-operator"]["rules"]
    assert [n for n in OPERATOR_NEEDS if not _allows(op, *n)] == []
    # the coordinator's own ServiceAccount (issue 44): its calls, nothing more
    cluster, ns = _holds_exactly(objs, COORDINATOR_SA, COORDINATOR_NEEDS)
    assert all(not any(v in ("get", "update", "list", "watch") for v in rule["verbs"]) or
               rule.get("resourceNames") == ["driverd-rollout"] for rule in ns), "leases: only driverd's own"
    # the ClusterRole and Role say WHY for every rule (a comment above each one)
    for f in ("rbac-node.yaml", "rbac-operator.yaml", "rbac-coordinator.yaml"):
        text = (DEPLOY / "base" / f).read_text().splitlines()
        for i, line in enumerate(text):
            if line.strip().startswith("- apiGroups:"):
                assert text[i - 1].strip().startswith("#"), f"{f}:{i + 1}: a rule without its reason"


@pytest.mark.real
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_coordinator_runs_on_its_own_identity_and_never_on_a_gpu_node(tmp_path, overlay):
    """Issue 44: `driverd cluster coordinator` as a Deployment of its own ServiceAccount, in every mode (host
    mode too: the hosts' daemons are agents), kept off the nodes the DaemonSet runs on (a node's root reads
    the tokens of the pods on it), with nothing of a host."""
    from driverd.cli import build_parser
    objs = render(tmp_path, overlay)
    dep = _by(objs, "Deployment")["driverd-coordinator"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["serviceAccountName"] == COORDINATOR_SA and dep["metadata"]["namespace"] == NS
    assert c["command"] + c["args"] == ["driverd", "cluster", "coordinator", "--listen", "0.0.0.0:9478"]
    assert c["ports"] == [{"name": "metrics", "containerPort": 9478, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    build_parser().parse_args(c["args"])                       # a command driverd has
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    gpu_label = next(iter(_by(render(tmp_path, "container-mode"), "DaemonSet")["driverd"]["spec"]["template"]["spec"]
                          ["nodeSelector"]))
    # every term (they are ORed) keeps it off a node with the DaemonSet's label
    assert terms and all({"key": gpu_label, "operator": "NotIn", "values": ["true"]} in t["matchExpressions"]
                         for t in terms), terms
    assert not pod.get("volumes") and not pod.get("hostPID") and not pod.get("hostNetwork")
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert pod["securityContext"]["runAsNonRoot"] is True
    ds = _by(objs, "DaemonSet").get("driverd")
    if ds:                                                       # the one image for both
        assert c["image"] == ds["spec"]["template"]["spec"]["containers"][0]["image"]


@pytest.mark.real
@pytest.mark.parametrize("overlay", ("container-mode", "crio"))
def test_the_daemonset(tmp_path, overlay):
    objs = render(tmp_path, overlay)
    ds = _by(objs, "DaemonSet")["driverd"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == SA and pod["hostPID"] is True
    assert pod["enableServiceLinks"] is False       # issue 32: no DRIVERD_SERVICE_HOST from a Service `driverd`
    assert pod["nodeSelector"] == {"feature.node.kubernetes.io/pci-10de.present": "true"}
    (c,) = pod["containers"]
    assert c["image"] == "driverd:0.1.0" and c["command"] == ["driverd"]
    assert c["args"][:3] == ["container-entrypoint", "--root", "/host"]
    assert c["securityContext"]["privileged"] is True
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols[mounts["/host"]["name"]]["hostPath"]["path"] == "/"
    assert mounts["/host"]["mountPropagation"] == "HostToContainer"        # driverd mounts nothing
    # the configuration driverd reads: the ConfigMap's file, with the DRIVERD_* variables over it
    cfg_path = env["DRIVERD_CONFIG"]["value"]
    mount = next(m for p, m in mounts.items() if cfg_path.startswith(p + "/"))
    cm = _by(objs, "ConfigMap")[vols[mount["name"]]["configMap"]["name"]]
    f = tmp_path / "config.toml"
    f.write_text(cm["data"][os.path.basename(cfg_path)])
    from driverd import config
    from driverd.root import Root
    cfg = config.load(Root(tmp_path), str(f), environ={k: e["value"] for k, e in env.items()
                                                      if k.startswith("DRIVERD_") and "value" in e})
    assert cfg["driver.version"] and cfg["daemon.listen"].startswith("0.0.0.0:")
    probes = {c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]}
    assert probes == {"/readyz", "/healthz"}
    _probes_tolerate_a_slow_answer(c)
    # issue 21: resources bounded; the port reachable only from the namespaces allowed to scrape it
    res = c["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
    assert "cpu" not in res["limits"]
    (np,) = _by(objs, "NetworkPolicy").values()
    labels = pod.get("labels") or ds["spec"]["template"]["metadata"]["labels"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert np["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["metrics"] and all("namespaceSelector" in f for f in rule["from"])
    if overlay == "crio":
        assert cfg["runtime.runtimes"] == ["crio"] and cfg["runtime.restart"] == "systemd" and cfg["runtime.cdi"]
    else:
        assert cfg["runtime.runtimes"] == ["auto"]


def _probes_tolerate_a_slow_answer(c: dict) -> None:
    for name in ("readinessProbe", "livenessProbe"):
        p = c[name]
        timeout, period = p.get("timeoutSeconds", 1), p.get("periodSeconds", 10)     # Kubernetes' defaults
        threshold = p.get("failureThreshold", 3)
        # a SYN dropped by a full accept queue is retried after 1 s, then 2 s more: one slow answer
        # under a connection flood must neither time out nor, alone, make the pod NotReady
        assert 5 <= timeout < period and threshold >= 3, (name, p)


def test_the_probes_do_not_flap_under_a_connection_flood():
    """issue 30: the readiness probe had the default 1 s timeout and failureThreshold 1, so a single
    probe that waited behind a flood (a dropped SYN alone costs 1 s) flipped the pod NotReady."""
    ds = yaml.safe_load((REPO / "deploy/base/daemonset.yaml").read_text())
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    _probes_tolerate_a_slow_answer(c)


@pytest.mark.real
def test_the_pinned_example_runs_an_image_by_digest(tmp_path):
    objs = render(tmp_path, "pinned-example")
    (c,) = _by(objs, "DaemonSet")["driverd"]["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"registry\.example/driverd@sha256:[0-9a-f]{64}", c["image"]), c["image"]
    same = lambda o: (o["kind"], o["metadata"]["name"])          # noqa: E731
    assert {same(o) for o in objs} == {same(o) for o in render(tmp_path, "container-mode")}


@pytest.mark.real
def test_host_mode_keeps_rbac_and_crd_without_a_daemonset(tmp_path):
    objs = render(tmp_path, "host-mode")
    assert not _by(objs, "DaemonSet") and "driverd-config" not in _by(objs, "ConfigMap")
    # no shared long-lived token: each host gets a token bound to its Node (the overlay says how)
    assert not _by(objs, "Secret")
    assert "--bound-object-kind Node" in (DEPLOY / "overlays/host-mode/kustomization.yaml").read_text()
    container = render(tmp_path, "container-mode")
    same = lambda o: (o["kind"], o["metadata"]["name"])          # noqa: E731
    assert {same(o) for o in container} - {same(o) for o in objs} == {("DaemonSet", "driverd"),
                                                                      ("ConfigMap", "driverd-config"),
                                                                      ("NetworkPolicy", "driverd")}


def test_code_calls_are_listed():
    """Every kind of API call found in driverd/cluster has its permission in NODE_NEEDS or
    COORDINATOR_NEEDS (so the RBAC test above follows the code)."""
    src = "\n".join(p.read_text() for p in (REPO / "driverd" / "cluster").rglob("*.py")) \
        if (REPO / "driverd" / "cluster").is_dir() else ""
    needs = {(g, r, v) for g, r, v, _ in NODE_NEEDS + COORDINATOR_NEEDS}
    signs = {r'"/eviction"': ("", "pods/eviction", "create"), r"kube\.delete\(pods_path": ("", "pods", "delete"),
             r"kube\.create\(pods_path\(self\.namespace": ("", "pods", "create"),
             r"runtimeclasses": ("node.k8s.io", "runtimeclasses", "list"),
             r"resourceclaims": ("resource.k8s.io", "resourceclaims", "get"),
             r"/resourceslices": ("resource.k8s.io", "resourceslices", "list"),
             r"/events\"": ("", "events", "create"), r"lease_path": ("coordination.k8s.io", "leases", "update"),
             r"rollout_path\([^)]*status=True": ("driverd.io", "driverrollouts/status", "patch"),
             r"kube\.patch\(node_path": ("", "nodes", "patch"),
             r"kube\.patch\(rollout_path\(md": ("driverd.io", "driverrollouts", "patch"),
             r"kube\.create\(rollout_path\(\)": ("driverd.io", "driverrollouts", "create"),
             r"pool_path\(\)": ("driverd.io", "driverpools", "watch"),
             r"pool_path\([^)]*status=True": ("driverd.io", "driverpools/status", "patch"),
             r"/daemonsets/": ("apps", "daemonsets", "get"),
             r"Informer\(self\.kube, pods_path\(\)": ("", "pods", "watch"),
             r"node_path\([^)]*\) \+ \"/status\"": ("", "nodes/status", "patch")}
    for pattern, need in signs.items():
        if re.search(pattern, src):
            assert need in needs, (pattern, need)


def test_no_reference_to_the_old_manifest():
    assert not (DEPLOY / "daemonset.yaml").exists()
    hits = []
    for p in [REPO / "README.md", REPO / "docs" / "architecture.md", *(REPO / "images").iterdir(),
              *(REPO / "tests").rglob("*.py")]:
        if p.is_file() and p.name != "test_deploy.py" and "deploy/daemonset.yaml" in p.read_text(errors="replace"):
            hits.append(str(p.relative_to(REPO)))
    assert not hits, hits
    readme = (REPO / "README.md").read_text()
    for o in OVERLAYS:
        assert f"deploy/overlays/{o}" in readme
    assert "nvidia.com/gpu.present" in readme and "pci-10de.present" in readme


def test_the_packaged_crd_is_the_deployed_one():
    """driverd/data/crd-*.yaml are package data (an installed wheel has no deploy/): the same bytes as
    deploy/base's, which kustomize can only read from inside its own directory."""
    for name in ("crd-driverrollout.yaml", "crd-driverpool.yaml"):
        packaged = REPO / "driverd/data" / name
        assert packaged.read_bytes() == (DEPLOY / "base" / name).read_bytes(), \
            f"copy deploy/base/{name} to driverd/data/ (or the other way round)"


def test_the_pool_crd_is_generated_from_the_rollout_crd():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen_pool_crd", REPO / "tools/gen_pool_crd.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DEPLOY / "base/crd-driverpool.yaml").read_text() == gen.render(), "run tools/gen_pool_crd.py"


def test_a_pools_spec_is_a_rollouts_spec():
    """A DriverPool's spec is read with the rollout model (cluster/pools.py): one schema for both, field
    for field, defaults and validations included; a pool must name its nodeSelector."""
    def spec(name):
        doc = yaml.safe_load((DEPLOY / "base" / name).read_text())
        return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    pool, rollout = spec("crd-driverpool.yaml"), spec("crd-driverrollout.yaml")
    assert pool["properties"] == rollout["properties"], "run tools/gen_pool_crd.py"
    assert pool["required"] == ["driver", "nodeSelector"] and rollout["required"] == ["driver"]
