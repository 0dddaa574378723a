"""Issue 33, section 3: every operator verb (node retry, skip, unskip; rollout pause, resume, abort,
delete, undo) and every rollout phase transition, on the real control plane as a cluster runs it:
each daemon with its node-bound token, deploy/'s admission policies applied, the product's DEFAULT
Lease duration, and the coordinator on a node the verbs do not touch (tests/cluster/realfleet.py) —
so that no verb works only because the Lease holder happens to be the node it acts on. Driven through
`kubectl driverd` as an operator bound to deploy/'s driverd-operator ClusterRole. No test here may
see kube-apiserver refuse a request of driverd's ServiceAccount."""
from __future__ import annotations

import json
import time

import pytest

from driverd.cluster import model as m
from driverd.cluster.kube import rollout_path
from driverd.sim.fleet import NEW, OLD, Fleet
from tests.cluster.realfleet import (  # noqa: F401 (make: a fixture)
    make,
    PhaseLog,
    hosts,
    node_events,
    refusals,
    rollout,
    start_with_coordinator,
    views,
    wait_phase,
)
from tests.cluster.test_rollout import cli

pytestmark = [pytest.mark.real, pytest.mark.slow]
COORD = "gpu-0000"




def _ok(f: Fleet, *argv) -> str:
    rc, out, err = cli(f, *argv)
    assert rc == 0, (argv, rc, out, err)
    return out


def test_canary_pause_resume_skip_unskip_and_retry(deployed, make):
    """(Preflight →) Progressing (the canary) → Paused/CanaryDone; skip and unskip while paused;
    pause (PausedBySpec) and resume; a node fails → Paused/FailureBudgetSpent; its cause fixed,
    `node retry` → the coordinator (another node) admits it again → Completed."""
    f = make(4)
    f.reload_fails("gpu-0002")
    start_with_coordinator(f)
    log = PhaseLog(f)
    targets = ["gpu-0001", "gpu-0002", "gpu-0003"]
    f.admin.create(rollout_path(), rollout("r", nodeSelector=hosts(*targets), canary=1, failureBudget=0))
    ro = wait_phase(f, "r", ("Paused",), timeout=90)
    assert ro["status"]["reason"] == "CanaryDone" and views(f)["gpu-0001"].state == m.DONE
    _ok(f, "node", "skip", "gpu-0003")
    assert f.wait(lambda: (f.admin.get(rollout_path("r"))["status"]["nodes"] or {}).get("skipped") == 1, 30)
    _ok(f, "node", "unskip", "gpu-0003")
    assert f.wait(lambda: (f.admin.get(rollout_path("r"))["status"]["nodes"] or {}).get("skipped") == 0, 30)
    _ok(f, "rollout", "pause", "r")
    assert f.wait(lambda: f.admin.get(rollout_path("r"))["status"].get("reason") == "PausedBySpec", 30)
    _ok(f, "rollout", "resume", "r")
    ro = wait_phase(f, "r", ("Paused",), timeout=90)
    assert f.wait(lambda: f.admin.get(rollout_path("r"))["status"].get("reason") == "FailureBudgetSpent", 60), \
        f.admin.get(rollout_path("r"))["status"]
    v = views(f)["gpu-0002"]
    assert v.state == m.FAILED and v.reason == "RolledBack" and v.attempt == 1
    assert views(f)["gpu-0003"].state == m.IDLE
    f.reload_works("gpu-0002")
    _ok(f, "node", "retry", "gpu-0002")
    ro = wait_phase(f, "r", ("Completed",), timeout=90)
    vs = views(f)
    assert [vs[n].driver for n in targets] == [NEW, NEW, NEW] and vs["gpu-0002"].attempt == 2
    assert vs[COORD].driver == OLD and vs[COORD].state == m.IDLE
    assert log.moves("r") == ["Progressing", "Paused", "Progressing", "Paused", "Progressing", "Completed"], \
        log.history("r")
    reasons = [r for _, r in log.history("r")]
    for want in ("CanaryDone", "PausedBySpec", "FailureBudgetSpent"):
        assert want in reasons, log.history("r")
    assert refusals(deployed, f.audit_from) == []
    log.close()


