"""Issue 44: the coordinator on its own identity. `driverd cluster coordinator` (the real CLI, in a
process of its own) runs as deploy/'s ServiceAccount driverd-coordinator with a token bound to its
pod; the GPU nodes' daemons run their own side only (cluster.coordinate = false), each with its
node-bound token. On the real control plane with deploy/ applied: the coordinator takes the Lease in
its pod's name, runs a rollout to the end, and gives the Lease up on SIGTERM; no node daemon ever
wrote the Lease, a rollout's status or another node. deploy/'s driverd-coordinator-scope holds the
coordinator's writes: a replica that does not hold the Lease is refused."""
from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
from pathlib import Path

import pytest

from driverd.cluster import model as m
from driverd.cluster.kube import lease_path, node_path, rollout_path
from driverd.cluster.lease import LEASE_NAME
from driverd.sim.fleet import NEW, OLD, spawn_coordinator
from tests.cluster.realfleet import SA_USER as NODE_SA
from tests.cluster.realfleet import hosts, make, refusals, rollout, views, wait_phase  # noqa: F401 (make: a fixture)
from tests.conftest import run_cli, stop_process
from tests.kubetools import kubeconfig_token

pytestmark = [pytest.mark.real, pytest.mark.slow]
NS = "driverd"


def _coordinator(cp, tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    kc = cp.coordinator_kubeconfig(name, tmp_path / f"{name}.kubeconfig")     # a token bound to pod `name`
    return spawn_coordinator(kc, name, tmp_path, env={"POD_NAME": "ignored"})      # --identity wins


def _holder(f) -> str | None:
    return ((f.admin.find(lease_path(NS, LEASE_NAME)) or {}).get("spec") or {}).get("holderIdentity")


def _node_writes(cp, since: int) -> list[str]:
    """What the node daemons' ServiceAccount wrote that only a coordinator writes."""
    out = []
    with open(cp.audit_log, "rb") as fh:
        fh.seek(since)
        for line in fh.read().decode().splitlines():
            ev = json.loads(line)
            if ev.get("user", {}).get("username") != NODE_SA or ev.get("stage") != "ResponseComplete":
                continue
            ref = ev.get("objectRef") or {}
            if ev["verb"] in ("create", "update", "patch") and (
                    ref.get("resource") in ("leases", "driverrollouts", "driverpools")
                    or (ref.get("resource") == "nodes" and ev["user"].get("extra", {}).get(
                        "authentication.kubernetes.io/node-name", [""])[0] != ref.get("name"))):
                out.append(f"{ev['verb']} {ev['requestURI']}")
    return out


def test_the_coordinators_own_process_runs_a_rollout_and_no_node_coordinates(deployed, make, tmp_path):
    cp = deployed
    f = make(3, coordinator="none")
    f.start()
    assert f.wait(lambda: all(v.driver == OLD for v in views(f).values()), 60), "daemons did not label their nodes"
    p, log = _coordinator(cp, tmp_path, "driverd-coordinator-0")
    try:
        assert f.wait(lambda: _holder(f) == "driverd-coordinator-0", 30), (_holder(f), log.read_text()[-2000:])
        f.admin.create(rollout_path(), rollout("c", nodeSelector=hosts("gpu-0000", "gpu-0001"), maxParallel=1))
        wait_phase(f, "c", ("Completed",), timeout=180)
        vs = views(f)
        assert (vs["gpu-0000"].driver, vs["gpu-0001"].driver, vs["gpu-0002"].driver) == (NEW, NEW, OLD)
        assert _holder(f) == "driverd-coordinator-0"
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(20)
        except subprocess.TimeoutExpired:
            stop_process(p)
            rc = None
    assert rc == 0, log.read_text()[-2000:]
    assert _holder(f) in (None, ""), _holder(f)                     # given up at once for the next replica
    assert _node_writes(cp, f.audit_from) == []
    assert refusals(cp, f.audit_from) == []


def test_a_coordinator_replica_that_does_not_hold_the_lease_may_not_admit(deployed, make, tmp_path):
    """Two replicas: the one holding the Lease admits; the other's token (its own pod) is refused an
    admission by driverd-coordinator-scope, in words naming the holder."""
    cp = deployed
    f = make(2, coordinator="none")
    f.start()
    p, log = _coordinator(cp, tmp_path, "driverd-coordinator-a")
    try:
        assert f.wait(lambda: _holder(f) == "driverd-coordinator-a", 30), (_holder(f), log.read_text()[-2000:])
        other = kubeconfig_token(cp.coordinator_kubeconfig("driverd-coordinator-b", tmp_path / "b.kubeconfig"))
        # an admission of the shape the coordinator writes (driverd-node-scope passes it), of a node whose
        # daemon answered a preflight
        cp.api("PATCH", node_path("gpu-0001"), {"metadata": {"annotations": {
            m.A_PREFLIGHT: json.dumps({"ok": True, "rollout": "x"})}}}, content_type="application/merge-patch+json")
        with pytest.raises(urllib.error.HTTPError) as e:
            cp.api("PATCH", node_path("gpu-0001"), {"metadata": {"annotations": {
                m.A_STATE: m.ADMITTED, m.A_REASON: "Admitted", m.A_ROLLOUT: "x/u/1", m.A_TARGET: f"{NEW}/auto",
                m.A_ADMITTED_BY: "driverd-coordinator-b"}}},
                token=other, content_type="application/merge-patch+json")
        msg = json.loads(e.value.read() or b"{}").get("message", "")
        assert e.value.code == 403 and "driverd coordinator driverd-coordinator-b does not hold the Lease" in msg \
            and "its holder: driverd-coordinator-a" in msg, msg
        assert views(f)["gpu-0001"].state == m.IDLE
    finally:
        stop_process(p)


def test_a_coordinator_without_the_coordinators_rights_says_so_and_exits(deployed, tmp_path):
    """A token of another ServiceAccount: one line naming the refusal and deploy/'s RBAC, exit 1 at once."""
    token = deployed.token("default", "default")
    kc = deployed.write_kubeconfig(tmp_path / "kc", token=token, user="default")
    r = run_cli("cluster", "coordinator", "--root", str(tmp_path), "--kubeconfig", kc, "--identity", "x", timeout=60)
    assert r.returncode == 1, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "cannot read the Lease driverd/driverd-rollout" in line and "403" in line \
        and "ServiceAccount driverd-coordinator" in line and "rbac-coordinator.yaml" in line, line
    assert token.split(".")[-1] not in r.stderr                     # no secret in the output (its signature)


def test_a_node_daemon_left_coordinating_under_deploys_rbac_says_so_once_and_stops_trying(deployed, make):
    """cluster.coordinate left at its default (true) on a node of a cluster with deploy/'s RBAC: its
    identity may not hold the Lease. The coordinator candidate says so once, naming the fix, and stops;
    the node's own side goes on (the test's fleet coordinator then runs its rollouts)."""
    import threading
    from driverd.cluster.coordinator import Coordinator
    from driverd.cluster.informer import Informer
    from driverd.cluster.kube import Kube, Target
    f = make(1, coordinator="none")
    said: list[str] = []
    kube = Kube(Target(kubeconfig=f.node_kubeconfig("gpu-0000")), retry_for_s=5)
    c = Coordinator(kube, "gpu-0000", NS, rollouts=Informer(kube, rollout_path(), name="rollouts"), log=said.append)
    t = threading.Thread(target=c.run, daemon=True)
    t.start()
    t.join(45)
    assert not t.is_alive(), said
    lines = [s for s in said if "may not hold the rollout Lease" in s]
    assert len(lines) == 1 and "set cluster.coordinate = false" in lines[0] and "403" in lines[0], said
    assert _holder(f) in (None, "")
