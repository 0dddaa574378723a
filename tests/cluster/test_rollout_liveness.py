"""Issue 33, section 3: what the real control plane showed of rollouts that stop moving — a failed node
that stays NotReady holding the maxUnavailable budget for ever, a Refused rollout coming back to life
when its nodes answer a later rollout's preflight, one refused write stopping the coordinator's pass
for every rollout.

The real control plane (kube-apiserver, etcd, controller-manager), each daemon with its node-bound
token, deploy/'s admission policies applied, the product's default Lease duration, the coordinator on
a node outside the rollouts (tests/cluster/realfleet.py). Each test failed before its fix."""
from __future__ import annotations

import json
import time
import urllib.error

import pytest

from driverd.cluster import model as m
from driverd.cluster.kube import node_path, rollout_path
from driverd.sim.fleet import NEW, OLD, Fleet
from tests.cluster.realfleet import (  # noqa: F401 (make: a fixture)
    make,
    PhaseLog,
    hosts,
    refusals,
    rollout,
    rollout_events,
    start_with_coordinator,
    views,
    wait_phase,
)

pytestmark = [pytest.mark.real, pytest.mark.slow]
COORD = "gpu-0000"




def test_a_failed_node_that_stays_not_ready_leaves_the_budget_and_still_counts_as_failed(make):
    """Before: `Progressing: 0/4 done, 0 upgrading, 1/1 unavailable, 1 failed; notReadyNodes=[]` for
    ever, three healthy nodes idle. A node NotReady past notReadyTimeoutSeconds is gone, whatever
    its state: it leaves the unavailability count (and is named), and the failure budget still
    counts it as failed."""
    f = make(5)
    f.pdb_never("gpu-0001")                   # holds the first target in `evicting` until the test lets it go
    start_with_coordinator(f)
    log = PhaseLog(f)
    targets = ["gpu-0001", "gpu-0002", "gpu-0003", "gpu-0004"]
    f.admin.create(rollout_path(), rollout("r", nodeSelector=hosts(*targets), failureBudget=1, maxUnavailable=1,
                                           notReadyTimeoutSeconds=10, validation={"timeoutSeconds": 2},
                                           drain={"timeoutSeconds": 120}))
    assert f.wait(lambda: views(f)["gpu-0001"].state == m.EVICTING, 60)
    f.set_ready("gpu-0001", False)           # its kubelet stops: the new driver loads, the node never Ready
    f.set_pdb("gpu-0001", 1)
    assert f.wait(lambda: views(f)["gpu-0001"].state == m.FAILED, 60), vars(views(f)["gpu-0001"])
    failed_at = time.monotonic()
    ro = wait_phase(f, "r", ("Failed",), timeout=10 + 90)
    st = ro["status"]
    assert time.monotonic() - failed_at < 10 + 90
    vs = views(f)
    assert [vs[n].state for n in targets] == [m.FAILED, m.DONE, m.DONE, m.DONE], {n: vs[n].state for n in targets}
    assert not vs["gpu-0001"].ready
    assert st["nodes"]["failed"] == 1 and st["nodes"]["done"] == 3, st
    assert [n["node"] for n in st["failedNodes"]] == ["gpu-0001"]
    assert [n["node"] for n in st["notReadyNodes"]] == ["gpu-0001"], st
    assert st["unavailable"] == 0, st          # the gone node is not counted against the budget
    assert "Progressing" in log.phases("r")
    log.close()


def test_the_failure_budget_still_counts_a_failed_node_that_is_gone(make):
    """The same NotReady failed node with failureBudget 0: the rollout pauses (FailureBudgetSpent),
    it does not carry on because the node left the unavailability count."""
    f = make(3)
    f.pdb_never("gpu-0001")
    start_with_coordinator(f)
    f.admin.create(rollout_path(), rollout("r", nodeSelector=hosts("gpu-0001", "gpu-0002"), failureBudget=0,
                                           notReadyTimeoutSeconds=5, validation={"timeoutSeconds": 2},
                                           drain={"timeoutSeconds": 120}))
    assert f.wait(lambda: views(f)["gpu-0001"].state == m.EVICTING, 60)
    f.set_ready("gpu-0001", False)
    f.set_pdb("gpu-0001", 1)
    assert f.wait(lambda: views(f)["gpu-0001"].state == m.FAILED, 60)
    time.sleep(8)                              # past notReadyTimeoutSeconds
    ro = wait_phase(f, "r", ("Paused",))
    assert ro["status"]["reason"] == "FailureBudgetSpent", ro["status"]
    assert [n["node"] for n in ro["status"]["notReadyNodes"]] == ["gpu-0001"], ro["status"]
    assert views(f)["gpu-0002"].state == m.IDLE