def test_retry_reopens_a_failed_rollout(deployed, make):
    """A rollout that ended Failed (within its budget) is reopened by `node retry`: its coordinator
    on another node admits the node, and the node's daemon acts on it (before: the admission raced
    the rollout's status, and the node handed it back as AdmissionRejected: "rollout r has ended")."""
    f = make(3)
    f.reload_fails("gpu-0001")
    start_with_coordinator(f)
    log = PhaseLog(f)
    f.admin.create(rollout_path(), rollout("r", nodeSelector=hosts("gpu-0001", "gpu-0002"), failureBudget=1))
    ro = wait_phase(f, "r", ("Failed",), timeout=90)
    assert ro["status"]["nodes"]["failed"] == 1 and ro["status"]["nodes"]["done"] == 1
    time.sleep(2)
    assert log.moves("r")[-1] == "Failed"       # it ended: nothing reopens it by itself
    f.reload_works("gpu-0001")
    _ok(f, "node", "retry", "gpu-0001")
    ro = wait_phase(f, "r", ("Completed",), timeout=90)
    v = views(f)["gpu-0001"]
    assert v.driver == NEW and v.state == m.DONE and v.attempt == 2, vars(v)
    assert node_events(f, "gpu-0001", "AdmissionRejected") == []
    assert log.moves("r") == ["Progressing", "Failed", "Progressing", "Completed"], log.history("r")
    assert refusals(deployed, f.audit_from) == []
    log.close()


def test_invalid_abort_delete_and_undo(deployed, make):
    """Invalid (a spec the schema lets through) → fixed by an edit → (Preflight →) Progressing →
    Completed, then `rollout undo` → its undo rollout Completed; `rollout abort` and `rollout delete`
    of rollouts holding a node in `evicting` give it back."""
    f = make(3)
    f.pdb_never("gpu-0001")
    start_with_coordinator(f)
    log = PhaseLog(f)
    k = f.admin
    # abort
    k.create(rollout_path(), rollout("r1", nodeSelector=hosts("gpu-0001"), drain={"timeoutSeconds": 300}))
    assert f.wait(lambda: views(f)["gpu-0001"].state == m.EVICTING, 60)
    _ok(f, "rollout", "abort", "r1")
    assert f.wait(lambda: views(f)["gpu-0001"].state == m.IDLE, 30)
    wait_phase(f, "r1", ("Aborted",))
    assert views(f)["gpu-0001"].reason == "Aborted" and not views(f)["gpu-0001"].unschedulable
    # delete
    k.create(rollout_path(), rollout("r2", nodeSelector=hosts("gpu-0001"), drain={"timeoutSeconds": 300}))
    assert f.wait(lambda: views(f)["gpu-0001"].state == m.EVICTING, 60)
    _ok(f, "rollout", "delete", "r2")
    assert f.wait(lambda: k.find(rollout_path("r2")) is None, 30), "the finalizer was never removed"
    v = views(f)["gpu-0001"]
    assert v.state == m.IDLE and v.driver == OLD and not v.unschedulable, vars(v)
    # invalid, then fixed
    f.set_pdb("gpu-0001", 1)
    k.create(rollout_path(), rollout("r3", nodeSelector={"matchExpressions": [{"key": "pool", "operator": "In"}]}))
    ro = wait_phase(f, "r3", ("Invalid",))
    assert "spec.nodeSelector.matchExpressions" in ro["status"]["message"]
    k.patch(rollout_path("r3"), {"spec": {"nodeSelector": hosts("gpu-0001", "gpu-0002"), "maxParallel": 2,
                                          "maxUnavailable": 2}})
    wait_phase(f, "r3", ("Completed",), timeout=90)
    assert views(f)["gpu-0001"].driver == NEW and views(f)["gpu-0002"].driver == NEW
    # undo
    made = json.loads(_ok(f, "rollout", "undo", "r3", "-o", "json"))["created"]
    assert made == [{"rollout": f"r3-undo-{OLD.replace('.', '-')}", "driver": f"{OLD}/open",
                     "nodes": ["gpu-0001", "gpu-0002"]}]
    wait_phase(f, made[0]["rollout"], ("Completed",), timeout=90)
    assert {n: v.driver for n, v in views(f).items()} == {COORD: OLD, "gpu-0001": OLD, "gpu-0002": OLD}
    assert log.moves("r1") == ["Progressing", "Aborted"], log.history("r1")
    assert log.moves("r3") == ["Invalid", "Progressing", "Completed"], log.history("r3")
    assert log.moves(made[0]["rollout"]) == ["Progressing", "Completed"]
    assert refusals(deployed, f.audit_from) == []
    log.close()


