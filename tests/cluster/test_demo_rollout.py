"""`driverd demo`'s rollout stage: skipped without an API server (driverd ships none), and run with
--kubeconfig on a real one — here the real control plane, as its admin."""
from __future__ import annotations

from tests.conftest import run_cli
from tests.controlplane import reset


def test_demo_rollout_stage_on_the_real_control_plane(deployed, tmp_path):
    control_plane = deployed
    reset(control_plane)
    r = run_cli("demo", "--workdir", str(tmp_path / "demo"), "--kubeconfig", control_plane.kubeconfig,
                env={"HOME": str(tmp_path)})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "a rolling upgrade across a simulated cluster of 4 GPU nodes" in out and control_plane.url in out
    assert "driverrollout.driverd.io/driver-550-127-05 created" in out
    assert "Completed" in out and r.stdout.rstrip().splitlines()[-1].startswith("== done in")
    nodes = control_plane.api("GET", "/api/v1/nodes")["items"]
    assert sorted(n["metadata"]["labels"]["driverd.io/driver-version"] for n in nodes) == ["550.127.05"] * 4


def test_demo_without_an_api_server_skips_the_rollout_stage_and_says_how(tmp_path):
    r = run_cli("demo", "--workdir", str(tmp_path / "demo"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rolling upgrade across a simulated cluster: skipped" in r.stdout and "--kubeconfig" in r.stdout
