"""`driverd demo`'s rollout stage: skipped without an API server (driverd ships none), and run with
--kubeconfig on a real one — here the real control plane, as its admin."""
from __future__ import annotations

import re

from tests.conftest import run_cli
from tests.controlplane import reset


def test_demo_rollout_stage_on_the_real_control_plane(deployed, tmp_path):
    """Issue 42: the demo's rollout selects the nodes it made (labelled driverd.io/demo=<run>), never a
    node of the cluster it did not make, and removes what it made at the end: a second run works; --keep
    leaves them."""
    control_plane = deployed
    reset(control_plane)
    control_plane.api("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": "bystander", "labels": {"nvidia.com/gpu.present": "true",
                                        "feature.node.kubernetes.io/pci-10de.present": "true"}}})
    for i, keep in enumerate((False, True)):          # the second run works after the first one cleaned up
        r = run_cli("demo", "--workdir", str(tmp_path / "demo"), "--kubeconfig", control_plane.kubeconfig,
                    *(["--keep"] if keep else []), env={"HOME": str(tmp_path)})
        out = r.stdout + r.stderr
        assert r.returncode == 0, (i, out[-3000:])
        assert "a rolling upgrade across a simulated cluster of 4 GPU nodes" in out and control_plane.url in out
        run = re.search(r"labelled driverd\.io/demo=([0-9a-f]+)", out).group(1)
        assert f"driverrollout.driverd.io/demo-{run} created" in out
        assert "Completed" in out
        nodes = control_plane.api("GET", "/api/v1/nodes")["items"]
        mine = [n for n in nodes if (n["metadata"].get("labels") or {}).get("driverd.io/demo") == run]
        (other,) = [n for n in nodes if n["metadata"]["name"] == "bystander"]
        assert not any(k.startswith("driverd.io/") for k in (other["metadata"].get("labels") or {})), other
        assert not any(k.startswith("driverd.io/") for k in (other["metadata"].get("annotations") or {})), other
        rollouts = [ro["metadata"]["name"] for ro in
                    control_plane.api("GET", "/apis/driverd.io/v1alpha1/driverrollouts")["items"]]
        if keep:
            assert "demo: kept on the API server (--keep)" in out
            assert sorted(n["metadata"]["labels"]["driverd.io/driver-version"] for n in mine) == ["550.127.05"] * 4
            assert rollouts == [f"demo-{run}"]
        else:
            assert f"demo: removed what it made on the API server: 4 nodes (driverd.io/demo={run})" in out, out[-2000:]
            assert mine == [] and rollouts == [], (mine, rollouts)
            assert r.stdout.rstrip().splitlines()[-1].startswith("== done in")


def test_demo_without_an_api_server_skips_the_rollout_stage_and_says_how(tmp_path):
    r = run_cli("demo", "--workdir", str(tmp_path / "demo"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rolling upgrade across a simulated cluster: skipped" in r.stdout and "--kubeconfig" in r.stdout