def test_a_refused_rollout_stays_refused_and_holds_no_node(make):
    """Before: the Refused rollout went back to Preflight whenever its nodes answered a later rollout's
    preflight (53 flips), the later one alternated WaitingForPreflight / NodesHeld naming it and
    completed after 121 s, and the Refused one then blamed live daemons ("did not answer the preflight
    within 120s"). A Refused rollout is terminal until an operator changes it: here `node skip` of the
    node that refused, after which it finishes."""
    f = make(4)
    # gpu-0001's repository has no package for the target: its preflight refuses
    cfg = f.nodes["gpu-0001"].root / "etc/driverd/config.toml"
    (f.work / "empty-repo").mkdir()
    (f.work / "empty-repo/index.json").write_text('{"format": 1, "packages": []}')
    cfg.write_text(cfg.read_text().replace(str(f.repo), str(f.work / "empty-repo")))
    start_with_coordinator(f)
    log = PhaseLog(f)
    k = f.admin
    k.create(rollout_path(), rollout("r1", nodeSelector=hosts("gpu-0001", "gpu-0002", "gpu-0003")))
    ro = wait_phase(f, "r1", ("Refused",), timeout=60)
    assert "gpu-0001" in ro["status"]["message"]
    t0 = time.monotonic()
    k.create(rollout_path(), rollout("r2", nodeSelector=hosts("gpu-0002", "gpu-0003"), maxParallel=2,
                                     maxUnavailable=2))
    wait_phase(f, "r2", ("Completed",), timeout=90)
    took = time.monotonic() - t0
    time.sleep(3)                              # r1 must not move afterwards either
    assert log.history("r1")[-1] == ("Refused", "PreflightFailed"), log.history("r1")
    assert log.phases("r1").count("Refused") == 1, log.history("r1")
    assert "NodesHeld" not in [r for _, r in log.history("r2")], log.history("r2")
    assert took < 60, (took, log.history("r2"))
    st = k.get(rollout_path("r1"))["status"]
    assert "did not answer" not in json.dumps(st), st
    assert [p["node"] for p in st["preflightFailures"]] == ["gpu-0001"], st
    assert len(rollout_events(f, "r1", "PreflightFailed")) == 1
    # the operator's verb changes it: gpu-0001 left out, r1 carries on (its other nodes run NEW already)
    assert _cli(f, "node", "skip", "gpu-0001")[0] == 0
    ro = wait_phase(f, "r1", ("Completed",), timeout=60)
    assert ro["status"]["nodes"]["skipped"] == 1 and ro["status"]["nodes"]["done"] == 2, ro["status"]
    assert views(f)["gpu-0001"].driver == OLD and views(f)["gpu-0002"].driver == NEW
    assert "did not answer" not in json.dumps(ro["status"])
    log.close()


SITE_POLICY = "site-maintenance"


def _site_policy(cp, node: str) -> None:
    """A cluster's own admission control besides driverd's: node `node` is under maintenance, and
    driverd may not admit it (what any site policy or webhook may refuse)."""
    cp.api("POST", "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": SITE_POLICY},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                         "operations": ["UPDATE"], "resources": ["nodes"]}]},
                 "matchConditions": [{"name": "that-node", "expression": f"request.name == '{node}'"}],
                 "validations": [{"expression": "object.metadata.?annotations[?'driverd.io/state'].orValue('') "
                                                "!= 'admitted'",
                                  "message": f"node {node} is under maintenance (site policy)",
                                  "reason": "Forbidden"}]}})
    cp.api("POST", "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": SITE_POLICY}, "spec": {"policyName": SITE_POLICY, "validationActions": ["Deny"]}})


def _site_policy_holds(cp, node: str) -> bool:
    """A dry-run of the node's own daemon marking itself admitted (driverd's policies allow it)."""
    tok = cp.token("driverd", "driverd", node=node)
    try:
        cp.api("PATCH", node_path(node) + "?dryRun=All", {"metadata": {"annotations": {m.A_STATE: m.ADMITTED}}},
               token=tok, content_type="application/merge-patch+json")
        return False
    except urllib.error.HTTPError as e:
        return e.code == 403 and "under maintenance" in e.read().decode()


def _drop_site_policy(cp) -> None:
    for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
        try:
            cp.api("DELETE", f"/apis/admissionregistration.k8s.io/v1/{kind}/{SITE_POLICY}")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise


def test_one_refused_admission_is_recorded_on_its_rollout_and_stops_no_other(deployed, make):
    """Before: the refused write aborted the coordinator's whole pass, retried every 2 s, so a later
    rollout got no status at all. Now the refusal is recorded on its own rollout (a condition naming
    the node and the API's words, one Warning Event), the other rollouts go on, and the refused
    admission is tried again later (here: once the site lifts its policy)."""
    cp = deployed
    f = make(3)
    start_with_coordinator(f)
    _site_policy(cp, "gpu-0001")
    try:
        assert f.wait(lambda: _site_policy_holds(cp, "gpu-0001"), 30), "the site policy never took effect"
        k = f.admin
        k.create(rollout_path(), rollout("r1", nodeSelector=hosts("gpu-0001")))
        time.sleep(1)                            # r1 is the older one: the coordinator looks at it first
        k.create(rollout_path(), rollout("r2", nodeSelector=hosts("gpu-0002")))
        ro2 = wait_phase(f, "r2", ("Completed",), timeout=60)
        assert views(f)["gpu-0002"].driver == NEW, ro2["status"]
        st1 = k.get(rollout_path("r1"))["status"]
        cond = {c["type"]: c for c in st1.get("conditions") or []}.get("AdmissionRefused")
        assert cond and cond["status"] == "True", st1
        assert "gpu-0001" in cond["message"] and "under maintenance" in cond["message"], cond
        assert st1["phase"] == "Progressing" and "refused" in st1["message"], st1
        assert views(f)["gpu-0001"].state == m.IDLE
        evs = rollout_events(f, "r1", "AdmissionRefused")
        assert len(evs) == 1 and evs[0]["type"] == "Warning" and "gpu-0001" in evs[0]["message"], evs
        refused = [r for r in refusals(cp, f.audit_from) if "/nodes/gpu-0001" in r and "dryRun" not in r]
        assert 1 <= len(refused) <= 3, refused                # once, not on every pass
    finally:
        _drop_site_policy(cp)
    ro1 = wait_phase(f, "r1", ("Completed",), timeout=90)
    assert not [c for c in ro1["status"].get("conditions") or [] if c["type"] == "AdmissionRefused"
                and c["status"] == "True"], ro1["status"]
    assert views(f)["gpu-0001"].driver == NEW


def _cli(f: Fleet, *argv):
    from tests.cluster.test_rollout import cli
    return cli(f, *argv)
