"""`kubectl driverd` behaves like kubectl (issue 32, item 7): a cluster it cannot reach is said at once in
one line, a missing kubeconfig is named as missing, usage lines say `kubectl driverd …`, `-n`, `-o
wide|json|yaml|name` and `rollout start --dry-run=client -o yaml` work, and deploy/examples holds a
DriverRollout for GitOps that the real kube-apiserver accepts under deploy/'s CRD."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from driverd.cluster import model as m
from tests.conftest import REPO, driverd_env, free_port
from tests.kubetools import kubectl

EXAMPLE = REPO / "deploy" / "examples" / "driverrollout.yaml"
CRD = REPO / "deploy" / "base" / "crd-driverrollout.yaml"


def plugin(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "kubectl-driverd"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "import sys; from driverd.cli import kubectl_main; "
                                           "sys.exit(kubectl_main())"]
    e = {k: v for k, v in driverd_env().items() if not k.startswith("KUBE")}
    e.update(env or {})
    return subprocess.run(cmd + list(argv), capture_output=True, text=True, env=e, timeout=timeout)



def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": server}}],
        "users": [{"name": "lab", "user": {"token": "t"}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "lab"}}]}))
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("argv", [["nodes"], ["rollout", "status"], ["rollout", "pause", "r"],
                                  ["rollout", "start", "--driver", "570.195.03"]])
def test_a_refused_connection_is_said_at_once_in_one_line(tmp_path, argv):
    server = f"https://127.0.0.1:{free_port()}"
    kc = _kubeconfig(tmp_path / "kc", server)
    t0 = time.monotonic()
    r = plugin(*argv, "--kubeconfig", str(kc))
    took = time.monotonic() - t0
    # at once, not after the client's retries (60 s): the bound leaves room for a loaded CI machine
    assert took < 30, f"{took:.1f}s"
    assert r.returncode == 3 and r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"cannot reach the Kubernetes API at {server}: connection refused" in r.stderr
    assert f"the server of context lab in {kc}" in r.stderr and "--kubeconfig FILE or --context NAME" in r.stderr


def test_a_missing_kubeconfig_is_named_as_missing(tmp_path):
    r = plugin("nodes", "--kubeconfig", str(tmp_path / "nonexistent"))
    assert r.returncode != 0 and r.stderr.count("\n") == 1
    assert f"kubeconfig {tmp_path / 'nonexistent'} does not exist" in r.stderr
    assert "(tried" not in r.stderr
    r = plugin("nodes", env={"KUBECONFIG": str(tmp_path / "gone"), "HOME": str(tmp_path)})
    assert r.returncode != 0 and f"$KUBECONFIG names {tmp_path / 'gone'}, which does not exist" in r.stderr


def test_usage_lines_say_kubectl_driverd():
    r = plugin("rollout", "start")                       # --driver missing
    assert r.returncode == 2 and r.stderr.startswith("usage: kubectl driverd rollout start ")
    assert "driverd cluster" not in r.stderr
    r = plugin("rollout", "status", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: kubectl driverd rollout status ")
    r = plugin("rollout")                                 # a group without its verb: that group's help
    assert r.returncode == 2 and r.stdout.startswith("usage: kubectl driverd rollout ") and "undo" in r.stdout
    r = plugin("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: kubectl driverd ") and "-o table|wide|json|yaml|name" \
        in r.stdout
    # the same commands on a node keep their own name
    from tests.conftest import run_cli
    r = run_cli("cluster", "rollout", "start")
    assert r.returncode == 2 and r.stderr.startswith("usage: driverd cluster rollout start ")


def _rollout_args() -> list[str]:
    return ["rollout", "start", "--driver", "570.195.03", "--selector", "nvidia.com/gpu.present=true",
            "--max-parallel", "2", "--max-unavailable", "10%", "--canary", "1", "--drain-timeout", "900"]


def test_dry_run_client_prints_the_manifest_without_a_cluster(tmp_path):
    """No kubeconfig at all: nothing is contacted."""
    r = plugin(*_rollout_args(), "--dry-run=client", "-o", "yaml", "-n", "driverd",
               env={"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")})
    assert r.returncode == 0, r.stderr
    obj = yaml.safe_load(r.stdout)
    assert obj["apiVersion"] == "driverd.io/v1alpha1" and obj["kind"] == "DriverRollout"
    assert obj["metadata"] == {"name": "driver-570-195-03"}          # cluster-scoped: no namespace
    assert obj["spec"]["nodeSelector"] == {"matchLabels": {"nvidia.com/gpu.present": "true"}}
    assert (obj["spec"]["maxParallel"], obj["spec"]["maxUnavailable"], obj["spec"]["canary"]) == (2, "10%", 1)
    assert m.Rollout.from_object(dict(obj, metadata=dict(obj["metadata"], generation=1))).drain_timeout_s == 900
    r = plugin(*_rollout_args(), "--dry-run", env={"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")})
    assert r.returncode == 0 and r.stdout == "driverrollout.driverd.io/driver-570-195-03 created (dry run)\n"
    r = plugin(*_rollout_args(), "--dry-run=client", "-o", "name", env={"KUBECONFIG": str(tmp_path / "none")})
    assert r.stdout == "driverrollout.driverd.io/driver-570-195-03\n"


@pytest.fixture
def fake_cluster(tmp_path):
    from tests.apiserver import ApiServer
    srv = ApiServer(host="127.0.0.1", port=0).start()
    try:
        srv.store.create("customresourcedefinitions", yaml.safe_load(CRD.read_text()))
        for name, labels, ann in (("gpu-a", {"driverd.io/driver-version": "535.261.03"}, {}),
                                  ("gpu-b", {"driverd.io/driver-version": "535.261.03"},
                                   {m.A_STATE: m.FAILED, m.A_REASON: "ValidationFailed",
                                    m.A_MESSAGE: "NVRM: GPU 0000:1b:00.0 fell off\nthe bus"})):
            srv.store.create("nodes", {"metadata": {"name": name, "labels": labels, "annotations": ann},
                                       "spec": {"unschedulable": name == "gpu-b"}})
        yield srv, srv.write_kubeconfig(tmp_path / "kubeconfig")
    finally:
        srv.stop()


def test_namespace_and_output_formats(fake_cluster):
    srv, kc = fake_cluster
    env = {"KUBECONFIG": kc}
    table = plugin("nodes", env=env)
    assert table.returncode == 0, table.stderr
    assert table.stdout.split("\n")[0].split() == ["NODE", "DRIVER", "FLAVOR", "STATE", "REASON", "SINCE"]
    # -n is accepted where kubectl users put it, before or after the command (cluster-scoped: same answer)
    for argv in (["-n", "driverd", "nodes"], ["nodes", "-n", "driverd"], ["--namespace=driverd", "nodes"]):
        r = plugin(*argv, env=env)
        assert r.returncode == 0 and r.stdout == table.stdout, (argv, r.stderr)
    wide = plugin("nodes", "-o", "wide", env=env)
    head = wide.stdout.split("\n")[0].split()
    assert head[:6] == ["NODE", "DRIVER", "FLAVOR", "STATE", "REASON", "SINCE"] and "MESSAGE" in head
    gpu_b = next(ln for ln in wide.stdout.splitlines() if ln.split()[:1] == ["gpu-b"])
    assert "NVRM: GPU 0000:1b:00.0 fell off the bus" in gpu_b           # whole, on its line
    assert plugin("nodes", "-o", "name", env=env).stdout == "node/gpu-a\nnode/gpu-b\n"
    assert [n["node"] for n in json.loads(plugin("nodes", "-o", "json", env=env).stdout)["nodes"]] == ["gpu-a", "gpu-b"]
    assert [n["node"] for n in yaml.safe_load(plugin("nodes", "-o", "yaml", env=env).stdout)["nodes"]] == \
        ["gpu-a", "gpu-b"]
    bad = plugin("nodes", "-o", "toml", env=env)
    assert bad.returncode == 2 and "invalid choice: 'toml'" in bad.stderr
    # a server dry run: validated by the API server, stored nowhere
    r = plugin(*_rollout_args(), "--dry-run=server", "-o", "name", env=env)
    assert r.returncode == 0 and r.stdout == "driverrollout.driverd.io/driver-570-195-03\n", r.stderr
    assert srv.store.list("driverrollouts") == []
    r = plugin(*_rollout_args(), "-o", "name", env=env)
    assert r.returncode == 0 and r.stdout == "driverrollout.driverd.io/driver-570-195-03\n", r.stderr
    st = plugin("rollout", "status", "-o", "wide", env=env)
    assert st.returncode == 0, st.stderr
    assert "ATTEMPT" in st.stdout and "CORDONED" in st.stdout
    assert plugin("rollout", "status", "-o", "name", env=env).stdout == "driverrollout.driverd.io/driver-570-195-03\n"
    assert plugin("rollout", "pause", "-o", "name", env=env).stdout == "driverrollout.driverd.io/driver-570-195-03\n"


@pytest.mark.real
def test_example_and_dry_run_manifests_pass_the_real_crd_schema(deployed, tmp_path):
    """deploy/examples/driverrollout.yaml and what `--dry-run=client -o yaml` prints: accepted by the real
    kube-apiserver under deploy/'s CRD (server-side dry run, unknown fields refused); the check can fail."""
    env = deployed.kubectl_env(tmp_path)
    example = yaml.safe_load(EXAMPLE.read_text())
    assert example["kind"] == "DriverRollout" and "namespace" not in example["metadata"]
    r = m.Rollout.from_object(dict(example, metadata=dict(example["metadata"], generation=1)))
    assert r.driver == "570.195.03" and r.max_unavailable == "10%"
    for doc in (EXAMPLE.read_text(),
                plugin(*_rollout_args(), "--dry-run=client", "-o", "yaml", env={"KUBECONFIG": "/nonexistent"}).stdout):
        out = kubectl(env, "create", "--dry-run=server", "--validate=strict", "-o", "json", "-f", "-", input=doc)
        created = json.loads(out.stdout)
        sent = yaml.safe_load(doc)["spec"]
        assert {k: v for k, v in created["spec"].items() if k in sent} == sent      # nothing pruned
    bad = yaml.safe_load(EXAMPLE.read_text())
    bad["spec"]["maxUnavailable"] = "lots"
    bad["spec"]["drainTimeout"] = 5
    r = kubectl(env, "create", "--dry-run=server", "--validate=strict", "-f", "-", input=yaml.safe_dump(bad),
                check=False)
    assert r.returncode != 0 and ("maxUnavailable" in r.stderr or "drainTimeout" in r.stderr)
