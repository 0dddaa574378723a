"""`driverd cluster coordinator` off a cluster it can reach: one line naming the cause and its fix, exit 1
at once (not the informers' silent retries); nothing needs a control plane here."""
from __future__ import annotations

import json

from tests.conftest import free_port, run_cli


def test_an_unreachable_api_server_is_said_in_one_line_at_once(tmp_path):
    port = free_port()
    kc = tmp_path / "kubeconfig"
    kc.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "t",
                              "clusters": [{"name": "t", "cluster": {"server": f"https://127.0.0.1:{port}"}}],
                              "users": [{"name": "u", "user": {"token": "s3cr3t-token"}}],
                              "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}]}))
    kc.chmod(0o600)
    r = run_cli("cluster", "coordinator", "--root", str(tmp_path), "--kubeconfig", str(kc), timeout=60)
    assert r.returncode == 1
    (line,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "cannot read the Lease driverd/driverd-rollout" in line and f"127.0.0.1:{port}" in line \
        and "connection refused" in line and "fix:" in line, line
    assert "s3cr3t-token" not in r.stderr + r.stdout


def test_rollout_status_says_when_no_coordinator_has_written_a_rollout():
    """`kubectl driverd rollout status` of a rollout nobody has written a status for after 30 s: the
    coordinator is not running (its Deployment runs on no GPU node: a cluster of GPU nodes only leaves it
    Pending). Said with what to look at; a fresh rollout and one with a status are shown as they are."""
    import time

    from driverd.cli.rollout_status import _exit, _human_status, status_doc
    from driverd.cluster.kube import now_rfc3339

    def ro(age_s: float, status: dict | None = None) -> dict:
        return {"metadata": {"name": "r", "creationTimestamp": now_rfc3339(time.time() - age_s)},
                "spec": {"driver": "550.127.05"}, **({"status": status} if status else {})}
    old = status_doc(ro(120), [])
    assert old["phase"] == "Pending" and old["reason"] == "NoCoordinator", old
    assert "no coordinator has written this rollout's status in 1" in old["message"] \
        and "kubectl -n driverd get deploy driverd-coordinator" in old["message"], old
    assert "NoCoordinator" in _human_status(old) and _exit(old) == 0       # Pending is not a failure
    assert status_doc(ro(2), [])["reason"] == ""                           # just created: the coordinator's turn
    done = status_doc(ro(120, {"phase": "Completed", "reason": "Completed", "message": "all done"}), [])
    assert (done["reason"], done["message"]) == ("Completed", "all done")