def test_no_targets_refused_then_excluded_and_paused_for_a_node_not_ready(deployed, make):
    """Completed/NoTargets; (Preflight →) Refused → the spec edited to preflight=Exclude →
    Progressing → Paused/NodesNotReady (the one node left is NotReady past the bound) → Ready again →
    Completed, the refusing node excluded."""
    f = make(4)
    cfg = f.nodes["gpu-0003"].root / "etc/driverd/config.toml"
    (f.work / "empty-repo").mkdir()
    (f.work / "empty-repo/index.json").write_text('{"format": 1, "packages": []}')
    cfg.write_text(cfg.read_text().replace(str(f.repo), str(f.work / "empty-repo")))
    start_with_coordinator(f)
    log = PhaseLog(f)
    rc, out, err = cli(f, "rollout", "start", "--driver", NEW, "--name", "none", "-l", "pool=nothing")
    assert rc == 0 and "no node matches" in err
    assert wait_phase(f, "none", ("Completed",))["status"]["reason"] == "NoTargets"
    f.set_ready("gpu-0002", False, since=time.time() - 120)
    targets = ["gpu-0001", "gpu-0002", "gpu-0003"]
    f.admin.create(rollout_path(), rollout("r", nodeSelector=hosts(*targets), notReadyTimeoutSeconds=30))
    ro = wait_phase(f, "r", ("Refused",), timeout=60)
    assert [p["node"] for p in ro["status"]["preflightFailures"]] == ["gpu-0003"]
    f.admin.patch(rollout_path("r"), {"spec": {"preflight": "Exclude"}})
    ro = wait_phase(f, "r", ("Paused",), timeout=90)
    assert ro["status"]["reason"] == "NodesNotReady" and [n["node"] for n in ro["status"]["notReadyNodes"]] == \
        ["gpu-0002"], ro["status"]
    assert views(f)["gpu-0001"].driver == NEW and views(f)["gpu-0002"].state == m.IDLE
    f.set_ready("gpu-0002", True)
    ro = wait_phase(f, "r", ("Completed",), timeout=90)
    assert ro["status"]["nodes"]["excluded"] == 1 and ro["status"]["nodes"]["done"] == 2, ro["status"]
    assert [views(f)[n].driver for n in targets] == [NEW, NEW, OLD]
    assert log.moves("r") == ["Refused", "Progressing", "Paused", "Progressing", "Completed"], log.history("r")
    assert refusals(deployed, f.audit_from) == []
    log.close()


def test_every_verb_that_writes_takes_kubectls_dry_run(deployed, make):
    """Issue 48: --dry-run=client|server on pause, resume, abort, delete, undo and node retry/skip/unskip, as
    kubectl's: client prints what it would send and sends nothing; server has the API server judge it and
    store nothing; neither changes the cluster."""
    f = make(2)
    f.admin.create(rollout_path(), rollout("r", nodeSelector=hosts("gpu-0001")))
    before = f.admin.get(rollout_path("r"))
    for mode in ("client", "server"):
        said = "(dry run)" if mode == "client" else "(server dry run)"
        for verb in ("pause", "resume", "abort", "delete"):
            out = _ok(f, "rollout", verb, "r", f"--dry-run={mode}")
            assert said in out, (verb, out)
        assert said in _ok(f, "node", "skip", "gpu-0001", f"--dry-run={mode}")
        doc = json.loads(_ok(f, "rollout", "pause", "r", f"--dry-run={mode}", "-o", "json"))
        # client: the patch it would send; server: the object as the API server would store it
        paused = doc["patch"]["spec"]["paused"] if mode == "client" else doc["spec"]["paused"]
        assert paused is True, doc
    now = f.admin.get(rollout_path("r"))
    assert now["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]       # nothing stored
    assert f.admin.get("/api/v1/nodes/gpu-0001")["metadata"].get("annotations", {}).get(m.A_SKIP) is None
    # a bare --dry-run is client, as in kubectl; a server dry run still meets the API's refusals
    assert "(dry run)" in _ok(f, "rollout", "pause", "r", "--dry-run")
    rc, out, err = cli(f, "node", "skip", "no-such-node", "--dry-run=server")
    assert rc != 0 and "no node named no-such-node" in err, (rc, out, err)


def test_nodes_and_pools_take_kubectls_watch(deployed, make):
    """Issue 48: -w on nodes, pools and pool status prints again when what it shows changes, as kubectl's;
    --timeout ends it with exit 0."""
    import threading
    f = make(2)
    f.admin.create("/apis/driverd.io/v1alpha1/driverpools", {
        "apiVersion": "driverd.io/v1alpha1", "kind": "DriverPool", "metadata": {"name": "p"},
        "spec": {"driver": NEW, "nodeSelector": {"matchLabels": {"pool": "p"}}}})

    def skip_later() -> None:
        time.sleep(8)                   # after the watch's first picture, however slowly its process starts
        f.admin.patch("/api/v1/nodes/gpu-0001", {"metadata": {"annotations": {m.A_SKIP: "true"}}})
    for argv in (["nodes", "-w", "--timeout", "20"], ["pools", "-w", "--timeout", "4"],
                 ["pool", "status", "p", "-w", "--timeout", "4"]):
        t = threading.Thread(target=skip_later) if argv[0] == "nodes" else None
        if t:
            t.start()
        rc, out, err = cli(f, *argv)
        if t:
            t.join()
        assert rc == 0, (argv, err)
        pictures = out.strip().split("\n\n")
        if argv[0] == "nodes":
            assert len(pictures) == 2 and "(skip)" not in pictures[0] and "idle (skip)" in pictures[1], out
        else:
            assert len(pictures) == 1 and "p" in pictures[0], out       # nothing changed: printed once
